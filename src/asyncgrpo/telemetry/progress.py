"""The console during training: what the run is doing, step by step, and the totals its summary prints.

`Progress` shows a progress bar on stderr (step/max and ETA from tqdm; reward, the latest
evaluation, staleness, groups in flight, the trainer's wait share, tokens/s as a moving average,
and the failure/stale/dropped counters once they are non-zero), or, with `logging.progress:
false` (CI logs, files), one line with the same fields every tenth of the run. `stage()` says what
the run is doing before its first step (loading the model, waiting for servers, the baseline
evaluation), so a long start is never silent. `RunTotals` keeps what the end-of-run summary needs.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any

from asyncgrpo.config import Config
from asyncgrpo.types import StepRecord

log = logging.getLogger("asyncgrpo")

# Counters shown once non-zero: (metric key, short name).
SHOWN_COUNTERS = (
    ("rollout/failed_total", "failed"),
    ("rollout/stale_groups_total", "stale"),
    ("rollout/dropped_groups_total", "dropped"),
)


@dataclass
class RunTotals:
    """Running totals of the steps this process trained, for the bar and the end-of-run summary."""

    steps: int = 0
    samples: int = 0
    tokens: int = 0
    wait_s: float = 0.0
    busy_s: float = 0.0  # training and weight sync
    staleness: list[float] = field(default_factory=list)
    eval_first: float | None = None
    eval_last: float | None = None
    kl_first: float | None = None  # distill/kl_mean (algorithm: distill) of the first step that has one, and of the last
    kl_last: float | None = None
    last: dict[str, Any] = field(default_factory=dict)

    def add(self, values: dict[str, Any], record: StepRecord) -> None:
        self.steps += 1
        self.samples += sum(len(group.rollouts) for group in record.batch)
        self.tokens += sum(len(r.completion.token_ids) for group in record.batch for r in group.rollouts)
        self.wait_s += record.wait_s
        self.busy_s += record.step_s + record.weight_sync_s
        self.staleness.extend(record.staleness)
        self.last = values
        self.evaluated(values.get("eval/reward_mean"))
        if (kl := values.get("distill/kl_mean")) is not None:
            self.kl_first = kl if self.kl_first is None else self.kl_first
            self.kl_last = kl

    def evaluated(self, reward: float | None) -> None:
        if reward is None:
            return
        if self.eval_first is None:
            self.eval_first = reward
        self.eval_last = reward

    @property
    def wait_share(self) -> float | None:
        """The part of the trainer's time spent waiting for a batch (generation-bound when high)."""
        total = self.wait_s + self.busy_s
        return self.wait_s / total if total > 0 else None


def step_fields(values: dict[str, Any], totals: RunTotals, in_flight_groups: int) -> dict[str, str]:
    """The short fields of the bar or the log line after a step."""
    fields = {"reward": f"{values['reward/mean']:.3f}"}
    if values.get("eval/reward_mean") is not None:
        fields["eval"] = f"{values['eval/reward_mean']:.3f}"
    fields["stale"] = f"{values['staleness/mean']:.1f}/{values['staleness/max']}"
    fields["inflight"] = str(in_flight_groups)
    if totals.wait_share is not None:
        fields["wait"] = f"{totals.wait_share:.0%}"
    fields["tok/s"] = f"{values['throughput/gen_tokens_per_s']:.0f}"
    for key, name in SHOWN_COUNTERS:
        if values.get(key):
            fields[name] = str(values[key])
    return fields


class Progress:
    """A progress bar on stderr, or a line every tenth of the run when `logging.progress` is off."""

    def __init__(self, cfg: Config, start_step: int) -> None:
        self.every = max(1, cfg.train.max_steps // 10)
        self.max_steps = cfg.train.max_steps
        self.totals = RunTotals()
        self.bar = None
        if cfg.logging.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.train.max_steps, initial=start_step, desc="train", unit="step", file=sys.stderr,
                            dynamic_ncols=True, delay=0.1)

    def stage(self, message: str) -> None:
        """Say what the run is doing now (before its steps start, or between them)."""
        if self.bar is not None:
            self.bar.set_description_str(message, refresh=True)
        else:
            log.info("%s", message)

    def update(self, values: dict[str, Any], record: StepRecord, in_flight_groups: int) -> None:
        self.totals.add(values, record)
        fields = step_fields(values, self.totals, in_flight_groups)
        if self.bar is not None:
            self.bar.set_description_str("train", refresh=False)
            self.bar.set_postfix(fields, refresh=False)
            self.bar.update(1)
        elif (values["step"] + 1) % self.every == 0 or values["step"] + 1 == self.max_steps:
            log.info("step %d/%d  %s", values["step"] + 1, self.max_steps, "  ".join(f"{k} {v}" for k, v in fields.items()))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
