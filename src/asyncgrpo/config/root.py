"""The whole recipe (`Config`, one field per section) and the rules that span sections.

Invariants:
- A `Config` is consistent: every cross-section rule (`consistency_problems`) holds, or validation fails with
  one message per broken rule, each naming the dotted keys, their values and the fix.
- No rule branches on the algorithm's name: `algorithm:` is one of algorithms/names.py's names, and what the
  config needs of the algorithm (what bounds its scoring) is read from that table. The rules each algorithm
  sets on the recipe are its own (`config_problems`, algorithms/), checked when the registry builds it
  (algorithms/registry.py; names.py says why there and not here).
- `tolerance_warnings` lists settings that are valid but will not do what they suggest; they never fail a run.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator

from asyncgrpo.algorithms.names import ALGORITHMS
from asyncgrpo.config.checkpoint import CheckpointConfig
from asyncgrpo.config.data import DataConfig
from asyncgrpo.config.distill import DistillConfig
from asyncgrpo.config.env import EnvConfig
from asyncgrpo.config.eval import EvalConfig
from asyncgrpo.config.generation import GenerationConfig
from asyncgrpo.config.logs import LoggingConfig
from asyncgrpo.config.model import ModelConfig
from asyncgrpo.config.ray import RayConfig
from asyncgrpo.config.reward import RewardConfig
from asyncgrpo.config.rollout import RolloutConfig
from asyncgrpo.config.run import RunConfig
from asyncgrpo.config.section import Section
from asyncgrpo.config.simulate import SimulateConfig
from asyncgrpo.config.train import TrainConfig
from asyncgrpo.loss_config import loss_warnings


class Config(Section):
    """A run's configuration: the recipe's sections, each a model of its own module."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    runtime: Literal["local", "ray"] = Field("local", description="local: all in this process; ray: generators as Ray actors (see the ray: section).")
    ray: RayConfig = Field(default_factory=RayConfig)
    env: EnvConfig | None = Field(None, description="Multi-turn environments (the env: section); null: single-turn rollouts.")
    algorithm: str = Field("grpo", description="; ".join(f"{name}: {a.description}" for name, a in ALGORITHMS.items()) + ".")
    distill: DistillConfig = Field(default_factory=DistillConfig)
    simulate: SimulateConfig = Field(default_factory=SimulateConfig)

    @field_validator("algorithm")
    @classmethod
    def _known_algorithm(cls, name: str) -> str:
        if name not in ALGORITHMS:
            raise ValueError(
                f"{name!r} is not an algorithm; the algorithms are {', '.join(ALGORITHMS)}. Fix: set algorithm to one of them "
                f"(grpo, the default, trains on rewards)."
            )
        return name

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        problems = consistency_problems(self)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @property
    def stall_timeout_s(self) -> float:
        return self.stall_bound()[0]

    def stall_bound(self) -> tuple[float, str]:
        """`rollout.stall_timeout_s` as the run applies it, and where it comes from (for `check` and the stall diagnostic).

        The derived default outlasts the longest wait between two signs of progress (a rollout or an episode's turn
        finished, a step trained): a rollout's generation (with an env: one turn's, then its step, and before the first
        turn the reset, each within env.step_timeout_s, and a close within the grace), then the scoring of its group."""
        if self.rollout.stall_timeout_s is not None:
            return self.rollout.stall_timeout_s, "rollout.stall_timeout_s"
        g, env = self.generation, self.env
        parts = [(g.rollout_deadline_s, "generation.rollout_deadline_s")]
        if env is not None:
            parts += [(2 * env.step_timeout_s, "2 x env.step_timeout_s"), (env.cancel_grace_s, "env.cancel_grace_s")]
        if (scorer := ALGORITHMS[self.algorithm].scorer_timeout) is not None:  # the algorithm's own scorer, e.g. distillation's teacher
            parts.append((self.value_at(scorer), scorer))
        elif self.reward.functions:
            parts.append((self.reward.timeout_s * len(self.reward.functions), f"{len(self.reward.functions)} x reward.timeout_s"))
        parts += [(g.health_probe_interval_s, "generation.health_probe_interval_s"), (60.0, "margin")]
        how = " + ".join(f"{value:g} s {name}" for value, name in parts)
        return sum(value for value, _ in parts), f"derived: {how}"

    def value_at(self, key: str) -> float:
        """The value of the dotted `key` (`distill.timeout_s`)."""
        value: Any = functools.reduce(getattr, key.split("."), self)
        return float(value)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def launch_problems(cfg: Config) -> list[str]:
    """Where the generators come from: runtime ray runs local engines as actors, or launches HTTP servers
    (generation.http.launch); the http backend needs servers listed or launched."""
    g, launch = cfg.generation, cfg.generation.http.launch
    if launch is not None and (cfg.runtime != "ray" or g.backend != "http"):
        return [f"generation.http.launch starts servers as Ray actors, but runtime = {cfg.runtime!r} and generation.backend = "
                f"{g.backend!r}. Fix: set runtime: ray and generation.backend: http, or remove generation.http.launch and "
                f"list running servers in generation.http.base_urls."]
    if g.backend == "http" and not g.http.base_urls and launch is None:
        return ["generation.backend = 'http' needs at least one server: set generation.http.base_urls, "
                "e.g. [http://127.0.0.1:8000]" + (", or let the run start them: generation.http.launch: {count: 2}."
                                                  if cfg.runtime == "ray" else ".")]
    if cfg.runtime == "ray" and g.backend != "local" and launch is None:
        return [f"runtime = 'ray' runs generation.backend = 'local' engines as Ray actors, or starts HTTP servers as Ray actors "
                f"(generation.http.launch), but generation.backend = {g.backend!r} without generation.http.launch. Fix: set "
                f"generation.backend: local, set generation.http.launch (backend http), or runtime: local for the {g.backend} "
                f"backend."]
    return []


def consistency_problems(cfg: Config) -> list[str]:
    """Cross-field rules; each message names the dotted keys, their values and the fix."""
    problems: list[str] = []
    r, g = cfg.rollout, cfg.generation
    if r.min_group_survivors > r.group_size:
        problems.append(
            f"rollout.min_group_survivors = {r.min_group_survivors} exceeds rollout.group_size = {r.group_size}: "
            f"no group could ever succeed. Fix: set rollout.min_group_survivors to at most {r.group_size}."
        )
    if g.http.weight_sync == "lora" and cfg.train.lora is None:
        problems.append(
            "generation.http.weight_sync = lora publishes LoRA adapters, but train.lora is not set: the trainer trains every "
            "weight, so there is no adapter to send. Fix: set train.lora (e.g. train.lora: {r: 16}) to train adapters, or set "
            "generation.http.weight_sync to full or delta."
        )
    if g.weight_sync_every > r.max_staleness + 1:
        problems.append(
            f"generation.weight_sync_every = {g.weight_sync_every} exceeds rollout.max_staleness + 1 = {r.max_staleness + 1}: "
            f"generators would serve weights older than the staleness bound allows. Fix: set "
            f"generation.weight_sync_every <= {r.max_staleness + 1} or raise rollout.max_staleness."
        )
    if r.on_stale == "wait" and r.partial_groups:
        problems.append(
            "rollout.partial_groups = true with rollout.on_stale = 'wait': wait never leaves a group behind, so no group would finish "
            "early. Fix: set rollout.partial_groups: false, or choose another rollout.on_stale."
        )
    if r.on_stale == "wait" and r.over_admit_groups:
        problems.append(
            f"rollout.over_admit_groups = {r.over_admit_groups} with rollout.on_stale = 'wait': wait trains every admitted group "
            f"at the step it targets, so a group beyond the capacity would have no step. Fix: set rollout.over_admit_groups: 0, "
            f"or choose another rollout.on_stale."
        )
    problems += resume_problems(cfg)
    if g.request_timeout_s > g.rollout_deadline_s:
        problems.append(
            f"generation.request_timeout_s = {g.request_timeout_s:g} exceeds generation.rollout_deadline_s = "
            f"{g.rollout_deadline_s:g}: one attempt could outlive its rollout. Fix: lower request_timeout_s or raise rollout_deadline_s."
        )
    if g.retry_backoff_s > g.retry_backoff_max_s:
        problems.append(
            f"generation.retry_backoff_s = {g.retry_backoff_s:g} exceeds generation.retry_backoff_max_s = {g.retry_backoff_max_s:g}. "
            f"Fix: make the first delay at most the cap."
        )
    problems += launch_problems(cfg)
    if cfg.train.world_size > 1 and cfg.runtime != "ray":
        problems.append(
            f"train.world_size = {cfg.train.world_size} trains on Ray actors, but runtime = {cfg.runtime!r}. "
            f"Fix: set runtime: ray, or train.world_size: 1."
        )
    ray, launch = cfg.ray, g.http.launch
    ranks = cfg.train.world_size if cfg.train.world_size > 1 else 0
    actors = (f"generation.http.launch.count = {launch.count} servers x generation.http.launch.num_cpus = {launch.num_cpus:g}"
              if g.backend == "http" and launch is not None else
              f"ray.generators = {ray.generators} actors x ray.generator.num_cpus = {ray.generator.num_cpus:g}")
    needed = (launch.count * launch.num_cpus if g.backend == "http" and launch is not None
              else ray.generators * ray.generator.num_cpus) + ranks * ray.trainer.num_cpus
    if cfg.runtime == "ray" and ray.address is None and ray.num_cpus is not None and needed > ray.num_cpus:
        problems.append(
            actors
            + (f" and train.world_size = {ranks} ranks x ray.trainer.num_cpus = {ray.trainer.num_cpus:g}" if ranks else "")
            + f" need {needed:g} CPUs, more than the local cluster's ray.num_cpus = {ray.num_cpus}: Ray would never place "
            f"them all. Fix: lower the per-actor num_cpus, the number of actors or train.world_size, or raise ray.num_cpus."
        )
    if ALGORITHMS[cfg.algorithm].scorer_timeout is None and not cfg.reward.functions and (cfg.env is None or cfg.env.reward_weight == 0):
        where = "no env: section" if cfg.env is None else "env.reward_weight = 0"
        problems.append(
            f"reward.functions is empty and {where}: no rollout could get a reward. Fix: list at least one reward "
            f"function in reward.functions, or configure an environment (env.factory) with env.reward_weight > 0."
        )
    if cfg.env is not None and cfg.env.cancel_grace_s >= cfg.run.shutdown_timeout_s:
        problems.append(
            f"env.cancel_grace_s = {cfg.env.cancel_grace_s:g} is not below run.shutdown_timeout_s = {cfg.run.shutdown_timeout_s:g}: "
            f"a shutdown waits for cancelled episodes up to their grace, so it could not end cleanly in time. Fix: lower "
            f"env.cancel_grace_s or raise run.shutdown_timeout_s."
        )
    weights = cfg.reward.weights
    if weights is not None and len(weights) != len(cfg.reward.functions):
        problems.append(
            f"reward.weights has {len(weights)} values but reward.functions has {len(cfg.reward.functions)}: "
            f"give one weight per function, or drop reward.weights to weigh each 1.0."
        )
    return problems


def tolerance_warnings(cfg: Config) -> list[str]:
    """Settings that are valid but will not do what they suggest: a warm-up as long as the run, and a failure
    budget that cannot be spent as it says (`_failure_budget_warnings`)."""
    t = cfg.train
    warnings = _failure_budget_warnings(cfg) + loss_warnings(t.loss)
    if t.warmup_steps >= t.max_steps:
        decay = f", and train.lr_schedule = {t.lr_schedule!r} never starts" if t.lr_schedule != "constant" else ""
        warnings.append(
            f"train.warmup_steps = {t.warmup_steps} is not below train.max_steps = {t.max_steps}: the whole run is warm-up, "
            f"its learning rate rising to {t.max_steps / t.warmup_steps:.0%} of train.lr = {t.lr:g} at the last step{decay}. "
            f"Fix: lower train.warmup_steps below train.max_steps (a tenth of it is common)."
        )
    return warnings


def _failure_budget_warnings(cfg: Config) -> list[str]:
    """A failure budget the drop-fraction rule overrides.

    The failure policy (rollout/failures.py) checks the consecutive budget first, at a streak of
    `max_generation_failures + 1`, and the drop-fraction rule only once `drop_window` groups have
    finished, at more than `max_drop_fraction * drop_window` drops in the window. So a streak of
    `floor(f * W) + 1` failed groups in a full window breaks the drop-fraction rule, and a budget at
    or above the window can never be spent.
    """
    r = cfg.rollout
    if r.max_drop_fraction >= 1.0:
        return []
    window_streak = math.floor(r.max_drop_fraction * r.drop_window) + 1
    rule = (
        f"the drop-fraction rule (more than rollout.max_drop_fraction = {r.max_drop_fraction:g} of rollout.drop_window = "
        f"{r.drop_window} groups dropped) fails the run after {window_streak} consecutive all-failed groups"
    )
    if r.max_generation_failures >= r.drop_window:
        return [
            f"rollout.max_generation_failures = {r.max_generation_failures} can never be reached: {rule}, before the "
            f"streak can exceed {r.max_generation_failures}. Set rollout.max_drop_fraction: 1.0 to turn that rule off, "
            f"or lower rollout.max_generation_failures below {window_streak}."
        ]
    if r.max_generation_failures >= window_streak:
        return [
            f"rollout.max_generation_failures = {r.max_generation_failures} applies only until the first {r.drop_window} "
            f"groups of the run have finished; after that {rule}. Set rollout.max_drop_fraction: 1.0 to turn that rule "
            f"off, or lower rollout.max_generation_failures below {window_streak}."
        ]
    return []


def resume_problems(cfg: Config) -> list[str]:
    """`rollout.on_stale: resume` needs a backend that keeps an interrupted request's tokens, and plain rollouts."""
    r, problems = cfg.rollout, list[str]()
    if r.max_prefix_staleness is not None and (r.on_stale != "resume" or r.max_prefix_staleness < r.max_staleness):
        problems.append(
            f"rollout.max_prefix_staleness = {r.max_prefix_staleness} with rollout.on_stale = {r.on_stale!r} and rollout.max_staleness = "
            f"{r.max_staleness}: it bounds the tokens of resumed groups, so it needs on_stale: resume and at least max_staleness. "
            f"Fix: set rollout.on_stale: resume and rollout.max_prefix_staleness >= {r.max_staleness}, or remove it."
        )
    if r.on_stale != "resume":
        return problems
    if r.partial_groups:
        problems.append(resume_unsupported("rollout.partial_groups", "true"))
    if cfg.env is not None and cfg.env.is_agent:
        problems.append(
            f"rollout.on_stale = 'resume' with env.factory = {cfg.env.factory!r}: an agent's episodes cannot be resumed yet. The agent "
            "waits on its own HTTP client for each model call through the gateway, with a timeout of generation.rollout_deadline_s + "
            "env.step_timeout_s that a resumed turn may outlive (each resumption starts the turn's deadline afresh). "
            "Environments (module:Class, openenv:, python:) resume; agents (agent:, agent-command:) do not. "
            "Fix: choose another rollout.on_stale (patience is the default), or play the task as an environment."
        )
    return problems


def resume_unsupported(key: str, value: str) -> str:
    """The problem of `rollout.on_stale: resume` with `key` = `value`; an algorithm whose rollouts cannot be resumed
    reports it with key `algorithm` (its `config_problems`)."""
    return (
        f"rollout.on_stale = 'resume' with {key} = {value}: resumable rollouts are built for GRPO rollouts and environment "
        f"episodes on the scripted, local, http and Ray backends (no partial groups, no agents) so far. Fix: choose "
        f"another rollout.on_stale (patience is the default), or drop {key}."
    )
