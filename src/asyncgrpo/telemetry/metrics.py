"""Per-step metrics: one JSON object per step in `metrics.jsonl`, and sampled completions in `samples.jsonl`.

Invariants:
- The key set is fixed when the run starts (DESIGN.md §5 names plus `reward/<function>`,
  `eval/*` and `eval/reward/<function>`) and every line carries every key, so charts have no gaps. A step that cannot
  produce a value (an eval metric before the first evaluation) writes null; a missing or
  unexpected key is a bug and raises. The one open family is `user/<name>`, what reward functions log with
  TRL's `log_metric` (rewards/trl_args.py): a name is in every line from the first step that logged it on
  (null in a step that did not).
- Lines are flushed as they are written, so a killed run keeps every finished step.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any

from asyncgrpo.errors import AsyncGRPOError
from asyncgrpo.metric_names import (
    COUNTER_NAMES,
    EVAL_KEYS,
    GENERATOR_COUNTERS,
    PIPELINE_KEYS,
    STEP_KEYS,
    TRAIN_KEYS,
    offpolicy_keys,
)
from asyncgrpo.rewards.trl_args import METRIC_PREFIX
from asyncgrpo.types import StepRecord

log = logging.getLogger("asyncgrpo")


def metric_keys(reward_names: Iterable[str], *, max_staleness: int, algorithm_keys: Iterable[str] = ()) -> tuple[str, ...]:
    """Every key of a run's metrics lines; `algorithm_keys`: the algorithm's own (algorithms/, `metric_keys`); the off-policy
    diagnostics cover staleness 0..`max_staleness` (rollout.trained_staleness_bound)."""
    return (
        *STEP_KEYS,
        *PIPELINE_KEYS,
        *(f"reward/{name}" for name in reward_names),
        *TRAIN_KEYS,
        *offpolicy_keys(max_staleness),
        *algorithm_keys,
        *COUNTER_NAMES,
        *GENERATOR_COUNTERS.values(),
        *EVAL_KEYS,
        *(f"eval/reward/{name}" for name in reward_names),
    )


def step_metrics(
    record: StepRecord,
    collector_values: Mapping[str, float],
    *,
    reward_names: list[str],
    elapsed_s: float,
    gen_tokens_per_s: float,
    eval_metrics: dict[str, float | None],
) -> dict[str, Any]:
    """One metrics line. `collector_values`: the collector's gauges and counters by name (`Collector.metric_values()`)."""
    rewards = [r.reward for g in record.batch for r in g.rollouts]
    per_function = {
        f"reward/{name}": _mean([r.reward_terms.get(name) for g in record.batch for r in g.rollouts])
        for name in reward_names
    }
    values: dict[str, Any] = {
        "step": record.step,
        "version": record.step + 1,
        "staleness/mean": statistics.fmean(record.staleness),
        "staleness/max": max(record.staleness),
        "time/trainer_wait_s": record.wait_s,
        "time/step_s": record.step_s,
        "time/weight_sync_s": record.weight_sync_s,
        "time/elapsed_s": elapsed_s,
        "throughput/gen_tokens_per_s": gen_tokens_per_s,
        # Mean length of the finished completions thrown away as stale, to compare with
        # completion/len_mean: stale cancellation must not quietly favour short answers. Over finished completions only:
        # a distilled sample cancelled in flight is a stale sample with no completion (and its tokens are not counted).
        "rollout/stale_len_mean": _ratio(collector_values["rollout/wasted_tokens_total"], collector_values["rollout/stale_completions_total"]),
        "rollout/trained_len_mean": _ratio(collector_values["rollout/trained_tokens_total"], collector_values["rollout/trained_completions_total"]),
        # Share of generator time (rollouts' start to end) that ended in trained tokens.
        "rollout/goodput": _ratio(collector_values["rollout/trained_generation_ms_total"], collector_values["rollout/generation_ms_total"]),
        "reward/mean": statistics.fmean(rewards),
        # Model turns per episode of the batch; null without environments.
        "env/turns_mean": _mean([r.completion.episode.turns if r.completion.episode else None for g in record.batch for r in g.rollouts]),
        "reward/std": statistics.pstdev(rewards),
        **per_function,
        **record.train_metrics,
        **collector_values,
        **eval_metrics,
    }
    return values


def generator_values(stats: Mapping[str, Any]) -> dict[str, float | None]:
    """The `generation/*` values of a step's line from its backend's `stats()` (empty for a backend that has none):
    every name of GENERATOR_COUNTERS, null where this backend keeps no such counter."""
    return {metric: stats.get(counter) for counter, metric in GENERATOR_COUNTERS.items()}


class MovingRate:
    """A rate over the last `window` observations of a running total (tokens generated), so the
    `throughput/gen_tokens_per_s` of a step does not swing with when in the step rollouts happened to finish."""

    def __init__(self, t: float, total: float, window: int = 10) -> None:
        self.points: deque[tuple[float, float]] = deque([(t, total)], maxlen=window + 1)

    def add(self, t: float, total: float) -> float:
        """Record the total at time `t`; the rate since the oldest point kept (0 when no time passed)."""
        self.points.append((t, total))
        (t0, total0) = self.points[0]
        return (total - total0) / (t - t0) if t > t0 else 0.0


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file this module wrote. Only a last line cut short (no newline: a run killed
    mid-write, or one still writing) is forgiven: it is left out with a warning naming it. A damaged line anywhere
    else, a complete last line included, is an error naming the file and the line, never skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise AsyncGRPOError(
            f"{path} is not UTF-8 text (byte {exc.start} cannot be decoded): it is not a JSON-lines record asyncgrpo wrote, "
            f"or it was damaged. Fix: restore it from a copy (a training run's checkpoints keep one of metrics.jsonl, "
            f"outcomes.jsonl and timeline.jsonl in records/), or point at the right file."
        ) from None
    texts = text.splitlines()
    records = []
    for number, line in enumerate(texts, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(texts) and not text.endswith("\n"):
                log.warning("warning: %s, line %d, was cut short (its writer stopped mid-line): left out", path, number)
                break
            raise AsyncGRPOError(
                f"{path}, line {number}, is not a JSON record ({exc.msg}): the file was damaged after it was written. "
                f"Fix: restore it from a copy (a training run's checkpoints keep one of metrics.jsonl, outcomes.jsonl and "
                f"timeline.jsonl in records/), or remove the damaged line."
            ) from None
    return records


class JsonlFile:
    """An append-only JSON-lines file, flushed per line. `truncate_to` cuts it back to a checkpoint's
    offset first, so a resumed run continues the file exactly where its checkpoint was taken."""

    def __init__(self, path: Path, truncate_to: int | None = None) -> None:
        self.path = path
        self._file: IO[str] = path.open("a", encoding="utf-8")
        if truncate_to is not None:
            size = self._file.seek(0, os.SEEK_END)
            if truncate_to > size:  # truncate() would pad the file with NUL bytes
                self._file.close()
                raise ValueError(f"{path} has {size} bytes, fewer than the offset {truncate_to} to continue from")
            self._file.truncate(truncate_to)
            self._file.seek(truncate_to)

    def append(self, line: dict[str, Any]) -> None:
        self.append_lines([line])

    def append_lines(self, lines: Iterable[dict[str, Any]]) -> None:
        """Append `lines` in one write, then flush."""
        self._file.write("".join(json.dumps(line) + "\n" for line in lines))
        self._file.flush()

    def offset(self) -> int:
        return self._file.tell()

    def close(self) -> None:
        self._file.close()


class MetricsWriter:
    """Appends step metrics to `metrics.jsonl`, checking the key set on every line."""

    def __init__(self, file: JsonlFile, keys: tuple[str, ...]) -> None:
        self.file = file
        self.keys = keys
        self.user_keys: dict[str, None] = {}  # `user/<name>` keys seen so far, in order

    def write(self, values: dict[str, Any]) -> dict[str, Any]:
        """Append the line of `values` and return it as written (non-finite numbers as null)."""
        missing = [k for k in self.keys if k not in values]
        extra = [k for k in values if k not in self.keys and not k.startswith(METRIC_PREFIX)]
        if missing or extra:
            raise AssertionError(f"metrics line for step {values.get('step')}: missing {missing}, unexpected {extra}")
        self.user_keys.update(dict.fromkeys(k for k in values if k.startswith(METRIC_PREFIX)))
        line = {k: _finite_or_none(values.get(k)) for k in (*self.keys, *self.user_keys)}
        self.file.append(line)
        return line


def write_samples(file: JsonlFile, record: StepRecord, per_step: int) -> None:
    """A few completions of the step (prompt, completion, reward, advantage, version) to `samples.jsonl`."""
    rollouts = [(group, rollout) for group in record.batch for rollout in group.rollouts][:per_step]
    for group, rollout in rollouts:
        file.append(
            {
                "step": record.step,
                "prompt_id": group.prompt.id,
                "prompt": group.prompt.text,
                "completion": rollout.completion.text,
                "reward": rollout.reward,
                "advantage": rollout.advantage,
                "generation_version": rollout.completion.generation_version,
                "finish_reason": rollout.completion.finish_reason,
                **({"extra": dict(rollout.extra)} if rollout.extra else {}),  # what reward functions logged with log_extra
            }
        )


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
