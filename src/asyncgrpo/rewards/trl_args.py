"""TRL's extra reward arguments: `trainer_state`, `log_metric` and `log_extra`, as trl 1.16's GRPOTrainer passes them.

TRL calls every reward function with ``trainer_state=self.state`` (a transformers TrainerState),
``log_metric=name, value -> None`` (a scalar, averaged over the logging step and logged beside the built-in
metrics) and ``log_extra=column, values -> None`` (a column of the completions table, one value per sample).
Here (rewards/scoring.py passes each only to functions that name it or take ``**kwargs``):

- `TrainerState` carries the TrainerState fields a reward schedules on, with TRL's meaning: `global_step`
  optimizer steps completed when the group is scored, `max_steps` (train.max_steps), `epoch` (float: passes
  over the prompts completed, steps completed x rollout.groups_per_step / prompts), `num_train_epochs`
  (data.num_epochs). It is a frozen, picklable dataclass (a worker process gets a copy).
- `CallLog` is what one call's `log_metric` and `log_extra` write into: plain data, so a call in a worker
  process (rewards/worker.py) records into its own `CallLog` and sends `records()` back with the result, and
  the parent `merge`s them. A bad call (a metric that is not a finite number, a column whose values are not one
  per completion, a value JSON cannot hold) raises at the function's own call site, so it is a reward error
  with the function's traceback, never a lost metric.
- `RewardLog` is the run's side: metric means per name since the last `drain` (one metrics line per step:
  `user/<name>`); what a call that failed logged is never merged.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncgrpo.config import Config

TRL_ARGUMENTS = ("trainer_state", "log_metric", "log_extra")
METRIC_PREFIX = "user/"


@dataclass(frozen=True)
class TrainerState:
    """The fields of transformers' TrainerState a reward function reads, with TRL's meaning (see the module docstring)."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    num_train_epochs: int = 1
    is_world_process_zero: bool = True
    is_local_process_zero: bool = True


def run_trainer_state(cfg: Config, prompts: int, steps_trained: Callable[[], int]) -> TrainerState:
    """The `TrainerState` of a run of `prompts` prompts per epoch, `steps_trained()` steps completed now."""
    step = steps_trained()
    return TrainerState(global_step=step, max_steps=cfg.train.max_steps, epoch=step * cfg.rollout.groups_per_step / max(prompts, 1),
                        num_train_epochs=cfg.data.num_epochs)


class CallLog:
    """What one reward call on a group of `n` completions logged: metric values and extra columns."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.metrics: list[tuple[str, float]] = []
        self.extras: dict[str, list[Any]] = {}

    def log_metric(self, name: str, value: float) -> None:
        """TRL's `log_metric`: a scalar for this group, averaged with the step's other values of `name`."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"log_metric(name, value): name must be a non-empty string, got {name!r}")
        number = _real(value)
        if number is None or not math.isfinite(number):
            raise ValueError(f"log_metric({name!r}, {value!r}): the value must be a finite number")
        self.metrics.append((name, number))

    def log_extra(self, column: str, values: list[Any]) -> None:
        """TRL's `log_extra`: a column with one value per completion of the group, written beside each completion."""
        if not isinstance(column, str) or not column:
            raise TypeError(f"log_extra(column, values): column must be a non-empty string, got {column!r}")
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or len(values) != self.n:
            got = f"{len(values)} values" if hasattr(values, "__len__") and not isinstance(values, (str, bytes)) else type(values).__name__
            raise ValueError(f"log_extra({column!r}, values): give one value per completion ({self.n}), got {got}")
        plain = [_plain(v) for v in values]
        try:
            json.dumps(plain)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"log_extra({column!r}, values): the values must be JSON data (str, numbers, bools, None, lists, dicts): {exc}") from None
        self.extras.setdefault(column, []).extend(plain)

    def records(self) -> tuple[list[tuple[str, float]], dict[str, list[Any]]]:
        """The call's records as plain data (what a worker process sends back)."""
        return self.metrics, self.extras

    def merge(self, records: tuple[list[tuple[str, float]], dict[str, list[Any]]]) -> None:
        metrics, extras = records
        self.metrics.extend(metrics)
        for column, values in extras.items():
            self.extras.setdefault(column, []).extend(values)

    def extra_of(self, index: int) -> dict[str, Any]:
        """Completion `index`'s extra columns (a column logged twice in one call keeps the last values)."""
        return {column: values[-self.n + index] for column, values in self.extras.items()}


class RewardLog:
    """The run's `log_metric` values: sum and count per name since the last `drain`."""

    def __init__(self) -> None:
        self._sums: dict[str, tuple[float, int]] = {}

    def add(self, call: CallLog) -> None:
        for name, value in call.metrics:
            total, count = self._sums.get(name, (0.0, 0))
            self._sums[name] = (total + value, count + 1)

    def drain(self) -> dict[str, float]:
        """`user/<name>`: the mean of each metric logged since the last drain; then start over."""
        means = {f"{METRIC_PREFIX}{name}": total / count for name, (total, count) in self._sums.items()}
        self._sums = {}
        return means


def _real(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if getattr(value, "shape", None) in ((), []) and hasattr(value, "item"):  # numpy / torch 0-d
        return _real(value.item())
    return None


def _plain(value: Any) -> Any:
    """numpy / torch scalars as Python numbers (TRL users log them); anything else as it is."""
    if getattr(value, "shape", None) in ((), []) and hasattr(value, "item"):
        return value.item()
    return value
