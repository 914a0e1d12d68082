"""A resumed turn with an in-process Python environment on its thread host (tests/envs.py `Counting`): the environment object
survives the interruption (one instance, its steps counted on, closed once at the end) and reads the turn's whole text."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Coroutine

import pytest

from asyncgrpo.environments.conversation import CharCodec
from asyncgrpo.rollout.books import Books
from asyncgrpo.rollout.episode import EpisodeRunner
from asyncgrpo.rollout.failures import FailurePolicy
from asyncgrpo.rollout.in_flight import InFlightGroup, rollout_request
from asyncgrpo.rollout.resumption import runner_for
from asyncgrpo.rollout.stale_policy import stale_policy
from asyncgrpo.types import Completion, GenerationRequest, Prompt, SamplingParams
from tests import envs
from tests.sim.fakes import recipe

pytestmark = pytest.mark.timeout(60)
PROMPT = Prompt(0, "question", (1, 2, 3))


def test_a_thread_hosted_environment_survives_an_interrupted_turn() -> None:
    envs.reset_all()
    cfg = recipe(env={"factory": "tests.envs:Counting", "max_turns": 3, "max_tokens": 64}, rollout={"on_stale": "resume"})
    assert cfg.env is not None
    resuming = runner_for(stale_policy(cfg.rollout), Books(FailurePolicy.from_rollout(cfg.rollout)), continues_in_flight=False)
    group = InFlightGroup(key=1, prompt=PROMPT, size=1)
    seen: list[GenerationRequest] = []

    async def generate(request: GenerationRequest) -> Completion:
        seen.append(request)
        version = 1 if request.resumed_tokens else 0  # turn 1 (t0), then turn 2 (t1) cut at version 0 and resumed at version 1
        if request.request_id.endswith("-t1") and not request.resumed_tokens:
            assert request.sink is not None
            request.sink.extend((11, 12), (-0.1, -0.2), (0, 0), "ab")  # two tokens, then weights v1 are published
            asyncio.get_running_loop().call_soon(resuming.weights_published, [group], 1, 1)
            await asyncio.get_running_loop().create_future()
        return Completion((13,), (-0.3,), (version,), "stop", version, text="c" if version else "x")

    def attempts(request: GenerationRequest, g: InFlightGroup, member: int, slot: object, floor: int | None = None,
                 ) -> Coroutine[object, object, Completion]:
        g.dispatch_versions[member] = 1 if request.resumed_tokens else 0
        return generate(request)

    async def main() -> Completion:
        episodes = EpisodeRunner(cfg.env, cfg.generation, CharCodec(), Counter(), prompt_key="prompt", max_prompt_tokens=64,
                                 jitter=random.Random(0))
        turns = resuming.rollouts(attempts)
        request = rollout_request(0, PROMPT, 0, SamplingParams(max_new_tokens=8))
        task = asyncio.create_task(episodes.run(PROMPT, request, lambda turn, floor: turns(turn, group, 0, None, floor),
                                                on_retry=lambda error: None, between_attempts=asyncio.sleep))
        group.member_tasks[0] = task  # type: ignore[assignment]
        async with asyncio.timeout(30):
            return await task

    completion = asyncio.run(main())
    assert [r.request_id[-3:] for r in seen] == ["-t0", "-t1", "-t1"] and seen[2].resumed_tokens == 2
    assert group.resumptions == [1] and group.interrupts == [0]
    [env] = envs.Counting.instances  # one environment for the whole episode
    assert env.steps == 2 and env.closed == 1 and not env.raised
    episode = completion.episode
    assert episode is not None and episode.turns == 2 and episode.env_reward == 2.0 and episode.step_rewards == (1.0, 1.0)
    assert [m["content"] for m in episode.messages if m["role"] == "assistant"] == ["x", "abc"]  # the step read the whole turn
    assert completion.loss_mask is not None
    model = [(t, v) for t, v, m in zip(completion.token_ids, completion.versions, completion.loss_mask) if m]
    assert model == [(13, 0), (11, 0), (12, 0), (13, 1)]
