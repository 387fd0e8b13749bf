"""The building blocks every family's engine DiT is wired from: one attention dispatcher (`attention`), norms,
modulation and gates, q/k norms and rotary embeddings, LoRA linears, the MLP and the timestep sinusoid.

Each numerically sensitive op is a module whose `impl` is a plain function: the engine's fast kernel by default,
swapped for a train-exact one by a family's rollout patch group. A family's folder keeps only what is its own (its
config, its blocks' wiring, its RoPE positions and tables, its patch group's diffusers-mirroring references)."""
