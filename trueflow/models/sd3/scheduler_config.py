"""The scheduler config of SD3.5 checkpoints, in a module of its own: the family spec reads it without loading
diffusers' schedulers (trueflow/models/sd3/schedule.py computes the schedule from it)."""

# `scheduler/scheduler_config.json` of stabilityai/stable-diffusion-3.5-medium (the "SD3.5 Medium Public Release"
# commit, as mirrored on the Hub): a static time shift of 3.0 and no dynamic shifting (diffusers' default
# `use_dynamic_shifting=False` fills in the rest).
SD3_SCHEDULER_CONFIG: dict = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "shift": 3.0,
}
