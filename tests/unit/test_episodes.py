"""Multi-turn episodes in the collector (rollout/episode.py) with thread-hosted environments, on a real event loop.

The environments are in tests/envs.py; the generator is the programmed fake, answering at once.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from asyncgrpo.threads import run_in_daemon_thread
from tests import envs
from tests.sim.fakes import Fate, ProgrammedGenerator, make_collector, recipe

FAST = Fate(after_s=0.001, tokens=3)


def env_recipe(factory: str, *, group_size: int = 2, grace_s: float = 2.0, **env: object):
    return recipe(
        env={"factory": f"tests.envs:{factory}", "cancel_grace_s": grace_s, "max_turns": 3, **env},
        reward={"functions": []},
        generation={"max_inflight": group_size},
        rollout={"group_size": group_size, "groups_per_step": 1, "min_group_survivors": 2},
    )


async def steps_started(n: int) -> None:
    """Wait (up to 30 s) until `n` environment steps have begun."""
    for _ in range(n):
        assert await run_in_daemon_thread(lambda: envs.STARTED.acquire(timeout=30), name="test-wait"), "an episode never reached step"


async def run_until_steps_then_stop(cfg, n: int):
    collector = make_collector(cfg, ProgrammedGenerator(lambda request, attempt: FAST))
    async with asyncio.timeout(60):
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(collector.run())
            await steps_started(n)
            collector.stop()
    return collector


@pytest.fixture(autouse=True)
def fresh_envs():
    envs.reset_all()
    yield
    envs.Stubborn.release.set()  # let abandoned threads end


def test_cancelling_a_group_stops_a_cooperative_environment_within_the_grace():
    collector = asyncio.run(run_until_steps_then_stop(env_recipe("Cooperative"), 2))
    episodes = envs.Cooperative.instances
    assert len(episodes) == 2
    # The side effect stopped: each step saw its token and returned before run() did (within the grace).
    assert all(e.returned.is_set() for e in episodes)
    counts = [e.count for e in episodes]
    assert all(c > 0 for c in counts)
    assert [e.closed for e in episodes] == [1, 1]  # close() once, from the cancelling side
    assert collector.counters["env/abandoned_total"] == 0
    # Cancellation is not a failure.
    assert collector.counters["rollout/failed_total"] == 0 and collector.counters["env/errors_total"] == 0
    assert collector.accounting.in_flight == 1 and collector.open_requests == 0
    assert [e.count for e in episodes] == counts


def test_an_environment_that_ignores_the_token_is_counted_abandoned_and_logged(caplog):
    caplog.set_level(logging.WARNING, logger="asyncgrpo")
    collector = asyncio.run(run_until_steps_then_stop(env_recipe("Stubborn", grace_s=0.05), 2))
    assert collector.counters["env/abandoned_total"] == 2
    assert collector.counters["rollout/failed_total"] == 0
    abandoned = [r.getMessage() for r in caplog.records if "abandoned" in r.getMessage()]
    assert len(abandoned) == 1 and "tests.envs:Stubborn" in abandoned[0]  # the first in full; later ones only counted
    assert "later ones of this environment are counted there without a log line each" in abandoned[0]


async def first_batches(cfg, n: int):
    generator = ProgrammedGenerator(lambda request, attempt: FAST)
    collector = make_collector(cfg, generator)
    batches = []
    async with asyncio.timeout(60):
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(collector.run())
            for step in range(n):
                batch = await collector.next_batch(step, 30.0)
                assert batch is not None
                batches.append(batch)
                collector.step_trained()
                generator.version = step + 1  # the step's weights are served
                collector.weights_published()
            collector.stop()
    return collector, [g for batch in batches for g in batch]


def test_an_environment_that_raises_fails_its_rollout_counted_and_the_survivors_are_scored():
    collector, groups = asyncio.run(first_batches(env_recipe("Counting", group_size=3), 3))
    for group in groups:
        assert group.failed_rollouts == 1 and len(group.rollouts) == 2  # member 1 raised; members 0 and 2 were scored
        for rollout in group.rollouts:
            episode = rollout.completion.episode
            assert episode is not None and episode.turns == 2 and episode.stop_reason == "done"
            assert rollout.reward == 2.0 and rollout.reward_terms == {"env": 2.0}
    # Each error is counted once, as an environment error and as a failed rollout (an episode that raised only
    # after the stop cancelled it is neither: cancellation is not a failure).
    raised = sum(e.raised for e in envs.Counting.instances)
    assert collector.counters["env/errors_total"] == collector.counters["rollout/failed_total"]
    assert len(groups) <= collector.counters["env/errors_total"] <= raised
    assert all(e.closed == 1 for e in envs.Counting.instances)  # closed after an error too


def test_a_transient_environment_error_is_retried_as_a_new_episode():
    collector, groups = asyncio.run(first_batches(env_recipe("Transient"), 1))
    assert collector.counters["env/errors_total"] == 1 and collector.counters["rollout/retries_total"] == 1
    assert collector.counters["rollout/failed_total"] == 0
    assert groups[0].failed_rollouts == 0


def test_an_episode_records_model_tokens_as_sampled_and_environment_tokens_masked():
    cfg = env_recipe("AsyncEcho", max_turns=3, max_tokens=10_000)
    collector, groups = asyncio.run(first_batches(cfg, 1))
    completion = groups[0].rollouts[0].completion
    episode = completion.episode
    assert episode is not None and episode.turns == 3 and episode.stop_reason == "max_turns"
    mask = completion.loss_mask
    assert mask is not None and sum(mask) == 3 * FAST.tokens == completion.model_tokens
    model_ids = [t for t, m in zip(completion.token_ids, mask) if m]
    assert model_ids == list(range(4, 4 + FAST.tokens)) * 3  # exactly as sampled, turn by turn
    assert all(lp == 0.0 for lp, m in zip(completion.logprobs, mask) if not m)
    assert [m["role"] for m in episode.messages] == ["assistant", "user", "assistant", "user", "assistant", "user"]
    # The reset observation joined the prompt (re-rendered with it); the turns' prompts grew by exactly what was used.
    assert completion.prompt_token_ids is not None and len(completion.prompt_token_ids) > len(groups[0].prompt.token_ids)
    # The fake's ids are not the encoding of its text: the ids stay as sampled (above), and the simulator's codec
    # does not count that as drift (tests/unit/test_conversation.py counts it with a real tokenizer).
    assert episode.drift_turns == 0 and collector.counters["env/retokenization_drift_total"] == 0
    assert collector.counters["rollout/generated_tokens_total"] >= sum(mask)


def test_max_tokens_caps_the_whole_episode():
    cfg = env_recipe("AsyncEcho", max_turns=50, max_tokens=40)
    _, groups = asyncio.run(first_batches(cfg, 1))
    for rollout in groups[0].rollouts:
        completion = rollout.completion
        assert completion.episode is not None and completion.episode.stop_reason == "max_tokens"
        assert len(completion.token_ids) <= 40
        assert completion.truncated
