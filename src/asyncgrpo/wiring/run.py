"""`wire_run`: the parts every run is made of, built in one order; `train` and `simulate` both call it.

The order (each part is built from those before it):
1. the reward scorer of `reward:` (the simulator's scores inline, on virtual time), whose TRL `trainer_state`
   reads the collector's trained steps when a group is scored (the collector, built in 4, exists by then);
2. the ledger: how each take of a prompt ended for good, continuing a checkpoint's, its records sent to `outcomes`;
3. the timeline (telemetry/timeline.py), when the run writes one, continuing a checkpoint's;
4. the collector (wiring/collector.py) over the prompts, on the backends' generator, scored by the algorithm's
   own scorer (distillation's teacher) or else the reward scorer, told each rollout's life by the timeline (or,
   without one, by the caller's observer), continuing a checkpoint's accounting and counters from `start_step`;
5. the reward terms the metrics report per step.

Nothing is patched after it is built.

What differs between a training run and a simulation comes in as `Backends`: the real engine and tokenizer,
or the scripted generator with the simulated environments and teacher. The caller owns what needs closing
(the files, the scorer's workers, the generator and the teacher).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from asyncgrpo.config import Config, EnvConfig
from asyncgrpo.environments.protocol import EnvironmentHost
from asyncgrpo.generation.base import Generator
from asyncgrpo.rewards.scoring import Isolation, RewardScorer
from asyncgrpo.rewards.trl_args import run_trainer_state
from asyncgrpo.rollout.collector import Collector, ScorerLike
from asyncgrpo.rollout.episode import term_names
from asyncgrpo.rollout.events import RolloutObserver
from asyncgrpo.rollout.ledger import PromptLedger
from asyncgrpo.telemetry.metrics import JsonlFile
from asyncgrpo.telemetry.timeline import Timeline
from asyncgrpo.types import Prompt
from asyncgrpo.wiring.collector import build_collector


@dataclass(frozen=True)
class Backends:
    """What a run generates, scores and plays episodes with, when that is not the recipe's default."""

    generator: Generator
    teacher: ScorerLike | None = None  # the algorithm's own scorer (distillation's teacher), in place of the reward functions
    tokenizer: Any = None  # None: the simulator (untokenized prompts; an episode is one id per character)
    stop_token_ids: tuple[int, ...] = ()  # the tokenizer's, besides generation.stop_token_ids
    isolation: Isolation | None = None  # overrides reward.isolation (the simulator's "inline")
    host_factory: Callable[[EnvConfig], EnvironmentHost] | None = None  # episodes' hosts; None: env.factory's


@dataclass
class RunParts:
    """The parts of one run, as `wire_run` built them."""

    scorer: RewardScorer
    ledger: PromptLedger
    timeline: Timeline | None
    collector: Collector
    reward_terms: list[str]  # the reward terms reported per step: the functions', and `env` with an environment


def wire_run(
    cfg: Config,
    prompts: list[Prompt],
    backends: Backends,
    *,
    outcomes: Callable[[dict[str, Any]], None] | None = None,
    timeline_file: JsonlFile | None = None,
    observer: RolloutObserver | None = None,
    start_step: int = 0,
    saved: Mapping[str, Any] | None = None,
) -> RunParts:
    """The run's parts over `prompts` (see the module docstring for the order).

    `outcomes` receives the ledger's records; `timeline_file`: where the timeline is written (None: no timeline,
    and `observer`, if any, is told each rollout's life instead);
    `start_step` and `saved` (a checkpoint's extra: its ledger, accounting, counters and timeline) continue a run."""
    saved = saved or {}
    collector: Collector  # built in step 4; the scorer reads its trained steps only when it scores a group (TRL's trainer_state)
    scorer = RewardScorer.from_config(cfg.reward, isolation=backends.isolation, trainer_state=functools.partial(
        run_trainer_state, cfg, len(prompts), lambda: collector.steps_trained))
    ledger = PromptLedger(saved.get("done"), sink=outcomes)
    timeline = None if timeline_file is None else Timeline(
        timeline_file, server=backends.generator.name, max_inflight=cfg.generation.max_inflight,
        group_size=cfg.rollout.group_size, max_rollout_spans=cfg.logging.timeline_max_rollouts,
        start_step=start_step, resumed=saved.get("timeline"),
    )
    collector = build_collector(
        cfg, prompts, backends.generator, stop_token_ids=backends.stop_token_ids, scorer=backends.teacher or scorer,
        ledger=ledger, start_step=start_step, resumed=dict(saved), observer=timeline if timeline is not None else observer,
        tokenizer=backends.tokenizer, host_factory=backends.host_factory,
    )
    return RunParts(scorer, ledger, timeline, collector, term_names(scorer.names, cfg.env))
