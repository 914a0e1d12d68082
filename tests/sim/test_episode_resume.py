"""Resumable episodes (`rollout.on_stale: resume` with `env:`) on virtual time: the simulator's scripted environment and
scripted backend, one episode driven through the resumption runner (rollout/resumption.py) as the collector drives it,
and whole simulated runs.

An interrupted turn keeps its tokens and continues under the new weights; the episode's finished turns, its environment
(the same object: no new one is made, none is stopped) and the observations it gave are exactly an uninterrupted
episode's. A publication while the episode is in an environment call interrupts nothing: the next turn is generated
under the new weights. Across turns, every token older than the bound is masked out of the loss, token by token.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from asyncgrpo.commands.simulate import simulate
from asyncgrpo.commands.vtime import run_virtual
from asyncgrpo.config import Config, EnvConfig, validate_config
from asyncgrpo.environments.conversation import CharCodec
from asyncgrpo.environments.protocol import EnvironmentHost, Message, StepResult
from asyncgrpo.environments.simulated import SimulatedHosts
from asyncgrpo.generation.scripted import ScriptedGenerator
from asyncgrpo.rollout.books import Books
from asyncgrpo.rollout.episode import EpisodeRunner
from asyncgrpo.rollout.failures import FailurePolicy
from asyncgrpo.rollout.in_flight import InFlightGroup, rollout_request
from asyncgrpo.rollout.resumption import Resuming, runner_for
from asyncgrpo.rollout.retry import generate_with_retries
from asyncgrpo.rollout.stale_policy import stale_policy
from asyncgrpo.telemetry.timeline import Timeline
from asyncgrpo.types import Completion, GenerationRequest, Prompt, SamplingParams
from tests.sim.fakes import recipe
from tests.sim.test_chaos import check_books, check_outcome, check_token_bound

PROMPT = Prompt(id=0, text="p", token_ids=(1, 2))
TURNS = 4


def env_recipe(**rollout: object) -> Config:
    base = recipe(
        env={"factory": "simulated:env", "max_turns": TURNS, "max_tokens": 1024, "cancel_grace_s": 0.5},
        generation={"max_inflight": 16, "request_timeout_s": 1000.0, "rollout_deadline_s": 1000.0, "weight_sync_every": 1},
        rollout={"group_size": 2, "groups_per_step": 1, "max_requeues": 1, "on_stale": "resume", **rollout},
        train={"backend": "stub", "max_steps": 8},
        simulate={"env": {"call_s": {"dist": "uniform", "low": 0.0, "high": 1.0}, "done_prob": 0.0,
                           "stop_s": {"dist": "uniform", "low": 0.0, "high": 0.1}}},
    )
    return validate_config(base.model_dump(mode="json"))


class Episode:
    """One episode of member 0 of a group of one, generated as the collector generates it under `resume`; `publish(v)` is
    a weight publication (the generator serves `v`, the runner interrupts what it generates under an older version).
    `on_dispatch(request)` runs as each attempt is dispatched, `on_step(n)` as environment step n (from 1) starts."""

    def __init__(self, cfg: Config, *, on_dispatch: Callable[[Episode, GenerationRequest], None] = lambda e, r: None,
                 on_step: Callable[[Episode, int], None] = lambda e, n: None) -> None:
        self.cfg = cfg
        self.generator = ScriptedGenerator(cfg.simulate, seed=0, max_new_tokens=cfg.generation.max_new_tokens)
        self.hosts = SimulatedHosts(cfg.simulate.env, seed=0)
        self.runner = runner_for(stale_policy(cfg.rollout), Books(FailurePolicy.from_rollout(cfg.rollout)), continues_in_flight=False)
        assert isinstance(self.runner, Resuming)
        self.group = InFlightGroup(key=1, prompt=PROMPT, size=1)
        self.requests: list[GenerationRequest] = []  # every attempt, in order
        self.steps = 0  # environment steps started
        self._on_dispatch, self._on_step = on_dispatch, on_step

    def publish(self, version: int) -> None:
        self.generator._version = version
        self.runner.weights_published([self.group], version, step=version)

    def host(self, env: EnvConfig) -> EnvironmentHost:
        return _Counted(self.hosts(env), self)

    def started_step(self) -> None:
        self.steps += 1
        self._on_step(self, self.steps)

    def attempts(self, request: GenerationRequest, group: InFlightGroup, member: int, slot: object, floor: int | None = None,
                 ) -> Coroutine[object, object, Completion]:
        def dispatched() -> None:
            self.requests.append(request)
            version = self.generator.serving_version
            group.dispatch_versions[member] = version if floor is None else min(version, floor)
            self._on_dispatch(self, request)

        return generate_with_retries(self.generator, request, self.cfg.generation, jitter=random.Random(0), before_attempt=dispatched)

    async def play(self) -> Completion:
        episodes = EpisodeRunner.of_run(self.cfg, CharCodec(), {}, random.Random(0), self.host)
        assert episodes is not None
        generate = self.runner.rollouts(self.attempts)
        request = rollout_request(0, PROMPT, 0, SamplingParams(max_new_tokens=32))
        task = asyncio.create_task(episodes.run(PROMPT, request, lambda turn, floor: generate(turn, self.group, 0, None, floor),
                                                on_retry=lambda error: None, between_attempts=asyncio.sleep))
        self.group.member_tasks[0] = task  # type: ignore[assignment]
        return await task


class _Counted:
    """A simulated host that tells its episode when each step starts."""

    def __init__(self, host: EnvironmentHost, episode: Episode) -> None:
        self._host, self._episode = host, episode
        self.close_error = None

    async def reset(self, row: Mapping[str, Any]) -> tuple[Message, ...]:
        return await self._host.reset(row)

    async def step(self, action_text: str) -> StepResult:
        self._episode.started_step()
        return await self._host.step(action_text)

    async def close(self) -> None:
        await self._host.close()

    async def cancel(self, grace_s: float) -> bool:
        return await self._host.cancel(grace_s)


def turns(completion: Completion) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The episode's model turns as (ids, versions), split where the environment's tokens (mask 0) come between them."""
    assert completion.loss_mask is not None
    out: list[tuple[list[int], list[int]]] = []
    model = False
    for token, version, trained in zip(completion.token_ids, completion.versions, completion.loss_mask):
        if trained and not model:
            out.append(([], []))
        if trained:
            out[-1][0].append(token)
            out[-1][1].append(version)
        model = trained
    return [(tuple(ids), tuple(versions)) for ids, versions in out]


def environment_tokens(completion: Completion) -> list[int]:
    assert completion.loss_mask is not None
    return [t for t, trained in zip(completion.token_ids, completion.loss_mask) if not trained]


def test_an_interrupted_turn_resumes_and_the_episodes_finished_turns_and_environment_are_kept() -> None:
    cfg = env_recipe()
    uninterrupted = run_virtual(Episode(cfg).play())

    def halfway_through_turn_3(episode: Episode, request: GenerationRequest) -> None:
        if request.request_id.endswith("-t2") and not request.resumed_tokens:  # latency 1 s: version 1 after 16 of its 32 tokens
            asyncio.get_running_loop().call_later(0.5, episode.publish, 1)

    cut = Episode(cfg, on_dispatch=halfway_through_turn_3)
    interrupted = run_virtual(cut.play())

    assert cut.group.resumptions == [1] and cut.group.interrupts == [0] and not cut.group.generating[0]
    assert cut.hosts._made == 1 and cut.hosts.stopped == cut.hosts.abandoned == 0  # one environment, never stopped or remade
    assert interrupted.episode is not None and uninterrupted.episode is not None
    assert interrupted.episode.turns == uninterrupted.episode.turns == TURNS
    assert interrupted.episode.step_rewards == uninterrupted.episode.step_rewards
    assert environment_tokens(interrupted) == environment_tokens(uninterrupted)  # the observations it gave, unchanged
    before, after = turns(uninterrupted), turns(interrupted)
    assert after[:2] == before[:2] and {v for _, vs in after[:2] for v in vs} == {0}  # the finished turns, exactly
    ids, versions = after[2]
    resumed = cut.requests[3]  # the attempts: turns 1 and 2, turn 3 cut, turn 3 resumed, turn 4
    assert [r.request_id[-3:] for r in cut.requests] == ["-t0", "-t1", "-t2", "-t2", "-t3"]
    assert resumed.resumed_tokens == 16 and len(ids) == 32 and versions == (0,) * 16 + (1,) * 16
    assert ids[:16] == before[2][0][:16]  # the tokens it had are the uninterrupted turn's first ones
    assert resumed.prompt_token_ids == cut.requests[2].prompt_token_ids + ids[:16]  # its prefix is its context
    assert resumed.sampling.max_new_tokens == 16
    assert set(after[3][1]) == {1}  # the next turn under the new weights


def test_a_publication_during_an_environment_call_interrupts_nothing_and_the_next_turn_is_generated_under_it() -> None:
    def during_step_2(episode: Episode, n: int) -> None:
        if n == 2:
            episode.publish(1)

    episode = Episode(env_recipe(), on_step=during_step_2)
    completion = run_virtual(episode.play())
    assert episode.group.resumptions == [0] and episode.group.interrupts == [0]
    assert episode.hosts._made == 1 and episode.hosts.stopped == episode.hosts.abandoned == 0
    assert [set(versions) for _, versions in turns(completion)] == [{0}, {0}, {1}, {1}]
    assert all(not r.resumed_tokens for r in episode.requests) and len(episode.requests) == TURNS


def test_resumed_episodes_in_a_run_keep_every_invariant_and_are_masked_token_by_token_across_turns() -> None:
    # K = 1, steps of 0.2 s against turns of 1 s and environment calls of up to 1 s, groups over-admitted: versions move on
    # during every episode, its turns are interrupted and resumed, and its earlier turns fall past the bound.
    cfg = env_recipe(max_staleness=1, over_admit_groups=4, max_masked_share=1.0)
    cfg = validate_config({**cfg.model_dump(mode="json"), "simulate": {**cfg.simulate.model_dump(mode="json"), "step_time_s": 0.2}})
    timeline = Timeline(None, server="scripted", max_inflight=cfg.generation.max_inflight, group_size=cfg.rollout.group_size,
                        max_rollout_spans=0)
    sim = simulate(cfg, observer=timeline)
    check_outcome(sim)  # generated = trained + masked + wasted + held, among the rest
    check_books(sim, timeline)
    check_token_bound(sim)  # no trained token older than step - K
    counters = sim.collector.counters
    assert sim.result.outcome == "completed" and counters["rollout/resumed_rollouts_total"] > 0, counters
    assert counters["rollout/masked_stale_tokens_total"] > 0 and counters["env/abandoned_total"] == 0, counters
    across = 0  # trained episodes with a turn masked as older than the bound and a later one trained
    for record in sim.records:
        for group in record.batch:
            for rollout in group.rollouts:
                c = rollout.completion
                assert c.loss_mask is not None and c.episode is not None
                old = [i for i, v in enumerate(c.versions) if v < record.step - 1]
                assert not any(c.loss_mask[i] for i in old)  # every token past the bound is masked, whatever its turn
                trained = [i for i, m in enumerate(c.loss_mask) if m]
                across += bool(old and trained and max(old) < min(trained) and c.episode.turns >= 2)
    assert across > 0
