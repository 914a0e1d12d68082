"""The Ray generator sends every call of a session to one actor (generation/ray_pool.py, "Dispatch").

Over stand-in actors (no cluster: `RayGenerator`'s dispatch with actor handles whose `generate.remote` answers at
once, or holds a request open until released): a session's next call stays on its actor even when another actor is
less busy, and a session whose actor cannot take work moves to another, counted in `session_moves`, and stays there.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from asyncgrpo.config import validate_config
from asyncgrpo.generation.ray_pool import RayGenerator, _Actor
from asyncgrpo.types import Affinity, Completion, GenerationRequest, SamplingParams


class StandInHandle:
    """An actor handle whose `generate.remote(request, version)` is an awaitable answer; it records which actor got
    which request, and holds a request whose id starts with "hold" until `release` is set."""

    def __init__(self, name: str, calls: list[tuple[str, str]], release: asyncio.Event) -> None:
        async def answer(request: GenerationRequest, version: int) -> Completion:
            calls.append((request.request_id, name))
            if request.request_id.startswith("hold"):
                await release.wait()
            return Completion(token_ids=(1,), logprobs=(0.0,), versions=(version,), finish_reason="stop", dispatch_version=version)

        self.generate = SimpleNamespace(remote=answer)


def request(request_id: str, session: Affinity | None = None) -> GenerationRequest:
    return GenerationRequest(request_id, 0, (1, 2), SamplingParams(max_new_tokens=1), seed=0, affinity=session)


def test_a_session_stays_on_its_actor_when_another_is_less_busy_and_moves_once_when_its_actor_cannot_take_work():
    calls: list[tuple[str, str]] = []
    cfg = validate_config({"data": {"source": "builtin:repeat_letter"}, "reward": {"functions": ["builtin:repeat_letter"]},
                           "runtime": "ray"})
    generator = RayGenerator(cfg, model=None, tokenizer=None)
    session = Affinity("agent-0")

    async def main() -> None:
        release = asyncio.Event()
        generator._actors = [_Actor(f"actor-{i}", StandInHandle(f"actor-{i}", calls, release), version=0) for i in range(2)]
        generator._started = True
        await generator.generate(request("turn-1", session))  # both idle: the first actor
        held = asyncio.create_task(generator.generate(request("hold")))  # a tie again: the first actor, now busier
        await asyncio.sleep(0)
        await generator.generate(request("turn-2", session))  # the least busy is actor-1; the session's is actor-0
        generator._actors[0].state = "lost"  # restarting: takes no work
        await generator.generate(request("turn-3", session))
        generator._actors[0].state = "ready"
        await generator.generate(request("turn-4", session))  # pinned to where it moved
        release.set()
        await held

    asyncio.run(main())
    actor_of = dict(calls)
    assert actor_of["hold"] == "actor-0"
    assert [actor_of[f"turn-{i}"] for i in range(1, 5)] == ["actor-0", "actor-0", "actor-1", "actor-1"]
    assert generator.counters["session_moves"] == 1
