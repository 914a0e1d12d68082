"""The stub trainer of the simulator: a step takes virtual time and learns nothing.

A step takes `simulate.step_time_s`, or, with `simulate.token_time_s`, that many seconds per
completion token of its batch plus `simulate.step_overhead_s` (a line in the trained tokens); with
`hardware` (simulate.contention) that time is work on hardware it shares with generation, slower
while requests decode (generation/contention.py). It reports
only what it can measure honestly from the batch (no loss, no gradients), and publishes no
weights (`generation_weights()` is None), so the scripted backend only records the new
serving version. With an `algorithm` (algorithms/), a step adds the algorithm's own metrics
(`step_metrics`, computed from the batch: distillation's `distill/kl_mean`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from asyncgrpo.algorithms.base import Algorithm
from asyncgrpo.generation.contention import SharedHardware, Work
from asyncgrpo.types import Group


class StubTrainer:
    def __init__(self, step_time_s: float, token_time_s: float | None = None, *, algorithm: Algorithm | None = None,
                 step_overhead_s: float = 0.0, hardware: SharedHardware | None = None) -> None:
        self.step_time_s = step_time_s
        self.algorithm = algorithm
        self.token_time_s = token_time_s
        self.step_overhead_s = step_overhead_s
        self.hardware = hardware
        self.trained_groups: list[Group] = []

    async def train_step(self, groups: list[Group]) -> dict[str, float]:
        completions = [r.completion for g in groups for r in g.rollouts]
        tokens = sum(len(c.token_ids) for c in completions)
        seconds = self.step_time_s if self.token_time_s is None else self.step_overhead_s + self.token_time_s * tokens
        if self.hardware is None:
            await asyncio.sleep(seconds)
        else:
            await self.hardware.perform("train", Work(seconds))
        self.trained_groups.extend(groups)
        metrics = {
            "completion/len_mean": tokens / len(completions),
            "completion/len_max": float(max(len(c.token_ids) for c in completions)),
        }
        if self.algorithm is not None:
            metrics.update(self.algorithm.step_metrics(groups))
        return metrics

    def generation_weights(self) -> Mapping[str, Any] | None:
        return None
