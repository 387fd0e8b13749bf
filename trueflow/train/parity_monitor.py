"""An optimizer step's train/rollout parity and the policy's change since the rollout.

The train/rollout mismatch (`model_output_*`, `log_prob_max_abs_diff`, `ratio_mean`, `ratio_max_abs_dev_from_1`)
compares the train forward at the weights the engine rolled out with to the engine's records: on a rollout's first
step those are the current weights; on its later steps the policy has moved, so the mismatch is null there unless
`parity_on_every_step` measures it against a kept copy of the rolled-out LoRA. A rollout made by older weights
(`--async-rollouts`) is measured against their kept copy at every step. The policy's own change since the
rollout (`policy_*`) is the current policy against the engine's log-probs, at every step."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import contextmanager

import torch
import torch.distributed as dist

from .batch import TrainBatch
from .dist import all_reduce

MISMATCH_KEYS = ("model_output_max_abs_diff", "model_output_mean_abs_diff", "log_prob_max_abs_diff", "ratio_mean",
                 "ratio_max_abs_dev_from_1")


def keep_rolled_out(named_params: dict[str, torch.nn.Parameter], parity_on_every_step: bool,
                    num_steps_per_rollout: int) -> dict[str, torch.Tensor] | None:
    """The masters the engine rolled out with (it holds their compute copies), for later steps' mismatch; None
    when no later step measures it."""
    if not (parity_on_every_step and num_steps_per_rollout > 1):
        return None
    return {n: p.detach().clone() for n, p in named_params.items()}


class ParityMonitor:
    """One optimizer step's measurements, over its micro-batches and every rank."""

    def __init__(self, current_rolled_out: bool, kept: dict[str, torch.Tensor] | None):
        """`current_rolled_out`: the current weights are the ones the engine rolled out with (a rollout's first
        step, synchronously); `kept`: else the rolled-out LoRA masters (`keep_rolled_out`, or an async rollout's
        version), or None."""
        self.first = current_rolled_out
        self.kept = kept
        self.mismatch = _Mismatch() if self.first or kept is not None else None
        self.policy = _Mismatch()

    def measure_rolled_out(self, named_params: dict[str, torch.nn.Parameter], batches: Iterable,
                           forward: Callable[[object], tuple[TrainBatch, torch.Tensor, torch.Tensor]]) -> None:
        """On a later step with a kept copy: the rolled-out weights swapped in, `forward(rows)` -> (batch, guided,
        log_prob) over the micro-batches, the current weights back. A no-op otherwise."""
        if self.first or self.kept is None:
            return
        with torch.no_grad(), _swapped(named_params, self.kept):
            assert self.mismatch is not None  # made where there are kept weights
            for rows in batches:
                self.mismatch.add(*forward(rows))

    def add(self, b: TrainBatch, guided: torch.Tensor, log_prob: torch.Tensor) -> None:
        """A micro-batch of the train forward at the current weights (under no_grad)."""
        self.policy.add(b, guided, log_prob)
        if self.first:
            assert self.mismatch is not None  # made for the first rollout
            self.mismatch.add(b, guided, log_prob)

    def reduce(self) -> tuple[dict, float]:
        """(the step's parity and policy metrics, the rows measured over every rank); a collective."""
        policy = self.policy.reduce()
        measured = self.mismatch.reduce() if self.mismatch is not None else dict.fromkeys(MISMATCH_KEYS)
        return {
            **{k: measured[k] for k in MISMATCH_KEYS},
            "parity_measured": self.mismatch is not None,
            "policy_ratio_mean": policy["ratio_mean"],
            "policy_ratio_max_abs_dev_from_1": policy["ratio_max_abs_dev_from_1"],
            "policy_log_prob_max_abs_diff": policy["log_prob_max_abs_diff"],
        }, policy["rows"]


@contextmanager
def _swapped(params: dict[str, torch.nn.Parameter], values: dict[str, torch.Tensor]):
    """`values` in place of the parameters' (same sharding), the current ones put back after; under no_grad."""
    current = {name: p.detach().clone() for name, p in params.items()}
    for name, p in params.items():
        p.detach().copy_(values[name])
    try:
        yield
    finally:
        for name, p in params.items():
            p.detach().copy_(current[name])


class _Mismatch:
    """A train forward against the engine's records, over a step's micro-batches (and ranks): model output and
    log-prob differences, the likelihood ratio."""

    def __init__(self):
        self.maxes = {"model_output_max_abs_diff": 0.0, "log_prob_max_abs_diff": 0.0, "ratio_max_abs_dev_from_1": 0.0}
        self.sums = {"abs_diff_sum": 0.0, "numel": 0.0, "ratio_sum": 0.0, "rows": 0.0}

    def add(self, b: TrainBatch, guided: torch.Tensor, log_prob: torch.Tensor) -> None:
        d = (guided.detach().float() - b.engine_guided.float()).abs()
        lp = (log_prob.detach() - b.old_log_prob).abs()
        ratio = torch.exp(log_prob.detach() - b.old_log_prob)
        for key, value in (("model_output_max_abs_diff", d.max()), ("log_prob_max_abs_diff", lp.max()),
                           ("ratio_max_abs_dev_from_1", (ratio - 1).abs().max())):
            self.maxes[key] = max(self.maxes[key], value.item())
        self.sums["abs_diff_sum"] += d.sum().item()
        self.sums["numel"] += d.numel()
        self.sums["ratio_sum"] += ratio.sum().item()
        self.sums["rows"] += ratio.numel()

    def reduce(self) -> dict:
        """Over every rank (a collective)."""
        maxes = all_reduce(self.maxes, dist.ReduceOp.MAX)
        sums = all_reduce(self.sums, dist.ReduceOp.SUM)
        return {**maxes, "model_output_mean_abs_diff": sums["abs_diff_sum"] / max(sums["numel"], 1),
                "ratio_mean": sums["ratio_sum"] / max(sums["rows"], 1), "rows": sums["rows"]}
