"""`asyncgrpo simulate`: the whole pipeline on virtual time, with the scripted backend and the stub trainer.

The collector, buffer, policies, reward scoring and the training loop are the real ones;
only generation (seeded latencies, lengths and faults), the distillation teacher (`algorithm:
distill`: seeded latency and faults, distill/simulated.py) and the optimizer step (a fixed
virtual duration) are scripted. A simulated hour of the shipped recipe takes a few seconds
(docs/benchmarks.md, "Simulator speed"), so users can tune staleness, concurrency and
failure tolerance, and chaos-test a recipe, before spending GPU hours; the test suite uses
it to check every invariant under faults.

Invariants checked on every run (a violation raises `InvariantViolation`, a bug):
accounting balances; no trained group exceeded the staleness bound; every task the
pipeline started has ended when it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncgrpo.algorithms.registry import algorithm_for
from asyncgrpo.commands.gc_pauses import quiet_gc
from asyncgrpo.commands.sim_metrics import population_length, token_capacities, token_metrics
from asyncgrpo.commands.vtime import run_virtual
from asyncgrpo.config import Config
from asyncgrpo.data.loading import check_data_source
from asyncgrpo.distributions import mean_of
from asyncgrpo.environments.simulated import SimulatedHosts
from asyncgrpo.errors import ConfigError
from asyncgrpo.generation.base import Generator
from asyncgrpo.generation.contention import SharedHardware
from asyncgrpo.generation.scripted import ScriptedGenerator
from asyncgrpo.pipeline import PipelineResult, run_pipeline
from asyncgrpo.rewards.resolve import resolve_rewards
from asyncgrpo.rollout.collector import Collector
from asyncgrpo.rollout.events import RolloutObserver
from asyncgrpo.rundir import METRICS_FILE, TIMELINE_FILE
from asyncgrpo.telemetry.metrics import JsonlFile, MetricsWriter, MovingRate, metric_keys, step_metrics
from asyncgrpo.training.stub import StubTrainer
from asyncgrpo.types import StepRecord
from asyncgrpo.wiring.prompts import simulation_prompts
from asyncgrpo.wiring.run import Backends, RunParts, wire_run

log = logging.getLogger("asyncgrpo")

EXIT_CODES = {"completed": 0, "failed": 1, "stalled": 2}


class InvariantViolation(AssertionError):
    """The pipeline broke one of DESIGN.md §2's invariants: always a bug in asyncgrpo."""


@dataclass
class Simulation:
    """A finished simulation: the pipeline's result and what the report needs."""

    cfg: Config
    result: PipelineResult
    collector: Collector
    generator: Generator
    trainer: StubTrainer
    records: list[StepRecord]
    virtual_time_s: float
    wall_time_s: float
    outcomes: list[dict[str, Any]]  # the ledger's records: how each take ended for good
    env_hosts: SimulatedHosts | None = None  # with an env: section, the simulated environments
    evals: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each evaluation (simulate.eval_s)

    def report(self) -> dict[str, Any]:
        """The `simulate --json` object (format documented in the README)."""
        cfg, r = self.cfg, self.result
        trained_completions = sum(len(g.rollouts) for g in self.trainer.trained_groups)
        drawn = getattr(self.generator, "drawn_lengths", {})
        length = population_length(drawn) or max(1.0, mean_of(cfg.simulate.tokens))  # lengths are at least 1
        bound = min(token_capacities(cfg, length)) / length  # completions/s; a latency of 0 leaves the training capacity
        rate = trained_completions / self.virtual_time_s if self.virtual_time_s > 0 else 0.0
        return {
            "outcome": r.outcome,
            "stop_reason": r.stop_reason,
            "steps": r.steps,
            "error": None if r.diagnostic is None else r.diagnostic.to_json(),
            "counters": dict(self.collector.counters),
            "staleness_max": r.staleness_max,
            "accounting": self.collector.accounting.to_json(),
            "virtual_time_s": round(self.virtual_time_s, 6),
            "wall_time_s": round(self.wall_time_s, 6),
            "efficiency": round(rate / bound, 6) if bound > 0 else 0.0,
            "trained_completions": trained_completions,
            "capacity_bound_completions_per_s": round(bound, 6),
            **token_metrics(cfg, self.collector.counters, drawn, self.outcomes, self.virtual_time_s),
        }

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.result.outcome]


def preflight_simulation(cfg: Config) -> None:
    """Raise ConfigError for any mistake in a simulate recipe: backends, data source, reward functions."""
    check_simulatable(cfg)
    check_data_source(cfg.data.source, key="data.source")
    resolve_rewards(cfg.reward.functions)


def check_simulatable(cfg: Config) -> None:
    problems = []
    if cfg.generation.backend != "scripted":
        problems.append(f"generation.backend = {cfg.generation.backend!r}: simulate needs 'scripted'. Fix: add generation.backend=scripted.")
    if cfg.train.backend != "stub":
        problems.append(f"train.backend = {cfg.train.backend!r}: simulate needs 'stub'. Fix: add train.backend=stub.")
    if problems:
        raise ConfigError("simulate runs on virtual time with a scripted generator and a stub trainer:\n" + "\n".join(f"  - {p}" for p in problems))


def simulate(cfg: Config, generator: Generator | None = None, trainer: StubTrainer | None = None,
             output_dir: Path | None = None, observer: RolloutObserver | None = None) -> Simulation:
    """Run one simulation to its end; config errors raise ConfigError, invariant breaks InvariantViolation.

    `generator` and `trainer` replace the scripted backend and the stub trainer (tests drive
    exact fates with them); they must read time only through the event loop. With `output_dir`
    (`simulate --output-dir DIR`), the run's `metrics.jsonl` and `timeline.jsonl` are written
    there, on virtual time, as a training run writes them (`asyncgrpo plot DIR` draws them);
    the train-only metrics (loss, kl, ...) are null. `observer` watches the rollouts when no `output_dir`'s timeline does.
    """
    check_simulatable(cfg)
    prompts, warnings = simulation_prompts(cfg)
    for warning in warnings:
        log.warning("warning: %s", warning)
    contention = cfg.simulate.contention
    hardware = None if contention.decode == contention.train == 1.0 else SharedHardware(
        decode_slowdown=contention.decode, train_slowdown=contention.train)  # the scripted backend's and the stub trainer's
    if generator is None:
        generator = ScriptedGenerator(cfg.simulate, seed=cfg.run.seed, max_new_tokens=cfg.generation.max_new_tokens, hardware=hardware)
    algorithm = algorithm_for(cfg)
    trainer = trainer if trainer is not None else StubTrainer(
        cfg.simulate.step_time_s, cfg.simulate.token_time_s, algorithm=algorithm, step_overhead_s=cfg.simulate.step_overhead_s,
        hardware=hardware)
    # Episodes run on the simulator's model of an environment (simulate.env), not env.factory.
    env_hosts = SimulatedHosts(cfg.simulate.env, cfg.run.seed) if cfg.env is not None else None
    teacher = algorithm.simulated_scorer()  # None: the reward functions score
    outcomes: list[dict[str, Any]] = []
    with contextlib.ExitStack() as closing:  # a part that fails to start closes the report's files opened before it
        report = _Report(cfg, output_dir) if output_dir is not None else None
        if report is not None:
            closing.callback(report.close)
        parts = wire_run(cfg, prompts, Backends(generator, teacher=teacher, isolation="inline", host_factory=env_hosts),
                         outcomes=outcomes.append, timeline_file=report.timeline_file if report else None, observer=observer)
        if parts.timeline is not None:
            closing.callback(parts.timeline.close)  # before its file: the callbacks run last in, first out
        collector, scorer = parts.collector, parts.scorer
        records: list[StepRecord] = []
        evals: list[tuple[float, float]] = []  # (start, end) of each simulated evaluation

        async def record(step: StepRecord) -> None:
            records.append(step)
            if report is not None:
                report.step(step, parts, scorer.log.drain())
            done = step.step + 1
            if cfg.simulate.eval_s and cfg.eval.every_steps and done % cfg.eval.every_steps == 0:  # as commands/train.py evaluates
                loop = asyncio.get_running_loop()
                started = loop.time()
                await asyncio.sleep(cfg.simulate.eval_s)
                evals.append((started, loop.time()))
                if parts.timeline is not None:
                    parts.timeline.evaluation(done, started, loop.time())

        async def main() -> tuple[PipelineResult, float]:
            result = await run_pipeline(cfg, collector=collector, trainer=trainer, generator=generator, on_step=record)
            leftovers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if leftovers:
                raise InvariantViolation(f"tasks outlived the pipeline: {[t.get_name() for t in leftovers]}")
            return result, asyncio.get_running_loop().time()

        wall_start = time.perf_counter()
        # no full collection: per simulation it would cost more than a small one runs
        with quiet_gc(collect=False, rollouts_in_flight=cfg.generation.max_inflight):
            result, virtual_time = run_virtual(main())
    simulation = Simulation(
        cfg, result, collector, generator, trainer, records, virtual_time, time.perf_counter() - wall_start, outcomes, env_hosts, evals,
    )
    check_invariants(simulation)
    return simulation


class _Report:
    """The files of `simulate --output-dir`: metrics.jsonl and timeline.jsonl (the run's timeline writes it), on virtual time."""

    def __init__(self, cfg: Config, output_dir: Path) -> None:
        output_dir.mkdir(parents=True, exist_ok=True)
        self.cfg = cfg
        self.timeline_file = JsonlFile(output_dir / TIMELINE_FILE, truncate_to=0)
        self.file = JsonlFile(output_dir / METRICS_FILE, truncate_to=0)
        self.rate = MovingRate(0.0, 0)
        self.writer: MetricsWriter | None = None

    def step(self, record: StepRecord, parts: RunParts, logged: dict[str, float]) -> None:
        """Write the step's metrics line; `logged`: the reward functions' log_metric means (user/<name>)."""
        now = asyncio.get_running_loop().time()
        assert parts.timeline is not None  # given its file, wire_run always builds it
        parts.timeline.step(record, now)
        collector, reward_names = parts.collector, parts.reward_terms
        if self.writer is None:
            self.writer = MetricsWriter(self.file, metric_keys(reward_names, max_staleness=self.cfg.rollout.trained_staleness_bound,
                                                                  algorithm_keys=algorithm_for(self.cfg).metric_keys))
        values = step_metrics(
            record, collector.metric_values(), reward_names=reward_names, elapsed_s=now,
            gen_tokens_per_s=self.rate.add(now, collector.counters["rollout/generated_tokens_total"]), eval_metrics={},
        )
        self.writer.write({**dict.fromkeys(self.writer.keys), **values, **logged})

    def close(self) -> None:
        self.timeline_file.close()
        self.file.close()


def check_invariants(sim: Simulation) -> None:
    acc = sim.collector.accounting
    if not acc.balanced():
        raise InvariantViolation(f"accounting does not add up: {acc.to_json()}")
    k = sim.cfg.rollout.max_staleness
    for record in sim.records:
        for group, staleness in zip(record.batch, record.staleness):
            if staleness > group.bound(k):  # a resumed group's own bound: rollout.max_prefix_staleness
                raise InvariantViolation(f"step {record.step} trained staleness {staleness} > its bound {group.bound(k)} (max_staleness {k})")
    if sim.env_hosts is not None and sim.collector.counters["env/abandoned_total"] != sim.env_hosts.abandoned:
        raise InvariantViolation(
            f"{sim.env_hosts.abandoned} episodes outlived their grace but env/abandoned_total = {sim.collector.counters['env/abandoned_total']}"
        )
    if acc.trained != len(sim.trainer.trained_groups):
        raise InvariantViolation(f"accounting says {acc.trained} trained, the trainer saw {len(sim.trainer.trained_groups)}")
