"""Tensor parallelism for the rollout engine (docs/tensor-parallel.md): a family's shard plan as data (`plan`), the
rank-ordered reduction and the all-gather (`comm`), the sharded linear layers (`linear`), applying a plan to a built
engine model and loading it sharded (`engine`), and the train side computing each sharded op as the engine's ranks do
(`train_match`). The model code knows nothing of it: a plan is applied to a built model by swapping its linear layers
and hooking the modules that read every head."""
