"""Human-readable parity reports."""

from __future__ import annotations

from .probe import ProbeResult, ProbeSpec


def _fmt(x: float | None) -> str:
    return "-" if x is None else ("0.0" if x == 0 else f"{x:.3e}")


def format_result(spec: ProbeSpec, r: ProbeResult, max_layers: int = 12) -> str:
    src = spec.checkpoint or f"random {spec.random_size}"
    lines = [
        f"parity probe: {src}  batch {spec.batch}"
        + (f" (train micro-batches of {spec.train_micro_batch})" if spec.train_micro_batch else "")
        + f"  text {spec.text_len}  {spec.resolution}px  {spec.dtype}  "
        f"LoRA rank {spec.lora_rank or '-'}  device {spec.device}" + (f"  expert {r.expert}" if spec.expert else "")
        + (f"  guided output (CFG {spec.cfg_scale})" if spec.cfg_scale > 1 else ""),
        f"  patch group {r.patch_group}"
        + (f" (disabled: {', '.join(r.disabled_patches)})" if r.disabled_patches else ""),
        f"  attention: train {r.train_attention_backend}, engine {r.engine_attention_backend}",
        f"  model_output_max_abs_diff  {_fmt(r.model_output_max_abs_diff)}",
        f"  model_output_mean_abs_diff {_fmt(r.model_output_mean_abs_diff)}",
        f"  bitwise equal: {'yes' if r.bitwise_equal else 'no'}",
    ]
    if r.first_differing_module:
        lines.append(f"  first differing module: {r.first_differing_module} "
                     f"(max abs diff {_fmt(r.first_differing_max_abs_diff)})")
        lines.append("  per-layer (train execution order, from the first difference):")
        start = next(i for i, row in enumerate(r.layers) if row.max_abs_diff > 0)
        for row in r.layers[start:start + max_layers]:
            lines.append(f"    {row.module:55s} max {_fmt(row.max_abs_diff):>10s}  mean {_fmt(row.mean_abs_diff):>10s}")
    else:
        lines.append(f"  all {len(r.layers)} compared modules bitwise equal")
    return "\n".join(lines)


def format_ablation(results: list[ProbeResult]) -> str:
    lines = ["", "ablation: each patch switched off alone",
             f"  {'configuration':45s} {'max abs diff':>12s} {'mean abs diff':>13s}  first differing module",
             "  " + "-" * 110]
    for r in results:
        if r.patch_group == "none":
            label = "--patch-group none"
        elif r.disabled_patches:
            label = f"without {r.disabled_patches[0]}"
        else:
            label = f"--patch-group {r.patch_group} (all patches)"
        lines.append(f"  {label:45s} {_fmt(r.model_output_max_abs_diff):>12s} "
                     f"{_fmt(r.model_output_mean_abs_diff):>13s}  "
                     f"{r.first_differing_module or '-'}")
    return "\n".join(lines)
