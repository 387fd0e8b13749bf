"""The scheduler configs of the Wan2.2 Diffusers checkpoints, in a module of their own: the family spec reads them
without loading diffusers' schedulers (`schedule.py` computes the schedule from a checkpoint's config).

Both checkpoints ship a `UniPCMultistepScheduler` in flow mode, as diffusers' conversion (`scripts/
convert_wan_to_diffusers.py`) builds it: `UniPCMultistepScheduler(prediction_type="flow_prediction",
use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=...)` with `flow_shift` 3.0 for the A14B and 5.0 for the
TI2V-5B. (The hub's JSON files were not readable here; these are the values the conversion writes.) The RL sampler
takes the shift from it and steps on FlowMatchEulerDiscreteScheduler's sigmas (schedule.py says why)."""

A14B_FLOW_SHIFT = 3.0  # convert_wan_to_diffusers.py: `flow_shift = 3.0` for every model but TI2V / Animate / FLF2V
TI2V_FLOW_SHIFT = 5.0  # ... `elif "TI2V" in args.model_type or "Animate" in args.model_type: flow_shift = 5.0`


def unipc_config(flow_shift: float) -> dict:
    return {"_class_name": "UniPCMultistepScheduler", "num_train_timesteps": 1000,
            "prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": flow_shift}


WAN_A14B_SCHEDULER_CONFIG: dict = unipc_config(A14B_FLOW_SHIFT)
WAN_TI2V_SCHEDULER_CONFIG: dict = unipc_config(TI2V_FLOW_SHIFT)
