"""`asyncgrpo train`: one training run, told as a story of named steps.

1. `preflight(cfg)`: every name, path and device in the recipe is checked (model, devices, peft for
   LoRA, data, eval data, reward functions, backends, run directory) before anything heavy is
   imported or loaded.
2. The run directory is claimed (rundir.py): refused unless asyncgrpo made it, locked for this
   process, and on a fresh start cleared of what an earlier run wrote (nothing else).
3. `TrainingRun.prepare`: the model and tokenizer (the trainer trains one copy, the engine serves
   another; with train.world_size > 1 the ranks on Ray hold the trainer's, this process only the engine's), the
   prompts, the generator and the run's parts (wiring/: the same order as `simulate`'s);
   on resume, the checkpoint's weights, optimizer state and record files are restored.
4. `TrainingRun.generate_and_train`: a baseline evaluation, then the shared loop of pipeline.py,
   whose `on_step` evaluates every `eval.every_steps`, writes metrics and samples, and checkpoints
   every `checkpoint.every_steps`.
5. `TrainingRun.finish`: a final checkpoint, error.txt when the run failed, and the summary.

Invariants:
- Every trained step has its metrics line; metrics.jsonl, outcomes.jsonl, timeline.jsonl and the
  newest checkpoint describe the same steps after any ending (a resume restores the records that the
  checkpoint copied, so damaged live files are replaced, never padded or silently shortened).
- Any error, at any stage, ends as one paragraph (commands/run_training.py `run_training`), with error.txt in the run
  directory when there is one and a checkpoint when a step completed.

Threads: the engine owns its decode thread; the trainer's steps and checkpoint writes run on
one dedicated thread owned by `TrainingRun`, shut down on every exit path. Signals and stop requests: see
commands/run_training.py and signals.py (a stop cancels the pipeline, the step in progress finishes, a checkpoint is saved,
exit 130/143).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncgrpo.algorithms.registry import algorithm_for
from asyncgrpo.commands.gc_pauses import quiet_gc
from asyncgrpo.commands.run_files import disk_diagnostic, disk_problem, open_record, write_or_disk_error
from asyncgrpo.commands.train_summary import RunSummary
from asyncgrpo.commands.watchdog import LoopWatchdog
from asyncgrpo.config import Config
from asyncgrpo.data.loading import check_data_source
from asyncgrpo.environments.hosts import check_env
from asyncgrpo.errors import ConfigError, Diagnostic, DiskError, FatalBackendError, PipelineError
from asyncgrpo.evaluation import eval_diagnostic, evaluate
from asyncgrpo.generation.ray_cluster import import_ray
from asyncgrpo.metric_names import EVAL_KEYS
from asyncgrpo.models.loading import check_model_path
from asyncgrpo.pipeline import PipelineResult, run_pipeline
from asyncgrpo.rewards.resolve import resolve_rewards
from asyncgrpo.rundir import (
    ERROR_FILE,
    METRICS_FILE,
    OUTCOMES_FILE,
    SAMPLES_FILE,
    TIMELINE_FILE,
    check_run_directory,
    claim,
    clear_run,
)
from asyncgrpo.telemetry.metrics import JsonlFile, MetricsWriter, MovingRate, generator_values, metric_keys, step_metrics, write_samples
from asyncgrpo.telemetry.progress import Progress
from asyncgrpo.telemetry.sinks import TrackerError, Trackers, sink_problems
from asyncgrpo.threads import run_in_daemon_thread
from asyncgrpo.training.lora import check_peft
from asyncgrpo.training.losses.plugin import resolve_loss_plugin
from asyncgrpo.training.ray_trainer import RayTrainer
from asyncgrpo.training.resume import ResumePlan, plan_resume
from asyncgrpo.types import Group, Prompt, StepRecord
from asyncgrpo.wiring.backends import real_generator, trainer_ranks
from asyncgrpo.wiring.collector import episode_codec
from asyncgrpo.wiring.prompts import training_prompts
from asyncgrpo.wiring.run import Backends, wire_run

log = logging.getLogger("asyncgrpo")


def preflight(cfg: Config) -> ResumePlan:
    """Raise ConfigError for any recipe mistake that can be found without loading a model; say what to resume."""
    if cfg.generation.backend not in ("local", "http") or cfg.train.backend != "torch":
        raise ConfigError(
            f"train needs generation.backend: local or http, and train.backend: torch (got {cfg.generation.backend!r} and "
            f"{cfg.train.backend!r}); the scripted backend and the stub trainer are for `asyncgrpo simulate`."
        )
    if cfg.runtime == "ray":
        import_ray()  # ConfigError with the install command when it is missing
    check_model_path(cfg.model.path)
    check_devices(cfg)
    if cfg.train.lora is not None:
        check_peft()
    algorithm_for(cfg).preflight()  # e.g. distillation's teacher path
    check_data_source(cfg.data.source, key="data.source")
    if cfg.eval.source is not None:
        check_data_source(cfg.eval.source, key="eval.source")
    resolve_rewards(cfg.reward.functions)
    if cfg.train.loss.plugin:
        resolve_loss_plugin(cfg.train.loss.type)
    check_env(cfg.env)
    if problems := sink_problems(cfg.logging.sinks, Path(cfg.run.directory)):
        raise ConfigError("\n".join(problems))
    check_run_directory(cfg.run.directory)
    return plan_resume(cfg)


def check_devices(cfg: Config) -> None:
    """ConfigError when a device this process would use is not on this machine: the trainer's (unless
    train.world_size > 1: Ray's ranks place their own), the in-process engine's and the distillation teacher's.
    torch is imported only for an explicit accelerator (auto and cpu always exist)."""
    wanted = [("train.device", cfg.train.device)] if cfg.train.world_size == 1 else []
    if cfg.runtime == "local" and cfg.generation.backend == "local":
        wanted.append(("generation.local.device", cfg.generation.local.device))
    wanted += algorithm_for(cfg).devices()  # e.g. distillation's teacher
    for key, spec in wanted:
        if spec not in ("auto", "cpu"):
            from asyncgrpo.models.device import resolve_device

            resolve_device(spec, key=key)


@dataclass
class Stop:
    """The stop requests of a run, and the task a stop cancels: the start-up stages and the pipeline.

    Only that task is cancelled, never the cleanup after it (closing the engine, the final
    checkpoint, the summary), which must run to its end for the checkpoint to be saved. It is
    cancelled once: a second cancel would interrupt the pipeline's wait for the step in progress
    and cancel that step after its optimizer update, before its metrics line (`Trainer.stop()`
    may be called many times).
    """

    received: list[int] = field(default_factory=list)
    pipeline: asyncio.Task[Any] | None = None

    def request(self, signum: int) -> None:
        first = not self.received
        self.received.append(signum)
        if first and self.pipeline is not None and not self.pipeline.done():
            self.pipeline.cancel()


async def train(cfg: Config, *, stop: Stop | None = None) -> RunSummary:
    """Run one training to its end (see the module docstring). Config problems raise ConfigError first."""
    preflight(cfg)
    stop = stop if stop is not None else Stop()
    with claim(cfg.run.directory) as run_dir:
        plan = plan_resume(cfg)  # again, now that no other process can change the directory
        if plan.checkpoint is None or plan.start_over:
            _start_over(run_dir)
        run = TrainingRun.prepare(cfg, plan, run_dir, stop)
        try:
            result = await run.generate_and_train()
            return run.finish(result)
        finally:
            if run.ranks is not None:  # last: they write the final checkpoint, and own the local Ray cluster
                await run.ranks.aclose()


def _start_over(run_dir: Path) -> None:
    """A fresh start: nothing an earlier run wrote may mix into this one (and nothing else is touched)."""
    try:
        cleared = clear_run(run_dir)
    except OSError as exc:
        raise DiskError(disk_problem(Path(exc.filename or run_dir), exc)) from exc
    if cleared.kept:
        shown = ", ".join(cleared.kept[:10]) + (f" and {len(cleared.kept) - 10} more" if len(cleared.kept) > 10 else "")
        log.warning("starting over in %s: removed what the earlier run wrote; kept what asyncgrpo did not write: %s", run_dir, shown)


class TrainingRun:
    """The parts of one run and what it does with them; `train()` calls its steps in order.

    It is also the pipeline's trainer: `train_step` runs the torch trainer on the run's trainer
    thread, so checkpoint writes (on the same thread) never overlap a step."""

    def __init__(self, cfg: Config, plan: ResumePlan, run_dir: Path, stop: Stop, trainer: Any, tokenizer: Any,
                 prompts: list[Prompt], eval_prompts: list[Prompt], warnings: list[str], teacher: Any = None) -> None:
        self.cfg, self.plan, self.run_dir, self.stop = cfg, plan, run_dir, stop
        self.trainer = trainer
        self.warnings = warnings
        self.eval_prompts = eval_prompts
        self.stop_ids = tuple(dict.fromkeys([*cfg.generation.stop_token_ids, tokenizer.eos_token_id]))
        saved = _resume(plan, trainer, run_dir) if plan.checkpoint is not None else {}
        offsets = saved.get("offsets", {})
        # A part that cannot start closes the parts opened before it (the run's files, the trackers); once all
        # started, `finish` closes them.
        with contextlib.ExitStack() as undo:
            self.trackers = Trackers(cfg, run_dir)  # first: a tracker that cannot start leaves nothing else open
            undo.callback(self.trackers.close)
            self.outcomes = undo.enter_context(contextlib.closing(open_record(run_dir / OUTCOMES_FILE, offsets)))
            self.metrics_file = undo.enter_context(contextlib.closing(open_record(run_dir / METRICS_FILE, offsets)))
            self.samples_file = undo.enter_context(contextlib.closing(open_record(run_dir / SAMPLES_FILE, offsets, warnings)))
            self.timeline_file = undo.enter_context(contextlib.closing(open_record(run_dir / TIMELINE_FILE, offsets, warnings)))
            self.engine = real_generator(cfg, trainer, tokenizer, run_dir)
            self.ranks = trainer if isinstance(trainer, RayTrainer) else None  # train.world_size > 1: ranks on Ray train
            self.teacher = teacher  # the algorithm's own scorer (distillation's teacher), in place of the reward functions
            self.parts = wire_run(
                cfg, prompts, Backends(self.engine, teacher=teacher, tokenizer=tokenizer, stop_token_ids=self.stop_ids),
                outcomes=self.outcomes.append, timeline_file=self.timeline_file, start_step=plan.step, saved=saved,
            )
            assert self.parts.timeline is not None  # given its file, wire_run always builds it
            self.timeline = self.parts.timeline
            self.eval_codec = episode_codec(cfg, tokenizer)  # evaluation plays episodes tokenized as the collector's
            keys = metric_keys(self.parts.reward_terms, max_staleness=cfg.rollout.trained_staleness_bound,
                               algorithm_keys=algorithm_for(cfg).metric_keys)
            self.metrics = MetricsWriter(self.metrics_file, keys)
            self.progress = Progress(cfg, plan.step)
            self.eval_state: dict[str, float | None] = dict.fromkeys([*EVAL_KEYS, *(f"eval/reward/{name}" for name in self.parts.reward_terms)])
            self.rewards_by_step: list[float] = []
            self.trainer_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncgrpo-trainer")
            self.started = time.perf_counter()
            self.token_rate = MovingRate(self.started, self.parts.collector.counters["rollout/generated_tokens_total"])
            self.final_checkpoint: Path | None = None
            self.ended_at = 0.0  # loop time when the pipeline ended
            self.tracker_failures: list[TrackerError] = []  # trackers that failed to close
            undo.pop_all()

    @classmethod
    def prepare(cls, cfg: Config, plan: ResumePlan, run_dir: Path, stop: Stop) -> TrainingRun:
        """Load the model and the data, restore a checkpoint, and wire the parts (step 3 of the story)."""
        import torch  # heavy imports only after the recipe is known to be sound

        from asyncgrpo.models.loading import load_model_and_tokenizer, load_tokenizer
        from asyncgrpo.training.trainer import TorchTrainer

        write_or_disk_error(run_dir / "config.yaml", cfg.to_yaml())
        torch.manual_seed(cfg.run.seed)
        if cfg.rollout.max_staleness > 0 and cfg.generation.backend == "local":
            # The engine and the trainer run at the same time: give each a share of the cores, since
            # oversubscribed OpenMP threads spin and slow both down many times over.
            torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
        log.info("loading the model %s ...", cfg.model.path)
        if cfg.train.world_size > 1:  # the ranks hold the trainer; this process, the tokenizer and the generators' copy
            tokenizer = load_tokenizer(cfg.model.path)
            trainer: Any = trainer_ranks(cfg, plan, tokenizer)
        else:
            model, tokenizer = load_model_and_tokenizer(cfg.model.path, "float32", cfg.run.seed)  # the trainer's master weights
            trainer = TorchTrainer(model, tokenizer, cfg)
        log.info("reading the data %s ...", cfg.data.source)
        prompts, eval_prompts, prompt_warnings = training_prompts(cfg, tokenizer)
        warnings = [*plan.notes, *prompt_warnings]
        teacher = algorithm_for(cfg).build_scorer(tokenizer)  # None: the reward functions score
        run = cls(cfg, plan, run_dir, stop, trainer, tokenizer, prompts, eval_prompts, warnings, teacher)
        if plan.checkpoint is not None:
            log.warning("resuming from %s (step %d)", plan.checkpoint, plan.step)
            for change in plan.changed:
                log.warning("  changed since the checkpoint (applied from this step on): %s", change)
        for warning in warnings:
            log.warning("warning: %s", warning)
        return run

    # -- the pipeline's trainer ---------------------------------------------------------

    async def train_step(self, groups: list[Group]) -> dict[str, float]:
        return await asyncio.get_running_loop().run_in_executor(self.trainer_thread, self.trainer.train_step, groups)

    def generation_weights(self) -> dict[str, Any]:
        return self.trainer.generation_weights()

    # -- step 4: generate and train -----------------------------------------------------

    async def generate_and_train(self) -> PipelineResult:
        """The start-up stages (engine, ranks, baseline evaluation) and the pipeline, until the data, max_steps, an error or
        a stop ends them. A stop cancels whichever stage is running: a long baseline evaluation does not hold it up."""
        stop = self.stop
        try:
            with LoopWatchdog(asyncio.get_running_loop(), threshold_s=self.cfg.logging.blocked_loop_warn_s), \
                    quiet_gc(rollouts_in_flight=self.cfg.generation.max_inflight):
                stop.pipeline = asyncio.create_task(self._stages())  # from the engine's start on, nothing may block the loop
                if stop.received:  # a signal arrived while loading
                    stop.pipeline.cancel()
                return await stop.pipeline
        except asyncio.CancelledError:
            if not (stop.received and stop.pipeline is not None and stop.pipeline.cancelled()):
                raise
            return PipelineResult("failed", "signal", self.trainer.version)
        finally:
            await self._close_parts()

    async def _stages(self) -> PipelineResult:
        cfg = self.cfg
        if cfg.generation.http.launch is not None:
            self.progress.stage(f"starting {cfg.generation.http.launch.count} generation servers on Ray")
        elif cfg.generation.backend == "http":
            self.progress.stage(f"waiting for the generation servers ({', '.join(cfg.generation.http.base_urls)})")
        else:
            self.progress.stage("starting the generation engine")
        if self.ranks is not None:
            self.progress.stage(f"starting {cfg.train.world_size} trainer ranks on Ray")
            await self.ranks.start()  # first: so they own the local Ray cluster, and let go of it last
        await self.engine.start()
        if self.teacher is not None:
            await self.teacher.start()
        if cfg.generation.backend == "http":
            # Cold sync: the servers serve exactly the trainer's weights (a fresh run's, or the checkpoint's).
            async with asyncio.timeout(cfg.generation.weight_sync_timeout_s):
                await self.engine.load_weights(self.trainer.generation_weights(), self.trainer.version)
        if self.eval_prompts:
            self.progress.stage(f"baseline evaluation on {len(self.eval_prompts)} prompts")
            failure = await self._evaluate(self.plan.step)  # the baseline, so eval/* is never empty
            if failure is not None:
                return PipelineResult("failed", "error", self.plan.step, failure.diagnostic, failure)
        self.progress.stage("generating the first batch")
        return await run_pipeline(
            cfg, collector=self.parts.collector, trainer=self, generator=self.engine, start_step=self.plan.step, on_step=self._on_step
        )

    async def _on_step(self, record: StepRecord) -> None:
        """After each trained step: evaluate when due, write its metrics and samples, checkpoint when due."""
        cfg, step = self.cfg, record.step + 1  # steps completed
        self.timeline.step(record, asyncio.get_running_loop().time())
        eval_failure = None
        if cfg.eval.every_steps and step % cfg.eval.every_steps == 0:
            self.progress.stage(f"evaluating after step {step}")
            eval_failure = await self._evaluate(step)
        now = time.perf_counter()
        values = step_metrics(
            record,
            self.parts.collector.metric_values(),
            reward_names=self.parts.reward_terms,
            elapsed_s=now - self.started,
            gen_tokens_per_s=self.token_rate.add(now, self.parts.collector.counters["rollout/generated_tokens_total"]),
            eval_metrics=self.eval_state,
        ) | generator_values(getattr(self.engine, "stats", dict)()) | self.parts.scorer.log.drain()
        # ^ the backend's server and weight-sync totals (generation/*), then the reward functions' log_metric values (user/<name>)
        try:
            line = self.metrics.write(values)
            write_samples(self.samples_file, record, cfg.logging.samples_per_step)
        except OSError as exc:
            raise PipelineError(disk_diagnostic(exc, self.run_dir, self.run_dir / METRICS_FILE, step)) from exc
        try:
            self.trackers.log(line)
        except TrackerError as exc:
            raise PipelineError(_tracker_diagnostic(exc, step)) from exc
        self.rewards_by_step.append(values["reward/mean"])
        self.progress.update(values, record, self.parts.collector.in_flight_groups)
        if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0 and step < cfg.train.max_steps:
            await self._checkpoint(step)
        if eval_failure is not None:
            raise eval_failure

    async def _evaluate(self, step: int) -> PipelineError | None:
        """Evaluate after `step` steps (not while stopping). Returns the error that must fail the run
        (the backend cannot serve it at all), after which the caller still writes the step's metrics."""
        if self.stop.received:
            return None
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            self.eval_state.update(await evaluate(
                self.cfg, self.engine, self.parts.scorer, self.eval_prompts, self.stop_ids, step=step, codec=self.eval_codec,
            ))
        except FatalBackendError as exc:
            return PipelineError.caused_by(eval_diagnostic(exc, step), exc)
        finally:
            self.timeline.evaluation(step, started, loop.time())
        return None

    def _checkpoint_state(self) -> tuple[dict[str, Any], dict[str, int]]:
        """Taken in one synchronous moment, so the ledger, counters and record files agree."""
        sizes = {f.path.name: f.offset() for f in self._records()}
        extra = {
            "done": self.parts.ledger.done_by_epoch(),
            "accounting": self.parts.collector.accounting.to_json(),
            "counters": dict(self.parts.collector.counters),
            "offsets": sizes,
            "timeline": self.timeline.state(asyncio.get_running_loop().time()),
        }
        return extra, {name: sizes[name] for name in (METRICS_FILE, OUTCOMES_FILE, TIMELINE_FILE)}

    def _records(self) -> tuple[JsonlFile, ...]:
        """The run's append-only records: each continues from the checkpoint a resume starts from."""
        return self.metrics_file, self.samples_file, self.outcomes, self.timeline_file

    def _save_checkpoint(self, step: int, extra: dict[str, Any], records: dict[str, int]) -> Path:
        from asyncgrpo.training.checkpoint import save_checkpoint

        return save_checkpoint(self.run_dir, step, self.trainer, self.cfg.to_yaml(), extra, records=records)

    async def _checkpoint(self, step: int) -> Path:
        extra, records = self._checkpoint_state()
        try:
            return await asyncio.get_running_loop().run_in_executor(self.trainer_thread, self._save_checkpoint, step, extra, records)
        except OSError as exc:
            raise PipelineError(disk_diagnostic(exc, self.run_dir, self.run_dir / "checkpoints", step)) from exc

    async def _close_parts(self) -> None:
        self.ended_at = asyncio.get_running_loop().time()
        self.progress.close()
        self.timeline.close()
        self.tracker_failures = self.trackers.close()
        await self.parts.scorer.aclose()
        if self.teacher is not None:
            await self.teacher.aclose()
        await self.engine.aclose()
        # A step in progress finishes before the thread is released (the pipeline completes a
        # started step even when cancelled), so the weights match the accounting saved after it.
        await run_in_daemon_thread(lambda: self.trainer_thread.shutdown(wait=True), name="asyncgrpo-trainer-shutdown")

    # -- step 5: finish -----------------------------------------------------------------

    def finish(self, result: PipelineResult) -> RunSummary:
        """The final checkpoint, the records closed, error.txt when the run failed, and the summary."""
        if self.trainer.version > 0 and (self.ranks is None or self.ranks.lost is None):  # a lost rank: none can be saved
            extra, records = self._checkpoint_state()
            try:
                self.final_checkpoint = self._save_checkpoint(self.trainer.version, extra, records)
            except OSError as exc:
                result = _with_failure(result, disk_diagnostic(exc, self.run_dir, self.run_dir / "checkpoints", self.trainer.version))
        for failure in self.tracker_failures:
            result = _with_failure(result, _tracker_diagnostic(failure, self.trainer.version))
        for file in self._records():
            file.close()
        if result.diagnostic is not None:
            try:
                (self.run_dir / ERROR_FILE).write_text(_error_report(result.diagnostic))
            except OSError as exc:
                log.warning("warning: could not write %s (%s)", self.run_dir / ERROR_FILE, exc.strerror)
        tenth = max(1, len(self.rewards_by_step) // 10)
        return RunSummary(
            run_dir=self.run_dir,
            result=result,
            accounting=self.parts.collector.accounting.to_json(),
            first_rewards=self.rewards_by_step[:tenth],
            last_rewards=self.rewards_by_step[-tenth:],
            final_checkpoint=self.final_checkpoint,
            interrupted_by=self.stop.received[0] if self.stop.received else None,
            warnings=self.warnings,
            totals=self.progress.totals,
            wall_s=time.perf_counter() - self.started,
            generator_use=self.timeline.utilisation(self.ended_at),
            start_step=self.plan.step,
        )


def _resume(plan: ResumePlan, trainer: Any, run_dir: Path) -> dict[str, Any]:
    """Load the checkpoint into `trainer` (ranks on Ray load it themselves as they start) and restore the run's records
    from it. Returns the checkpoint's extra."""
    from asyncgrpo.training.checkpoint import load_checkpoint, restore_records

    assert plan.checkpoint is not None
    try:
        saved = plan.state["extra"] if isinstance(trainer, RayTrainer) else load_checkpoint(plan.checkpoint, trainer)["extra"]
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


def _tracker_diagnostic(exc: TrackerError, step: int) -> Diagnostic:
    """A tracker of logging.sinks failed after `step` steps: the run's diagnostic (telemetry/sinks.py's policy)."""
    return Diagnostic(kind="tracker", message=f"After step {step}, {exc}", backend=exc.sink, trainer_step=step, original=exc)


def _with_failure(result: PipelineResult, diagnostic: Diagnostic) -> PipelineResult:
    """`result` failed with `diagnostic`, unless it already carries a first diagnostic (which stays: sticky)."""
    if result.diagnostic is not None:
        log.warning("warning: after the run's error, also: %s", diagnostic.render())
        return result
    return PipelineResult("failed", "error", result.steps, diagnostic, PipelineError(diagnostic), result.staleness_max)


def _error_report(diagnostic: Diagnostic) -> str:
    return f"{diagnostic.render()}\n\n{diagnostic.traceback}".rstrip() + "\n"
