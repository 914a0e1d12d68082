"""The training loop, shared by real runs and the simulator: collector and trainer under one task group.

    for each step s:   batch = await collector.next_batch(s)     (waits: predicate + stall deadline)
                       metrics = await trainer.train_step(batch)
                       publish weights of version s + 1 (every generation.weight_sync_every steps)
                       collector.step_trained()                   (admission opens again)

Invariants:
- One task group owns the collector's task and the loop; an error in either cancels the
  other and reaches the caller. When the loop ends, for whatever reason, the collector is
  stopped: admission ends and in-flight work is cancelled (reported as in flight, never
  as failed).
- `max_staleness: 0` is synchronous on-policy GRPO: the admission rule lets no group start
  while a step is being trained or its weights are not yet served.
- The outcome is returned, not raised: `completed` (max_steps reached, or data ran out
  after at least one step), `failed` (the run's diagnostic) or `stalled` (StallError).
  Cancellation (Ctrl-C, SIGTERM) propagates to the caller unchanged.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from asyncgrpo.config import Config
from asyncgrpo.errors import Diagnostic, FatalBackendError, PipelineError, StallError, TrainerRankError
from asyncgrpo.generation.base import Generator
from asyncgrpo.rollout.collector import Collector
from asyncgrpo.rollout.first_failure import format_traceback
from asyncgrpo.types import Group, StepRecord

RunOutcome = Literal["completed", "failed", "stalled"]
StopReason = Literal["max_steps", "data_exhausted", "signal", "error"]


class StepTrainer(Protocol):
    """What the loop needs from a trainer: one step on a batch, and the weights to publish after it."""

    async def train_step(self, groups: list[Group]) -> dict[str, float]: ...

    def generation_weights(self) -> Mapping[str, Any] | None: ...


@dataclass
class PipelineResult:
    outcome: RunOutcome  # the JSON report's "outcome"
    stop_reason: StopReason
    steps: int
    diagnostic: Diagnostic | None = None
    error: PipelineError | None = None
    staleness_max: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


async def run_pipeline(
    cfg: Config,
    *,
    collector: Collector,
    trainer: StepTrainer,
    generator: Generator,
    start_step: int = 0,
    on_step: Callable[[StepRecord], Awaitable[None]] | None = None,
) -> PipelineResult:
    loop = asyncio.get_running_loop()
    step = start_step
    trained_steps = start_step  # steps whose optimizer update happened, whatever came after it
    staleness_max = 0
    stop_reason: StopReason = "max_steps"
    sync_every = cfg.generation.weight_sync_every
    failure: PipelineError | None = None
    stopping = False  # set when the run is cancelled: a weight sync not yet done is abandoned
    sync_task: asyncio.Task[None] | None = None

    async def publish(step: int) -> PipelineError | None:
        """Publish the weights of version step + 1 when due. Returns the failure, if any; None when
        published, not due, or abandoned because the run is stopping (the checkpoint needs no sync)."""
        nonlocal sync_task
        version = step + 1
        if version % sync_every or stopping:
            return None
        sync_task = asyncio.create_task(generator.load_weights(trainer.generation_weights(), version), name=f"weight-sync-{version}")
        try:
            async with asyncio.timeout(cfg.generation.weight_sync_timeout_s):
                await sync_task
        except TimeoutError as exc:
            return PipelineError.caused_by(weight_sync_timeout(cfg, generator, step), exc)
        except asyncio.CancelledError:
            if not stopping:
                raise
            return None
        except Exception as exc:  # noqa: BLE001 - the run's diagnostic, after the step's metrics are written
            return PipelineError.caused_by(step_diagnostic(step, exc, phase="publishing its weights"), exc)
        finally:
            sync_task = None
        collector.weights_published()  # the only wake-up for admission waiting on the new version
        return None

    async def complete_step(step: int, batch: list[Group], waited_s: float) -> StepRecord:
        """Train, account, publish and report one step. A trained step is always reported (its
        metrics line), even when publishing its weights failed, so the records match the weights."""
        nonlocal trained_steps, staleness_max
        started = loop.time()
        try:
            metrics = await trainer.train_step(batch)
        except Exception as exc:
            raise PipelineError.caused_by(step_diagnostic(step, exc), exc) from exc
        trained = loop.time()
        trained_steps = step + 1
        collector.step_trained()
        sync_failure = await publish(step)
        record = StepRecord(
            step=step,
            batch=batch,
            train_metrics=metrics,
            wait_s=waited_s,
            step_s=trained - started,
            weight_sync_s=loop.time() - trained,
            staleness=[group.staleness_at(step) for group in batch],
        )
        staleness_max = max(staleness_max, *record.staleness)
        if on_step is not None:
            try:
                await on_step(record)
            except PipelineError:
                raise
            except Exception as exc:
                raise PipelineError.caused_by(step_diagnostic(step, exc, phase="reporting it (metrics, evaluation or checkpoint)"), exc) from exc
        if sync_failure is not None:
            raise sync_failure
        return record

    async with asyncio.TaskGroup() as task_group:
        task_group.create_task(collector.run(), name="collector")
        try:
            while step < cfg.train.max_steps:
                waited_from = loop.time()
                batch = await collector.next_batch(step, cfg.stall_timeout_s)
                if batch is None:
                    stop_reason = "data_exhausted"
                    break
                # A step that started is finished even if the run is cancelled meanwhile (Ctrl-C):
                # the weights, the accounting and the metrics then agree on which steps happened.
                # Owned here: every path below awaits it to its end. Only its weight sync is
                # abandoned on cancellation: a hung server must not hold up the checkpoint.
                step_task = asyncio.create_task(complete_step(step, batch, loop.time() - waited_from), name=f"step-{step}")
                try:
                    await asyncio.shield(step_task)
                except asyncio.CancelledError:
                    stopping = True
                    if sync_task is not None:
                        sync_task.cancel()
                    if not step_task.done():
                        await step_task
                    raise
                step += 1
                collector.raise_if_failed()
        except PipelineError as exc:  # the run's diagnostic: reported in the result, not raised
            failure = exc
        finally:
            collector.stop()
    if failure is not None:
        return PipelineResult(
            outcome="stalled" if isinstance(failure, StallError) else "failed",
            stop_reason="error",
            steps=trained_steps,
            diagnostic=failure.diagnostic,
            error=failure,
            staleness_max=staleness_max,
        )
    if step == 0:
        diagnostic = Diagnostic(
            kind="no_steps",
            message=(
                "The run ended without training a single step: the data ran out before one batch was complete "
                f"(dropped so far: {collector.accounting.dropped}). Check data.source and the drop counters."
            ),
            trainer_step=step,
        )
        return PipelineResult("failed", "error", step, diagnostic, PipelineError(diagnostic), staleness_max)
    return PipelineResult("completed", stop_reason, step, staleness_max=staleness_max)



def weight_sync_timeout(cfg: Config, generator: Generator, step: int) -> Diagnostic:
    version = step + 1
    return Diagnostic(
        kind="weight_sync",
        message=(
            f"Publishing the weights of version {version} to {generator.name} took longer than "
            f"generation.weight_sync_timeout_s = {cfg.generation.weight_sync_timeout_s:g} s. "
            f"Check that the generation backend is alive, or raise the timeout for very large models."
        ),
        backend=generator.name,
        generation_version=generator.serving_version,
        trainer_step=step,
        threshold=cfg.generation.weight_sync_timeout_s,
    )


def step_budget_warnings(cfg: Config, num_prompts: int) -> list[str]:
    """Say so at start when train.max_steps asks for more steps than the data can give."""
    groups = num_prompts * cfg.data.num_epochs
    per_step = cfg.rollout.groups_per_step
    available = groups // per_step if cfg.data.drop_last else math.ceil(groups / per_step)
    if cfg.train.max_steps <= available:
        return []
    return [
        f"train.max_steps = {cfg.train.max_steps} but the data allows at most {available} steps "
        f"({num_prompts} prompts x {cfg.data.num_epochs} epochs / rollout.groups_per_step = {per_step}); "
        f"the run will stop when the data runs out. Raise data.num_epochs for more."
    ]


def step_diagnostic(step: int, exc: BaseException, *, phase: str = "") -> Diagnostic:
    """The diagnostic of an error in step `step`: in training it (no phase), or after it trained (`phase` says where)."""
    if phase:
        kind = "weight_sync" if phase.startswith("publishing") else "step_report"
        saved = "" if isinstance(exc, TrainerRankError) else " and a checkpoint of its weights is saved"
        what = f"Step {step} trained, then failed while {phase}: {exc}. Its metrics are written{saved}"
    else:
        kind = "step_error"
        saved = "" if isinstance(exc, TrainerRankError) else "; a checkpoint of them is saved"
        what = f"Training step {step} failed: {exc}. The weights are those of the last completed step{saved}"
    # (A trainer that lost a rank writes no checkpoint; the run resumes from its newest one.)
    fatal = exc if isinstance(exc, FatalBackendError) else None  # e.g. no server took the new weights: its own kind
    return Diagnostic(
        kind=fatal.kind if fatal else kind,
        backend=fatal.backend if fatal else "",
        message=f"{what}, and the traceback below shows where it failed.",
        trainer_step=step,
        original=exc,
        traceback=format_traceback(exc),
    )
