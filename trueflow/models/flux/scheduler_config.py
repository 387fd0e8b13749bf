"""The scheduler config of FLUX.1-dev checkpoints, in a module of its own: the family spec reads it without loading
diffusers' schedulers (trueflow/models/flux/schedule.py computes the schedule from it)."""

# black-forest-labs/FLUX.1-dev `scheduler/scheduler_config.json` (not stored in the sources searchable here; its
# values as public copies of it repeat them, e.g. a trainer's `flux_config` with `_diffusers_version` 0.30.0.dev0:
# dynamic shifting from 256 to 4096 image tokens between shifts 0.5 and 1.15, the exponential time shift being
# FlowMatchEulerDiscreteScheduler's default). `shift` 3.0 is unused with dynamic shifting.
FLUX_SCHEDULER_CONFIG: dict = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}
