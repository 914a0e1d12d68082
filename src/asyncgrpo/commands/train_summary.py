"""The summary of a training run, as `asyncgrpo train` prints it and `asyncgrpo.Trainer.train` returns it.

A resumed run's summary says which lines count this invocation (its steps, rewards, staleness, generation) and
which the whole run (prompts and counters, which the checkpoint carried over). `exit_code`: 0 completed, 1 failed,
2 stalled, or the signal's code (signals.py) when a stop request ended the run.
"""

from __future__ import annotations

import signal
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncgrpo.commands.signals import EXIT_CODES as SIGNAL_EXIT_CODES
from asyncgrpo.pipeline import PipelineResult
from asyncgrpo.rundir import METRICS_FILE
from asyncgrpo.telemetry.progress import RunTotals

EXIT_CODES = {"completed": 0, "failed": 1, "stalled": 2}


@dataclass
class RunSummary:
    run_dir: Path
    result: PipelineResult
    accounting: dict[str, Any]
    first_rewards: list[float] = field(default_factory=list)
    last_rewards: list[float] = field(default_factory=list)
    final_checkpoint: Path | None = None
    interrupted_by: int | None = None
    stopped_by: str | None = None  # who asked for the stop, when not a signal's name: "stop()" (the Python API, commands/run_training.py)
    warnings: list[str] = field(default_factory=list)
    totals: RunTotals = field(default_factory=RunTotals)
    wall_s: float = 0.0
    generator_use: float | None = None  # rollouts in progress per generation slot, on average
    start_step: int = 0  # the step this invocation resumed at (0: a fresh run)

    @property
    def exit_code(self) -> int:
        if self.interrupted_by is not None:
            return SIGNAL_EXIT_CODES[self.interrupted_by]
        return EXIT_CODES[self.result.outcome]

    def render(self) -> str:
        """The summary. A resumed run's says which lines count this invocation (its steps, rewards, staleness,
        generation) and which the whole run (prompts and counters, which the checkpoint carried over)."""
        r = self.result
        acc = self.accounting
        dropped = ", ".join(f"{k} {v}" for k, v in acc["dropped"].items() if v) or "none"
        if self.interrupted_by is not None:
            head = f"interrupted by {self.stopped_by or signal.Signals(self.interrupted_by).name} after {r.steps} steps"
        elif r.outcome == "completed":
            why = "max_steps reached" if r.stop_reason == "max_steps" else "the data ran out"
            head = f"completed {r.steps} steps ({why})"
        else:
            head = f"{r.outcome} after {r.steps} steps"
        lines = [f"asyncgrpo: {head}. Run directory: {self.run_dir}"]
        if r.diagnostic is not None:  # what went wrong first; the numbers after it
            lines.append(f"  error ({r.diagnostic.kind}): {r.diagnostic.render()}")
            if r.diagnostic.traceback:
                lines.append("  first error's traceback is in " + str(self.run_dir / "error.txt"))
        resumed = self.start_step > 0
        this, whole = (" this invocation", ", whole run") if resumed else ("", "")
        t = self.totals
        since = f" (resumed at step {self.start_step})" if resumed else ""
        lines.append(f"  trained{this}{since}: {t.steps} steps, {t.samples} samples, {t.tokens} completion tokens in {_duration(self.wall_s)}")
        if t.eval_first is not None and t.eval_last is not None:
            lines.append(f"  eval reward{this}: {t.eval_first:.3f} -> {t.eval_last:.3f}")
        if self.first_rewards and self.last_rewards:
            lines.append(
                f"  reward{this}: first 10% of steps {statistics.fmean(self.first_rewards):.3f} -> "
                f"last 10% {statistics.fmean(self.last_rewards):.3f}"
            )
        if t.kl_first is not None and t.kl_last is not None:
            lines.append(f"  distill/kl_mean{this}: first step {t.kl_first:.4f} -> last {t.kl_last:.4f}")
        lines.append(
            f"  prompts{whole}: taken {acc['taken']}, trained {acc['trained']}, requeued {acc['requeued']}, dropped: {dropped}, "
            f"in flight at exit {acc['in_flight']}, buffered at exit {acc['buffered']}"
        )
        if t.staleness:
            wait = f"; the trainer waited for batches {t.wait_share:.0%} of its time" if t.wait_share is not None else ""
            lines.append(f"  staleness trained{this}: mean {statistics.fmean(t.staleness):.2f}, max {max(t.staleness):g}{wait}")
        if self.generator_use is not None:
            lines.append(f"  generation{this}: on average {self.generator_use:.0%} of generation.max_inflight rollouts in progress")
        counters = {k.removeprefix("rollout/"): v for k, v in t.last.items()
                    if k.startswith("rollout/") and k.endswith("_total") and v and "generated" not in k}
        if counters:
            lines.append(f"  counters{whole}: " + ", ".join(f"{k} {v}" for k, v in counters.items()))
        if self.final_checkpoint is not None:
            lines.append(f"  checkpoint: {self.final_checkpoint} (loads with transformers' from_pretrained)")
        if t.steps:
            lines.append(f"  plots: asyncgrpo plot {self.run_dir} (PNGs in {self.run_dir / 'plots'}); metrics in {self.run_dir / METRICS_FILE}")
        if r.diagnostic is not None:
            lines.append(f"  what to try: the '{r.diagnostic.kind}' section of docs/troubleshooting.md")
        if self.final_checkpoint is not None and (self.interrupted_by is not None or r.outcome != "completed"):
            lines.append("  to continue: run the same command again (checkpoint.resume=auto continues from the newest checkpoint)")
        return "\n".join(lines)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{seconds:.1f}s"
