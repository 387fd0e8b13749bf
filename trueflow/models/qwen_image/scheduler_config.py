"""The scheduler config of Qwen-Image checkpoints, in a module of its own: the family spec reads it without loading
diffusers' schedulers (trueflow/models/qwen_image/schedule.py computes the schedule from it)."""

# The `scheduler/scheduler_config.json` of the released Qwen-Image checkpoint (as released).
QWEN_IMAGE_SCHEDULER_CONFIG: dict = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "invert_sigmas": False,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "stochastic_sampling": False,
}
