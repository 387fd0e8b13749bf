"""The scheduler config of LTX-2 checkpoints, in a module of its own: the family spec reads it without loading
diffusers' schedulers (trueflow/models/ltx2/schedule.py computes the schedule from it)."""

# `scheduler/scheduler_config.json` of the diffusers LTX-2 checkpoints: an exponential time shift by token count
# (mu from 1024..4096 tokens -> 0.95..2.05; LTX2Pipeline falls back to the same four values for a config that lacks
# them) and the sigmas stretched so the last one before the appended 0 is 0.1.
LTX2_SCHEDULER_CONFIG: dict = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.95,
    "max_shift": 2.05,
    "base_image_seq_len": 1024,
    "max_image_seq_len": 4096,
    "shift_terminal": 0.1,
    "time_shift_type": "exponential",
    "invert_sigmas": False,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "stochastic_sampling": False,
}
