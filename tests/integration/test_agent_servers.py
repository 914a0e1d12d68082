"""Agent sessions over `generation.backend: http` with two servers (in-process fakes): every call of a session goes to
the server of its first call, sessions spread over the servers, and a session whose server dies moves to another.

The agents (tests.agents.takes_turns) mark their conversations, so each request a server saw is known by its session;
their later calls are made one at a time, each alone at the pool, where the least-loaded choice alone would always
pick the first server.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from asyncgrpo.environments.conversation import CharCodec
from asyncgrpo.generation.http import HttpGenerator
from tests import agents
from tests.integration.servers import FakeServer, until
from tests.sim.fakes import make_collector, recipe

pytestmark = pytest.mark.timeout(120)

CODEC = CharCodec()


@pytest.fixture(autouse=True)
def fresh_agents():
    agents.reset_all()


def http_agents(urls: list[str], sessions: int):
    """One group of `sessions` takes_turns agents at a time (max_staleness 0: no second group before the first is trained)."""
    return recipe(
        env={"factory": "agent:tests.agents:takes_turns", "max_turns": 3, "cancel_grace_s": 2.0, "step_timeout_s": 30.0},
        reward={"functions": []},
        generation={"backend": "http", "max_inflight": sessions, "health_probe_interval_s": 0.2, "retry_backoff_s": 0.05,
                    "retry_backoff_max_s": 0.5, "http": {"base_urls": urls, "startup_timeout_s": 30.0}},
        rollout={"group_size": sessions, "groups_per_step": 1, "max_staleness": 0, "min_group_survivors": sessions},
    )


def sessions_seen(fake: FakeServer) -> list[str]:
    """The session (its marker) of each completion request `fake` saw, in order."""
    def marker(prompt: list[int]) -> str:
        found = [m for m in agents.MARKERS if _contains(prompt, list(CODEC.encode(m + "\n")))]
        assert len(found) == 1, found
        return found[0]

    return [marker(body["prompt"]) for body in fake.requests]


def _contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))


async def first_calls_held(fakes: list[FakeServer], each: int) -> None:
    """Hold every server's completions until each holds `each` (sessions' first calls spread while others are open)."""
    await until(lambda: all(f.started >= each for f in fakes), 30.0, f"each server holding {each} first calls")


def resume(fake: FakeServer) -> None:
    fake.paused = False
    fake.thaw()  # wakes its held requests, which see it no longer paused


async def play(sessions: int, between) -> tuple[list[FakeServer], HttpGenerator, list]:
    """One group of `sessions` agents against two paused fakes; `between(fakes)` runs once each fake holds its share of
    first calls, and must resume them. The group's rollouts, once trained."""
    fakes = [await FakeServer().start() for _ in range(2)]
    for fake in fakes:
        fake.paused, fake.finish_reason = True, "stop"
    cfg = http_agents([f.url for f in fakes], sessions)
    generator = HttpGenerator(cfg.generation)
    await generator.start()
    collector = make_collector(cfg, generator)
    try:
        async with asyncio.timeout(90):
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(collector.run())
                await first_calls_held(fakes, sessions // 2)
                await between(fakes)
                batch = await collector.next_batch(0, 60.0)
                collector.stop()
    finally:
        await generator.aclose()
        for fake in fakes:
            await fake.stop()
    return fakes, generator, batch[0].rollouts


def test_every_call_of_an_agent_session_goes_to_the_server_of_its_first_call_and_sessions_spread():
    async def between(fakes):
        for fake in fakes:
            resume(fake)

    fakes, generator, rollouts = asyncio.run(play(4, between))
    assert len(rollouts) == 4 and all(r.completion.episode.turns == 3 for r in rollouts)
    seen = [sessions_seen(fake) for fake in fakes]
    assert sorted(len(set(markers)) for markers in seen) == [2, 2]  # two sessions on each server
    assert set(seen[0]).isdisjoint(seen[1])  # no session on both
    assert sorted(seen[0] + seen[1]) == sorted(agents.MARKERS * 3)  # each session's three calls
    assert generator.counters["session_moves"] == 0


def test_a_session_whose_server_dies_moves_to_another_and_its_episode_ends_well(caplog):
    caplog.set_level(logging.INFO, logger="asyncgrpo")

    async def between(fakes):
        async with agents.one_at_a_time:  # the agents' later calls wait until the second server is gone
            for fake in fakes:
                resume(fake)
            await until(lambda: agents.CALLS["takes_turns/first"] == 2, 30.0, "both first calls answered")
            await fakes[1].stop()

    fakes, generator, rollouts = asyncio.run(play(2, between))
    assert len(rollouts) == 2 and all(r.completion.episode.turns == 3 for r in rollouts)
    first, second = (sessions_seen(fake) for fake in fakes)
    assert len(second) == 1 and first.count(second[0]) == 2  # its first call on the dead server, the next two on the other
    assert len(set(first)) == 2 and len(first) == 5
    assert generator.counters["session_moves"] == 1
    moved = [r.getMessage() for r in caplog.records if "moved to" in r.getMessage()]
    assert len(moved) == 1 and f"moved to {fakes[0].url}" in moved[0] and f"{fakes[1].url}: unreachable" in moved[0], moved
