"""Engine building blocks. Each numerically sensitive op is a module whose `impl` is a plain function:
the engine's fast kernel by default, swapped for a train-exact one by a rollout patch group."""
