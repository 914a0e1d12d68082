"""The Python API: `asyncgrpo.Trainer(model=..., reward_funcs=[...], train_dataset=ds, ...).train()`.

A `Trainer` holds a validated config (api_config.py: a recipe, a dict, TRL's argument names,
Python objects, dotted overrides) and runs it as `asyncgrpo train` does (commands/run_training.py): the same
preflight, run directory, checkpoints, records and messages. docs/python_api.md is the guide.

Outcomes of `Trainer.train()`:
- completed, or stopped by `Trainer.stop()` (from another thread, a callback, a signal handler
  of your own): returns a `Result` (`outcome` ``completed`` or ``interrupted``);
- stopped by Ctrl-C / SIGTERM: the step in progress finishes, a checkpoint is saved, then
  KeyboardInterrupt is raised (exactly that type, so an uncaught one ends a script with exit
  130 as Python scripts do), its `result` attribute and `Trainer.result` the `Result`;
- failed or stalled: `RunFailed` (an AsyncGRPOError) carrying the `Result`, its message the
  run's summary with the first error;
- a config mistake: `ConfigError` before anything loads, with the CLI's paragraph.
Nothing here calls sys.exit or leaves a signal handler, thread, logging handler or registered
object behind: two runs, one after the other, in one process work like two commands.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncgrpo.algorithms.registry import algorithm_for
from asyncgrpo.api_config import Prepared, build_config, dotted_tree
from asyncgrpo.commands.run_training import STOP_CALL, RunControl, run_training
from asyncgrpo.commands.train_summary import RunSummary
from asyncgrpo.config import Config, merge, validate_config
from asyncgrpo.errors import AsyncGRPOError
from asyncgrpo.objects import registered
from asyncgrpo.rundir import METRICS_FILE


@dataclass(frozen=True)
class Result:
    """What a run left: its summary, how it was stopped, and its files."""

    summary: RunSummary
    stopped_by: str | None = None  # "SIGINT", "SIGTERM", "stop()", or None

    @property
    def outcome(self) -> str:
        """``completed``, ``interrupted`` (a stop or a signal), ``failed`` or ``stalled``."""
        return "interrupted" if self.stopped_by is not None else self.summary.result.outcome

    @property
    def run_dir(self) -> Path:
        return self.summary.run_dir

    @property
    def steps(self) -> int:
        """Optimizer steps the run has completed (a resumed run counts its earlier steps too)."""
        return self.summary.result.steps

    @property
    def final_checkpoint(self) -> Path | None:
        return self.summary.final_checkpoint

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """One dict per trained step, read from the run directory's metrics.jsonl (a resumed run's earlier steps too)."""
        path = self.run_dir / METRICS_FILE
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]

    def __str__(self) -> str:
        return self.summary.render()


class RunFailed(AsyncGRPOError):
    """The run failed or stalled; the message is its summary (the first error first), `result` what it left."""

    def __init__(self, result: Result) -> None:
        super().__init__(result.summary.render())
        self.result = result


class Trainer:
    """One training run, configured as in the module docstring of api_config.py.

    The first five arguments are TRL's `GRPOTrainer` names, in its order: `model` (a hub id, a
    local directory or builtin:tiny), `reward_funcs` (callables or ``module:function`` /
    ``builtin:<name>`` strings), `train_dataset` and `eval_dataset` (a `datasets.Dataset`, a list
    of dicts, or a data.source string), `args` (TRL's GRPOConfig or a dict of its fields).
    `config` is asyncgrpo's own recipe (a path, a dict or a `Config`); keyword arguments are
    dotted overrides (``**{"train.max_steps": 5}``) or whole sections (``train={"max_steps": 5}``).
    """

    def __init__(
        self,
        model: Any = None,
        reward_funcs: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        args: Any = None,
        *,
        config: str | os.PathLike[str] | Mapping[str, Any] | Config | None = None,
        reward_weights: list[float] | None = None,
        environment_factory: Any = None,
        **overrides: Any,
    ) -> None:
        self._prepared = build_config(
            config, args=args, model=model, reward_funcs=reward_funcs, reward_weights=reward_weights,
            train_dataset=train_dataset, eval_dataset=eval_dataset, environment_factory=environment_factory,
            overrides=overrides,
        )
        algorithm_for(self._prepared.config)  # the algorithm's own rules on the recipe (algorithms/registry.py)
        self._control: RunControl | None = None
        self.result: Result | None = None

    @property
    def config(self) -> Config:
        """The validated config (what config.yaml in the run directory will hold)."""
        return self._prepared.config

    def train(self, resume_from_checkpoint: bool | str | os.PathLike[str] | None = None) -> Result:
        """Run the training (see the module docstring for what it returns or raises).

        `resume_from_checkpoint` (TRL's name) sets checkpoint.resume for this run: None keeps the
        config's (``auto``: continue the newest checkpoint of the run directory, as the CLI does),
        True is ``auto``, False ``never``, a path that checkpoint."""
        prepared = self._with_resume(resume_from_checkpoint)
        control = self._control = RunControl()
        try:
            summary = run_training(prepared, control)
        finally:
            self._control = None
        self.result = result = Result(summary, control.stopped_by)
        if control.stopped_by is not None and control.stopped_by != STOP_CALL:
            interrupt = KeyboardInterrupt(f"training interrupted by {result.stopped_by} after {result.steps} steps (a checkpoint is "
                                          f"saved; the same Trainer(...).train() continues it); run directory {result.run_dir}")
            setattr(interrupt, "result", result)  # noqa: B010 - a plain KeyboardInterrupt, with the run's result on it
            raise interrupt
        if control.stopped_by is None and summary.result.outcome != "completed":
            raise RunFailed(result)
        return result

    def stop(self) -> None:
        """Ask the run in progress to stop as Ctrl-C does: the step in progress finishes, a checkpoint is saved, and
        `train()` returns a `Result` whose outcome is ``interrupted``. Safe from any thread; does nothing when no run is in progress."""
        control = self._control
        if control is not None:
            control.request(STOP_CALL)

    def check(self) -> str:
        """What `asyncgrpo check` prints: the files the config names, its data (the tokenizer loads, the weights do not) and what the run would do."""
        from asyncgrpo.commands.check import check_recipe

        with registered(self._prepared.objects):
            return check_recipe(self.config)

    def simulate(self, output_dir: str | os.PathLike[str] | None = None) -> Any:
        """What `asyncgrpo simulate` runs: the pipeline on virtual time with a scripted backend; returns its `Simulation`."""
        from asyncgrpo.commands.simulate import simulate

        with registered(self._prepared.objects):
            return simulate(self.config, output_dir=Path(output_dir) if output_dir is not None else None)

    def _with_resume(self, resume: bool | str | os.PathLike[str] | None) -> Prepared:
        if resume is None:
            return self._prepared
        value = "auto" if resume is True else "never" if resume is False else str(resume)
        data = merge(self.config.model_dump(mode="json"), dotted_tree({"checkpoint.resume": value}, "resume_from_checkpoint"))
        return Prepared(validate_config(data, "resume_from_checkpoint"), self._prepared.objects)
