"""One training run: wires the prompt source, collector, local engine, torch trainer, metrics, eval and checkpoints.

Order of a run:
1. `preflight(cfg)`: every name and path in the recipe is checked (model, data, eval data,
   reward functions, backends, run directory) before anything heavy is imported or loaded.
2. The run directory is claimed (rundir.py): refused unless asyncgrpo made it, locked for this
   process, and on a fresh start cleared of what an earlier run wrote (nothing else).
3. Load the model and tokenizer; the trainer trains one copy, the engine serves another. On
   resume, the checkpoint's weights, optimizer state and record files are restored.
4. `run_pipeline`: the shared loop of pipeline.py, with an `on_step` that evaluates every
   `eval.every_steps`, writes metrics and samples, and checkpoints every `checkpoint.every_steps`.
5. A final checkpoint and a summary.

Invariants:
- Every trained step has its metrics line; metrics.jsonl, outcomes.jsonl and the newest
  checkpoint describe the same steps after any ending (a resume restores the records that the
  checkpoint copied, so damaged live files are replaced, never padded or silently shortened).
- Any error, at any stage, ends as one paragraph (`train_cli`), with error.txt in the run
  directory when there is one and a checkpoint when a step completed.

Threads: the engine owns its decode thread; the trainer's steps and checkpoint writes run on
one dedicated thread owned by this module, shut down on every exit path. Signals: see
signals.py (a stop cancels the pipeline, the step in progress finishes, a checkpoint is saved,
exit 130/143).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import os
import random
import shutil
import signal
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncgrpo.config import Config
from asyncgrpo.data.loading import build_prompts, check_data_source, read_eval_rows, read_rows
from asyncgrpo.data.source import PromptSource
from asyncgrpo.errors import AsyncGRPOError, ConfigError, Diagnostic, DiskError, FatalBackendError, GenerationError, PipelineError, RewardError
from asyncgrpo.models.loading import check_model_path
from asyncgrpo.pipeline import PipelineResult, StepRecord, run_pipeline, step_budget_warnings
from asyncgrpo.rewards.scoring import RewardScorer, resolve_rewards
from asyncgrpo.rollout.accounting import Accounting
from asyncgrpo.rollout.health import format_traceback
from asyncgrpo.rollout.ledger import PromptLedger
from asyncgrpo.rollout.retry import generate_with_retries
from asyncgrpo.rundir import ERROR_FILE, METRICS_FILE, OUTCOMES_FILE, SAMPLES_FILE, check_run_directory, claim, clear_run, is_foreign
from asyncgrpo.signals import EXIT_CODES as SIGNAL_EXIT_CODES
from asyncgrpo.signals import StopSignals
from asyncgrpo.telemetry.keys import EVAL_KEYS
from asyncgrpo.threads import run_in_daemon_thread
from asyncgrpo.training.resume import ResumePlan, plan_resume
from asyncgrpo.types import GenerationRequest, Group, Prompt, SamplingParams
from asyncgrpo.watchdog import LoopWatchdog

log = logging.getLogger("asyncgrpo")

EXIT_CODES = {"completed": 0, "failed": 1, "stalled": 2}


def preflight(cfg: Config) -> ResumePlan:
    """Raise ConfigError for any recipe mistake that can be found without loading a model; say what to resume."""
    if cfg.generation.backend not in ("local", "http") or cfg.train.backend != "torch":
        raise ConfigError(
            f"train needs generation.backend: local or http, and train.backend: torch (got {cfg.generation.backend!r} and "
            f"{cfg.train.backend!r}); the scripted backend and the stub trainer are for `asyncgrpo simulate`."
        )
    check_model_path(cfg.model.path)
    check_data_source(cfg.data.source, key="data.source")
    if cfg.eval.source is not None:
        check_data_source(cfg.eval.source, key="eval.source")
    resolve_rewards(cfg.reward.functions)
    check_run_directory(cfg.run.directory)
    return plan_resume(cfg)


@dataclass
class RunSummary:
    run_dir: Path
    result: PipelineResult
    accounting: dict[str, Any]
    first_rewards: list[float] = field(default_factory=list)
    last_rewards: list[float] = field(default_factory=list)
    final_checkpoint: Path | None = None
    interrupted_by: int | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        if self.interrupted_by is not None:
            return SIGNAL_EXIT_CODES[self.interrupted_by]
        return EXIT_CODES[self.result.outcome]

    def render(self) -> str:
        r = self.result
        acc = self.accounting
        dropped = ", ".join(f"{k} {v}" for k, v in acc["dropped"].items() if v) or "none"
        if self.interrupted_by is not None:
            head = f"interrupted by {signal.Signals(self.interrupted_by).name} after {r.steps} steps"
        elif r.outcome == "completed":
            why = "max_steps reached" if r.stop_reason == "max_steps" else "the data ran out"
            head = f"completed {r.steps} steps ({why})"
        else:
            head = f"{r.outcome} after {r.steps} steps"
        lines = [f"asyncgrpo: {head}. Run directory: {self.run_dir}"]
        if self.first_rewards and self.last_rewards:
            lines.append(
                f"  reward: first 10% of steps {statistics.fmean(self.first_rewards):.3f} -> "
                f"last 10% {statistics.fmean(self.last_rewards):.3f}"
            )
        lines.append(
            f"  prompts: taken {acc['taken']}, trained {acc['trained']}, requeued {acc['requeued']}, dropped: {dropped}, "
            f"in flight at exit {acc['in_flight']}, buffered at exit {acc['buffered']}"
        )
        lines.append(f"  max staleness trained: {r.staleness_max}")
        if self.final_checkpoint is not None:
            lines.append(f"  checkpoint: {self.final_checkpoint} (loads with transformers' from_pretrained)")
            if self.interrupted_by is not None or r.outcome != "completed":
                lines.append("  to continue: run the same command again (checkpoint.resume=auto continues from the newest checkpoint)")
        if r.diagnostic is not None:
            lines.append(f"  error ({r.diagnostic.kind}): {r.diagnostic.render()}")
            if r.diagnostic.traceback:
                lines.append("  first error's traceback is in " + str(self.run_dir / "error.txt"))
        return "\n".join(lines)


def train_cli(cfg: Config) -> int:
    """The `asyncgrpo train` command: preflight, run with signal handling, print the summary.

    Config mistakes and asyncgrpo's own errors propagate to the CLI as one paragraph; anything
    else (a bug, a library's error) is turned into one here, with the traceback in error.txt."""
    preflight(cfg)
    try:
        summary = asyncio.run(_train_until_signal(cfg))
    except AsyncGRPOError:
        raise
    except Exception as exc:  # noqa: BLE001 - every command ends in a paragraph, never a raw traceback
        raise AsyncGRPOError(_unexpected_error(cfg.run.directory, exc)) from exc
    print(summary.render(), file=sys.stderr)
    return summary.exit_code


def _unexpected_error(run_dir: Path, exc: BaseException) -> str:
    where = "run with --debug to see the traceback"
    report = "".join(traceback.format_exception(exc))
    if run_dir.is_dir() and not is_foreign(run_dir):
        try:
            (run_dir / ERROR_FILE).write_text(report)
            where = f"the traceback is in {run_dir / ERROR_FILE}"
        except OSError:
            pass
    return (
        f"the run stopped on an unexpected {type(exc).__name__}: {exc}. This is not a recipe mistake asyncgrpo knows "
        f"how to name; {where}. {describe_last_checkpoint(run_dir)} Please report it with that file."
    )


def describe_last_checkpoint(run_dir: Path) -> str:
    """One true sentence about the newest complete checkpoint on disk."""
    from asyncgrpo.training.checkpoint import latest_checkpoint

    latest = latest_checkpoint(run_dir) if run_dir.is_dir() else None
    if latest is None:
        return "No checkpoint of this run is on disk yet."
    return f"The newest checkpoint on disk, {latest}, is complete (checkpoints are written atomically)."


@dataclass
class Stop:
    """The stop requests of a run, and the pipeline task a stop cancels.

    Only the pipeline is cancelled, never the cleanup after it (closing the engine, the final
    checkpoint, the summary), which must run to its end for the checkpoint to be saved.
    """

    received: list[int] = field(default_factory=list)
    pipeline: asyncio.Task[Any] | None = None

    def request(self, signum: int) -> None:
        self.received.append(signum)
        if self.pipeline is not None and not self.pipeline.done():
            self.pipeline.cancel()


async def _train_until_signal(cfg: Config) -> RunSummary:
    stop = Stop()
    signals = StopSignals(
        asyncio.get_running_loop(),
        shutdown_timeout_s=cfg.run.shutdown_timeout_s,
        on_stop=stop.request,
        describe_checkpoint=lambda: describe_last_checkpoint(cfg.run.directory),
    )
    with signals.installed():
        return await train(cfg, stop=stop)


async def train(cfg: Config, *, stop: Stop | None = None) -> RunSummary:
    """Run one training to its end (see the module docstring). Config problems raise ConfigError first."""
    preflight(cfg)
    with claim(cfg.run.directory) as run_dir:
        plan = plan_resume(cfg)  # again, now that no other process can change the directory
        if plan.checkpoint is None:
            try:
                clear_run(run_dir)  # a fresh start: nothing an earlier run wrote may mix into this one
            except OSError as exc:
                raise DiskError(disk_problem(Path(exc.filename or run_dir), exc)) from exc
        return await _train_claimed(cfg, plan, stop if stop is not None else Stop(), run_dir)


async def _train_claimed(cfg: Config, plan: ResumePlan, stop: Stop, run_dir: Path) -> RunSummary:
    import torch  # heavy imports only after the recipe is known to be sound

    from asyncgrpo.models.loading import load_model_and_tokenizer
    from asyncgrpo.rollout.collector import Collector
    from asyncgrpo.telemetry.metrics import MetricsWriter, metric_keys, step_metrics, write_samples
    from asyncgrpo.training.checkpoint import save_checkpoint
    from asyncgrpo.training.trainer import TorchTrainer

    _write_or_disk_error(run_dir / "config.yaml", cfg.to_yaml())
    torch.manual_seed(cfg.run.seed)
    if cfg.rollout.max_staleness > 0 and cfg.generation.backend == "local":
        # The engine and the trainer run at the same time: give each a share of the cores, since
        # oversubscribed OpenMP threads spin and slow both down many times over.
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    model, tokenizer = load_model_and_tokenizer(cfg.model.path, "float32", cfg.run.seed)  # the trainer's master weights
    train_rows, eval_rows = _split_rows(cfg)
    prompts, report = build_prompts(train_rows, prompt_key=cfg.data.prompt_key, tokenizer=tokenizer, max_prompt_tokens=cfg.data.max_prompt_tokens)
    warnings = [*plan.notes, *report.warnings(), *step_budget_warnings(cfg, len(prompts))]
    eval_prompts: list[Prompt] = []
    if eval_rows:
        key = "eval.source" if cfg.eval.source else "data.prompt_key"
        eval_prompts, _ = build_prompts(eval_rows, prompt_key=cfg.data.prompt_key, tokenizer=tokenizer, max_prompt_tokens=cfg.data.max_prompt_tokens, key=key)

    trainer = TorchTrainer(model, tokenizer, cfg)
    saved: dict[str, Any] = {}
    if plan.checkpoint is not None:
        saved = _resume(plan, trainer, run_dir)
        log.warning("resuming from %s (step %d)", plan.checkpoint, plan.step)
        for change in plan.changed:
            log.warning("  changed since the checkpoint (applied from this step on): %s", change)
    for warning in warnings:
        log.warning("warning: %s", warning)
    offsets = saved.get("offsets", {})
    outcomes = _open_record(run_dir / OUTCOMES_FILE, offsets)
    ledger = PromptLedger(saved.get("done"), sink=outcomes.append)
    source = PromptSource(prompts, num_epochs=cfg.data.num_epochs, shuffle=cfg.data.shuffle, seed=cfg.run.seed, done=ledger.done_by_epoch())
    scorer = RewardScorer.from_config(cfg.reward)
    engine = _generator(cfg, trainer, tokenizer, run_dir)
    stop_ids = tuple(dict.fromkeys([*cfg.generation.stop_token_ids, tokenizer.eos_token_id]))
    sampling = SamplingParams(
        max_new_tokens=cfg.generation.max_new_tokens,
        temperature=cfg.generation.temperature,
        top_p=cfg.generation.top_p,
        stop_token_ids=stop_ids,
    )
    start_step = plan.step
    collector = Collector(cfg, source=source, generator=engine, scorer=scorer, sampling=sampling, start_step=start_step, ledger=ledger)
    if saved:
        collector.accounting = Accounting.resumed(saved["accounting"])
        collector.counters.update(saved["counters"])
    trainer_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncgrpo-trainer")
    loop = asyncio.get_running_loop()
    metrics_file = _open_record(run_dir / METRICS_FILE, offsets)
    samples_file = _open_record(run_dir / SAMPLES_FILE, offsets, warnings)
    metrics = MetricsWriter(metrics_file, metric_keys(scorer.names))
    progress = _Progress(cfg, start_step)
    rewards_by_step: list[float] = []
    eval_state: dict[str, float | None] = dict.fromkeys(EVAL_KEYS)
    started = time.perf_counter()
    last = {"time": started, "tokens": collector.counters["rollout/generated_tokens_total"]}

    class ThreadedTrainer:
        async def train_step(self, groups: list[Group]) -> dict[str, float]:
            return await loop.run_in_executor(trainer_thread, trainer.train_step, groups)

        def generation_weights(self) -> dict[str, Any]:
            return trainer.generation_weights()

    def checkpoint_state() -> tuple[dict[str, Any], dict[str, int]]:
        """Taken in one synchronous moment, so the ledger, counters and record files agree."""
        sizes = {f.path.name: f.offset() for f in (metrics_file, samples_file, outcomes)}
        extra = {
            "done": ledger.done_by_epoch(),
            "accounting": collector.accounting.to_json(),
            "counters": dict(collector.counters),
            "offsets": sizes,
        }
        return extra, {name: sizes[name] for name in (METRICS_FILE, OUTCOMES_FILE)}

    async def checkpoint(step: int) -> Path:
        extra, records = checkpoint_state()
        try:
            return await loop.run_in_executor(trainer_thread, lambda: save_checkpoint(run_dir, step, trainer, cfg.to_yaml(), extra, records=records))
        except OSError as exc:
            raise PipelineError(disk_diagnostic(exc, run_dir, run_dir / "checkpoints", step)) from exc

    async def evaluate(step: int) -> PipelineError | None:
        """Evaluate after `step` steps; returns the error that must fail the run (the backend cannot
        serve it at all), after which the caller still writes the step's metrics. Anything less
        makes the evaluation incomplete: counted in eval/failed_requests and logged."""
        try:
            eval_state.update(await _evaluate(cfg, engine, scorer, eval_prompts, stop_ids, step=step))
        except FatalBackendError as exc:
            return PipelineError.caused_by(eval_diagnostic(exc, step), exc)
        return None

    async def on_step(record: StepRecord) -> None:
        step = record.step + 1  # steps completed
        eval_failure = None
        if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and not stop.received:
            eval_failure = await evaluate(step)
        now = time.perf_counter()
        tokens = collector.counters["rollout/generated_tokens_total"]
        values = step_metrics(
            record,
            collector,
            reward_names=scorer.names,
            elapsed_s=now - started,
            gen_tokens_per_s=(tokens - last["tokens"]) / max(now - last["time"], 1e-9),
            eval_metrics=eval_state,
        )
        last.update(time=now, tokens=tokens)
        try:
            metrics.write(values)
            write_samples(samples_file, record, cfg.logging.samples_per_step)
        except OSError as exc:
            raise PipelineError(disk_diagnostic(exc, run_dir, run_dir / METRICS_FILE, record.step + 1)) from exc
        rewards_by_step.append(values["reward/mean"])
        progress.update(values)
        if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0 and step < cfg.train.max_steps:
            await checkpoint(step)
        if eval_failure is not None:
            raise eval_failure

    final_checkpoint: Path | None = None
    result: PipelineResult | None = None
    async def run_stages() -> PipelineResult:
        await engine.start()
        if cfg.generation.backend == "http":
            # Cold sync: the servers serve exactly the trainer's weights (a fresh run's, or the checkpoint's).
            async with asyncio.timeout(cfg.generation.weight_sync_timeout_s):
                await engine.load_weights(trainer.generation_weights(), trainer.version)
        if eval_prompts:
            failure = await evaluate(start_step)  # the baseline, so eval/* is never empty
            if failure is not None:
                return PipelineResult("failed", "error", start_step, failure.diagnostic, failure)
        stop.pipeline = asyncio.create_task(
            run_pipeline(cfg, collector=collector, backend=ThreadedTrainer(), generator=engine, start_step=start_step, on_step=on_step)
        )
        if stop.received:  # a signal arrived while loading
            stop.pipeline.cancel()
        return await stop.pipeline

    try:
        with LoopWatchdog(loop, threshold_s=cfg.logging.blocked_loop_warn_s):  # from here on, nothing may block the loop
            result = await run_stages()
    except asyncio.CancelledError:
        if not (stop.received and stop.pipeline is not None and stop.pipeline.cancelled()):
            raise
        result = PipelineResult("failed", "signal", trainer.version)
    finally:
        progress.close()
        await scorer.aclose()
        await engine.aclose()
        # A step in progress finishes before the thread is released (the pipeline completes a
        # started step even when cancelled), so the weights match the accounting saved below.
        await run_in_daemon_thread(lambda: trainer_thread.shutdown(wait=True), name="asyncgrpo-trainer-shutdown")
    if trainer.version > 0:
        extra, records = checkpoint_state()
        try:
            final_checkpoint = save_checkpoint(run_dir, trainer.version, trainer, cfg.to_yaml(), extra, records=records)
        except OSError as exc:
            result = _with_failure(result, disk_diagnostic(exc, run_dir, run_dir / "checkpoints", trainer.version))
    for file in (metrics_file, samples_file, outcomes):
        file.close()
    if result.diagnostic is not None:
        try:
            (run_dir / ERROR_FILE).write_text(_error_report(result.diagnostic))
        except OSError as exc:
            log.warning("warning: could not write %s (%s)", run_dir / ERROR_FILE, exc.strerror)
    tenth = max(1, len(rewards_by_step) // 10)
    return RunSummary(
        run_dir=run_dir,
        result=result,
        accounting=collector.accounting.to_json(),
        first_rewards=rewards_by_step[:tenth],
        last_rewards=rewards_by_step[-tenth:],
        final_checkpoint=final_checkpoint,
        interrupted_by=stop.received[0] if stop.received else None,
        warnings=warnings,
    )


def _resume(plan: ResumePlan, trainer: Any, run_dir: Path) -> dict[str, Any]:
    """Load the checkpoint into `trainer` and restore the run's records from it. Returns the checkpoint's extra."""
    from asyncgrpo.training.checkpoint import load_checkpoint, restore_records

    assert plan.checkpoint is not None
    try:
        saved = load_checkpoint(plan.checkpoint, trainer)["extra"]
    except Exception as exc:  # noqa: BLE001 - damage the cheap checks could not see (tensor bytes)
        raise ConfigError(
            f"checkpoint {plan.checkpoint} passed the integrity checks but could not be loaded ({type(exc).__name__}: {exc}). "
            f"Fix: continue from an older checkpoint with checkpoint.resume=PATH, or start over with run.overwrite=true."
        ) from exc
    try:
        restore_records(plan.checkpoint, run_dir)
    except OSError as exc:
        raise DiskError(disk_problem(run_dir, exc)) from exc
    return saved


def _open_record(path: Path, offsets: dict[str, int], warnings: list[str] | None = None) -> Any:
    """Open one of the run's append-only records, cut back to the checkpoint's offset when resuming.

    A file shorter than its offset was damaged: with `warnings` (samples, kept for reading only)
    it is continued as it is and a warning says so; otherwise the run is refused by name. A
    file restored from the checkpoint's copy is exactly as long as its offset."""
    from asyncgrpo.telemetry.metrics import JsonlFile

    offset = offsets.get(path.name)
    try:
        size = path.stat().st_size if path.exists() else 0
        if offset is not None and size < offset:
            if warnings is None:
                raise ConfigError(
                    f"{path} has {size} bytes, fewer than the {offset} its checkpoint recorded: it was truncated or "
                    f"replaced, and the checkpoint holds no copy of it to restore. Fix: restore the file from a copy, "
                    f"or start over with run.overwrite=true."
                )
            warnings.append(f"{path} has {size} bytes, fewer than the {offset} its checkpoint recorded: earlier entries are lost")
            offset = size
        return JsonlFile(path, offset)
    except OSError as exc:
        raise DiskError(disk_problem(path, exc)) from exc


def _write_or_disk_error(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as exc:
        raise DiskError(disk_problem(path, exc)) from exc


def disk_problem(path: Path, exc: OSError) -> str:
    """One paragraph: what could not be written, why, the free space there, and the fix."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        free = f"{shutil.disk_usage(existing).free / 2**20:,.0f} MiB free there"
    except OSError:
        free = "free space unknown"
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    fix = "free some disk space" if full else f"make {existing} writable"
    return (
        f"cannot write {path}: {exc.strerror or exc} ({free}). Fix: {fix}, or choose another run.output_dir, then run "
        f"the same command again: it continues from the newest complete checkpoint."
    )


def disk_diagnostic(exc: OSError, run_dir: Path, path: Path, step: int) -> Diagnostic:
    """The run's diagnostic for a failed write of `path` (or the file the error names) after `step` steps."""
    target = Path(exc.filename) if exc.filename else path
    return Diagnostic(
        kind="disk",
        message=f"After step {step}, {disk_problem(target, exc)} {describe_last_checkpoint(run_dir)}",
        trainer_step=step,
        original=exc,
    )


def _with_failure(result: PipelineResult, diagnostic: Diagnostic) -> PipelineResult:
    """`result` failed with `diagnostic`, unless it already carries a first diagnostic (which stays: sticky)."""
    if result.diagnostic is not None:
        log.warning("warning: after the run's error, also: %s", diagnostic.render())
        return result
    return PipelineResult("failed", "error", result.steps, diagnostic, PipelineError(diagnostic), result.staleness_max)


def _generator(cfg: Config, trainer: Any, tokenizer: Any, run_dir: Path) -> Any:
    """The generation backend: the in-process engine on its own copy of the weights, or HTTP servers."""
    if cfg.generation.backend == "http":
        from asyncgrpo.generation.http import HttpGenerator

        model_dir = Path(cfg.model.path).expanduser()
        http = cfg.generation.http
        return HttpGenerator(
            cfg.generation,
            weights_dir=Path(http.weights_dir) if http.weights_dir else run_dir / "weights",
            model_config=model_dir if model_dir.is_dir() else trainer.model.config.to_dict(),
            initial_version=trainer.version,
        )
    import torch

    from asyncgrpo.generation.local import LocalEngine, serving_copy
    from asyncgrpo.training.device import resolve_device

    local = cfg.generation.local
    device = trainer.device if local.device == "auto" else resolve_device(local.device, key="generation.local.device")
    served = serving_copy(trainer.base_model, trainer.generation_weights(), dtype=getattr(torch, cfg.model.dtype), device=device)
    return LocalEngine(served, tokenizer, max_batch_size=local.max_batch_size, version=trainer.version)


def _split_rows(cfg: Config) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Training rows and held-out eval rows (none when eval is off).

    Eval rows come from `eval.source`, else the built-in task's eval split, else the last
    `eval.num_prompts` rows of the data, which are then left out of training.
    """
    rows = read_rows(cfg.data.source, builtin_size=cfg.data.builtin_size, seed=cfg.run.seed)
    n = cfg.eval.num_prompts
    if not cfg.eval.every_steps:
        return rows, []
    if cfg.eval.source is not None:
        return rows, read_eval_rows(cfg.eval.source, n=n, seed=cfg.run.seed, key="eval.source")
    if cfg.data.source.startswith("builtin:"):
        return rows, read_eval_rows(cfg.data.source, n=n, seed=cfg.run.seed, key="data.source")
    if len(rows) <= n:
        raise ConfigError(
            f"eval.num_prompts = {n} would hold out all {len(rows)} rows of data.source = {cfg.data.source!r}, "
            f"leaving nothing to train on. Fix: lower eval.num_prompts, give a separate eval.source, or set eval.every_steps=0."
        )
    return rows[:-n], rows[-n:]


async def _evaluate(cfg: Config, engine: Any, scorer: RewardScorer, prompts: list[Prompt], stop_ids: tuple[int, ...], *, step: int) -> dict[str, float | None]:
    """Sample `eval.samples_per_prompt` completions per held-out prompt; report mean reward, pass@k and failures.

    Requests go through the same retry policy as rollouts (rollout/retry.py), those of one prompt
    concurrently. A request that still fails, or a reward that raises, leaves that sample out:
    the evaluation is incomplete (`eval/failed_requests`, one warning naming the first error),
    never a crash. A `FatalBackendError` propagates: the backend cannot serve the run at all."""
    sampling = SamplingParams(
        max_new_tokens=cfg.generation.max_new_tokens,
        temperature=cfg.eval.temperature,
        top_p=cfg.generation.top_p if cfg.eval.temperature > 0 else 1.0,
        stop_token_ids=stop_ids,
    )
    k = cfg.eval.samples_per_prompt
    jitter = random.Random(cfg.run.seed + step)
    failures: list[BaseException] = []

    async def generate(request: GenerationRequest) -> Any:
        try:
            return await generate_with_retries(engine, request, cfg.generation, jitter=jitter)
        except FatalBackendError:
            raise
        except (GenerationError, OSError) as exc:
            failures.append(exc)
            return None

    async def one(prompt: Prompt) -> list[float | None]:
        requests = [
            GenerationRequest(f"eval-{step}-{prompt.id}-{i}", prompt.id, prompt.token_ids, sampling, seed=cfg.run.seed + i)
            for i in range(k)
        ]
        async with asyncio.TaskGroup() as task_group:
            tasks = [task_group.create_task(generate(request)) for request in requests]
        completions = [c for c in (t.result() for t in tasks) if c is not None]
        if not completions:
            return []
        try:
            return [s.reward for s in await scorer.score(prompt, [c.text for c in completions])]
        except RewardError as exc:
            failures.extend([exc] * len(completions))
            return []

    try:
        async with asyncio.TaskGroup() as task_group:
            tasks = [task_group.create_task(one(p)) for p in prompts]
    except* FatalBackendError as group:
        raise _first_leaf(group) from None
    per_prompt = [t.result() for t in tasks]
    if failures:
        log.warning(
            "warning: the evaluation after step %d is incomplete: %d of %d samples failed and are left out "
            "(first error: %s: %s)", step, len(failures), len(prompts) * k, type(failures[0]).__name__, failures[0],
        )
    rewards = [r for rs in per_prompt for r in rs if r is not None]
    scored = [rs for rs in per_prompt if rs]
    passed = [any(r is not None and r >= cfg.eval.success_threshold for r in rs) for rs in scored]
    return {
        "eval/reward_mean": statistics.fmean(rewards) if rewards else None,
        "eval/pass_rate": sum(passed) / len(passed) if passed else None,
        "eval/failed_requests": len(failures),
    }


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    """The first exception of a (possibly nested) group: task groups of task groups nest them."""
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def eval_diagnostic(exc: FatalBackendError, step: int) -> Diagnostic:
    return Diagnostic(
        kind=exc.kind,
        message=(
            f"The evaluation after step {step} could not be served: {exc}. Retrying cannot fix this; check the servers, "
            f"the model name, the URLs and the credentials. Every trained step's metrics are written."
        ),
        backend=exc.backend,
        trainer_step=step,
        original=exc,
        traceback=format_traceback(exc),
    )



def _error_report(diagnostic: Diagnostic) -> str:
    return f"{diagnostic.render()}\n\n{diagnostic.traceback}".rstrip() + "\n"


class _Progress:
    """A progress bar on stderr (step, reward, ETA), or a line every 10 steps when `logging.progress` is off."""

    def __init__(self, cfg: Config, start_step: int) -> None:
        self.every = max(1, cfg.train.max_steps // 10)
        self.bar = None
        if cfg.logging.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.train.max_steps, initial=start_step, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)

    def update(self, values: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.set_postfix(reward=f"{values['reward/mean']:.3f}", stale=values["staleness/max"], refresh=False)
            self.bar.update(1)
        elif (values["step"] + 1) % self.every == 0:
            log.info("step %d  reward %.3f  loss %.4f", values["step"] + 1, values["reward/mean"], values["loss"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
