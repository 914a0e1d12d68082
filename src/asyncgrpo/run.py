"""One training run: wires the prompt source, collector, local engine, torch trainer, metrics, eval and checkpoints.

Order of a run:
1. `preflight(cfg)`: every name and path in the recipe is checked (model, data, eval data,
   reward functions, backends, run directory) before anything heavy is imported or loaded.
2. Load the model and tokenizer; the trainer trains one copy, the engine serves another.
3. `run_pipeline`: the shared loop of pipeline.py, with an `on_step` that writes metrics and
   samples, evaluates every `eval.every_steps`, and checkpoints every `checkpoint.every_steps`.
4. A final checkpoint and a summary.

Threads: the engine owns its decode thread; the trainer's steps and checkpoint writes run on
one dedicated thread owned by this module, shut down on every exit path. On SIGINT/SIGTERM
the pipeline is cancelled (no failure counted), the step in progress finishes, a checkpoint
is saved, and the process exits 130/143; a second signal exits at once (checkpoints are
written atomically, so the last one stays intact).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import os
import shutil
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncgrpo.config import Config
from asyncgrpo.data.loading import build_prompts, check_data_source, read_eval_rows, read_rows
from asyncgrpo.data.source import PromptSource
from asyncgrpo.errors import ConfigError, Diagnostic
from asyncgrpo.models.loading import check_model_path
from asyncgrpo.pipeline import PipelineResult, StepRecord, run_pipeline, step_budget_warnings
from asyncgrpo.rewards.scoring import RewardScorer, resolve_rewards
from asyncgrpo.rollout.accounting import Accounting
from asyncgrpo.rollout.ledger import PromptLedger
from asyncgrpo.threads import run_in_daemon_thread
from asyncgrpo.training.resume import ResumePlan, plan_resume
from asyncgrpo.types import GenerationRequest, Group, Prompt, SamplingParams

log = logging.getLogger("asyncgrpo")

EXIT_CODES = {"completed": 0, "failed": 1, "stalled": 2}
SIGNAL_EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


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
    run_dir = cfg.run.directory
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run.output_dir = {str(run_dir)!r} is a file, not a directory. Fix: choose another run.output_dir.")
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
    """The `asyncgrpo train` command: preflight, run with signal handling, print the summary."""
    preflight(cfg)
    summary = asyncio.run(_train_until_signal(cfg))
    print(summary.render(), file=sys.stderr)
    return summary.exit_code


@dataclass
class Stop:
    """A stop request from SIGINT/SIGTERM: which signal, and the pipeline task it cancels.

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
    loop = asyncio.get_running_loop()
    stop = Stop()

    def exit_now(signum: int, why: str) -> None:
        log.warning("%s: exiting at once; the last checkpoint on disk is intact (checkpoints are written atomically)", why)
        os._exit(SIGNAL_EXIT_CODES[signum])

    def on_signal(signum: int) -> None:
        if stop.received:
            exit_now(signum, f"second {signal.Signals(signum).name}")
        log.warning(
            "received %s: stopping (cancelling in-flight rollouts, saving a checkpoint) within run.shutdown_timeout_s = %gs; "
            "press Ctrl-C again to exit at once",
            signal.Signals(signum).name,
            cfg.run.shutdown_timeout_s,
        )
        stop.request(signum)
        loop.call_later(cfg.run.shutdown_timeout_s, exit_now, signum, "shutdown took longer than run.shutdown_timeout_s")

    for signum in SIGNAL_EXIT_CODES:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        return await train(cfg, stop=stop)
    finally:
        for signum in SIGNAL_EXIT_CODES:
            loop.remove_signal_handler(signum)


async def train(cfg: Config, *, stop: Stop | None = None) -> RunSummary:
    """Run one training to its end (see the module docstring). Config problems raise ConfigError first."""
    plan = preflight(cfg)
    stop = stop if stop is not None else Stop()
    import torch  # heavy imports only after the recipe is known to be sound

    from asyncgrpo.models.loading import load_model_and_tokenizer
    from asyncgrpo.rollout.collector import Collector
    from asyncgrpo.telemetry.metrics import JsonlFile, MetricsWriter, metric_keys, step_metrics, write_samples
    from asyncgrpo.training.checkpoint import load_checkpoint, save_checkpoint
    from asyncgrpo.training.trainer import TorchTrainer

    run_dir = cfg.run.directory
    if run_dir.exists() and (cfg.run.overwrite or plan.checkpoint is None):
        shutil.rmtree(run_dir)  # a fresh start: nothing of an earlier run may mix into this one
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())

    torch.manual_seed(cfg.run.seed)
    if cfg.rollout.max_staleness > 0 and cfg.generation.backend == "local":
        # The engine and the trainer run at the same time: give each a share of the cores, since
        # oversubscribed OpenMP threads spin and slow both down many times over.
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    model, tokenizer = load_model_and_tokenizer(cfg.model.path, cfg.model.dtype, cfg.run.seed)
    train_rows, eval_rows = _split_rows(cfg)
    prompts, report = build_prompts(train_rows, prompt_key=cfg.data.prompt_key, tokenizer=tokenizer, max_prompt_tokens=cfg.data.max_prompt_tokens)
    warnings = [*plan.notes, *report.warnings(), *step_budget_warnings(cfg, len(prompts))]
    for warning in warnings:
        log.warning("warning: %s", warning)
    eval_prompts: list[Prompt] = []
    if eval_rows:
        key = "eval.source" if cfg.eval.source else "data.prompt_key"
        eval_prompts, _ = build_prompts(eval_rows, prompt_key=cfg.data.prompt_key, tokenizer=tokenizer, max_prompt_tokens=cfg.data.max_prompt_tokens, key=key)

    trainer = TorchTrainer(model, tokenizer, cfg)
    saved: dict[str, Any] = {}
    if plan.checkpoint is not None:
        saved = load_checkpoint(plan.checkpoint, trainer)["extra"]
        log.warning("resuming from %s (step %d)", plan.checkpoint, plan.step)
        for change in plan.changed:
            log.warning("  changed since the checkpoint: %s", change)
    offsets = saved.get("offsets", {})
    outcomes = JsonlFile(run_dir / "outcomes.jsonl", offsets.get("outcomes.jsonl"))
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
    metrics_file = JsonlFile(run_dir / "metrics.jsonl", offsets.get("metrics.jsonl"))
    samples_file = JsonlFile(run_dir / "samples.jsonl", offsets.get("samples.jsonl"))
    metrics = MetricsWriter(metrics_file, metric_keys(scorer.names))
    progress = _Progress(cfg, start_step)
    rewards_by_step: list[float] = []
    eval_state: dict[str, float | None] = {"eval/reward_mean": None, "eval/pass_rate": None}
    started = time.perf_counter()
    last = {"time": started, "tokens": collector.counters["rollout/generated_tokens_total"]}

    class ThreadedTrainer:
        async def train_step(self, groups: list[Group]) -> dict[str, float]:
            return await loop.run_in_executor(trainer_thread, trainer.train_step, groups)

        def generation_weights(self) -> dict[str, Any]:
            return trainer.generation_weights()

    def checkpoint_extra() -> dict[str, Any]:
        """Taken in one synchronous moment, so the ledger, counters and file offsets agree."""
        return {
            "done": ledger.done_by_epoch(),
            "accounting": collector.accounting.to_json(),
            "counters": dict(collector.counters),
            "offsets": {f.path.name: f.offset() for f in (metrics_file, samples_file, outcomes)},
        }

    async def evaluate() -> None:
        eval_state.update(await _evaluate(cfg, engine, scorer, eval_prompts, stop_ids))

    async def on_step(record: StepRecord) -> None:
        step = record.step + 1  # steps completed
        if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and not stop.received:
            await evaluate()
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
        metrics.write(values)
        write_samples(samples_file, record, cfg.logging.samples_per_step)
        rewards_by_step.append(values["reward/mean"])
        progress.update(values)
        if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0 and step < cfg.train.max_steps:
            extra = checkpoint_extra()
            await loop.run_in_executor(trainer_thread, save_checkpoint, run_dir, step, trainer, cfg.to_yaml(), extra)

    final_checkpoint: Path | None = None
    result: PipelineResult | None = None
    try:
        await engine.start()
        if cfg.generation.backend == "http":
            # Cold sync: the servers serve exactly the trainer's weights (a fresh run's, or the checkpoint's).
            async with asyncio.timeout(cfg.generation.weight_sync_timeout_s):
                await engine.load_weights(trainer.generation_weights(), trainer.version)
        if eval_prompts:
            await evaluate()  # the baseline, so eval/* is never empty
        stop.pipeline = asyncio.create_task(
            run_pipeline(cfg, collector=collector, backend=ThreadedTrainer(), generator=engine, start_step=start_step, on_step=on_step)
        )
        if stop.received:  # a signal arrived while loading
            stop.pipeline.cancel()
        result = await stop.pipeline
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
        final_checkpoint = save_checkpoint(run_dir, trainer.version, trainer, cfg.to_yaml(), checkpoint_extra())
    for file in (metrics_file, samples_file, outcomes):
        file.close()
    if result.diagnostic is not None and result.diagnostic.traceback:
        (run_dir / "error.txt").write_text(_error_report(result.diagnostic))
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
    from asyncgrpo.generation.local import LocalEngine

    return LocalEngine(copy.deepcopy(trainer.model), tokenizer, max_batch_size=cfg.generation.local.max_batch_size, version=trainer.version)


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


async def _evaluate(cfg: Config, engine: Any, scorer: RewardScorer, prompts: list[Prompt], stop_ids: tuple[int, ...]) -> dict[str, float | None]:
    """Sample `eval.samples_per_prompt` completions per held-out prompt; report mean reward and pass@k."""
    sampling = SamplingParams(
        max_new_tokens=cfg.generation.max_new_tokens,
        temperature=cfg.eval.temperature,
        top_p=cfg.generation.top_p if cfg.eval.temperature > 0 else 1.0,
        stop_token_ids=stop_ids,
    )
    k = cfg.eval.samples_per_prompt

    async def one(prompt: Prompt) -> list[float | None]:
        requests = [
            GenerationRequest(f"eval-{prompt.id}-{i}", prompt.id, prompt.token_ids, sampling, seed=cfg.run.seed + i)
            for i in range(k)
        ]
        completions = []
        for request in requests:  # bounded: a hung server must not hang the evaluation
            async with asyncio.timeout(cfg.generation.request_timeout_s):
                completions.append(await engine.generate(request))
        return [s.reward for s in await scorer.score(prompt, [c.text for c in completions])]

    async with asyncio.TaskGroup() as task_group:
        tasks = [task_group.create_task(one(p)) for p in prompts]
    per_prompt = [t.result() for t in tasks]
    rewards = [r for rs in per_prompt for r in rs if r is not None]
    passed = [any(r is not None and r >= cfg.eval.success_threshold for r in rs) for rs in per_prompt]
    return {
        "eval/reward_mean": statistics.fmean(rewards) if rewards else None,
        "eval/pass_rate": sum(passed) / len(passed) if passed else None,
    }


def _error_report(diagnostic: Diagnostic) -> str:
    return f"{diagnostic.render()}\n\n{diagnostic.traceback}"


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
