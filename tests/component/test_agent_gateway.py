"""Agents through the gateway (agents/) in the collector, on a real event loop with the real openai client over 127.0.0.1.

The generator is a fake that answers at once with a text the test scripts (tests/agent_runs.py); episodes are tokenized
one id per character (CharCodec, the simulator's codec), so the samples' ids can be checked against their text.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests import agents
from tests.agent_runs import CODEC, TextGenerator, first_batch, run_until, train_until_stale
from tests.sim.fakes import make_collector, recipe


def agent_recipe(agent: str, *, rollout: dict | None = None, inflight: int = 4, **env: object):
    return recipe(
        env={"factory": f"agent:tests.agents:{agent}", "cancel_grace_s": 2.0, "max_turns": 3, "step_timeout_s": 30.0, **env},
        reward={"functions": []},
        generation={"max_inflight": inflight},
        rollout={"group_size": 2, "groups_per_step": 1, "min_group_survivors": 2, **(rollout or {})},
    )


@pytest.fixture(autouse=True)
def fresh_agents():
    agents.reset_all()
    yield
    agents.release.set()


def test_an_agent_episode_is_trained_on_the_sampled_ids_with_the_agents_additions_masked():
    generator = TextGenerator(lambda request: "abc")
    collector, batch = asyncio.run(first_batch(agent_recipe("two_turns"), generator))
    rollout = batch[0].rollouts[0]
    completion = rollout.completion
    episode = completion.episode
    assert episode is not None and episode.turns == 2 and episode.env_reward == 1.0 and episode.info == ({"turns": 2},)
    assert rollout.reward == 1.0
    # The prompt is the agent's first request rendered by the template; the model's ids are exactly as sampled (mask 1),
    # the agent's "again" message is the template's delta (mask 0).
    assert completion.prompt_token_ids == CODEC.encode(f"user: {batch[0].prompt.text}\nassistant: ")
    sampled = CODEC.encode("abc")
    between = CODEC.encode("user: again\nassistant: ")
    assert completion.token_ids == sampled + between + sampled
    assert completion.loss_mask == (True,) * 3 + (False,) * len(between) + (True,) * 3
    assert completion.logprobs == (-0.5,) * 3 + (0.0,) * len(between) + (-0.5,) * 3
    # The second turn's request continued the ids of the first, never re-rendered what the model sampled.
    second = next(r for r in generator.requests if r.request_id.endswith("-t1"))
    first = next(r for r in generator.requests if r.request_id == second.request_id.removesuffix("-t1") + "-t0")
    assert second.prompt_token_ids == first.prompt_token_ids + sampled + between
    assert [dict(m) for m in episode.messages] == [{"role": "assistant", "content": "abc"}, {"role": "user", "content": "again"},
                                                   {"role": "assistant", "content": "abc"}]
    assert collector.counters["env/errors_total"] == 0 and agents.CALLS["two_turns"] >= 2


def test_tool_calls_come_back_parsed_and_the_tool_results_are_masked_out():
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "2*3"}}</tool_call>'
    generator = TextGenerator(lambda request: call if request.request_id.endswith("-t0") else "6")
    collector, batch = asyncio.run(first_batch(agent_recipe("tool_user"), generator))
    completion = batch[0].rollouts[0].completion
    assert completion.episode is not None and completion.episode.env_reward == 1.0
    messages = [dict(m) for m in completion.episode.messages]
    assert messages[0]["tool_calls"] == [{"type": "function", "function": {"name": "calculate", "arguments": {"expression": "2*3"}}}]
    assert messages[1] == {"role": "tool", "content": "3", "tool_call_id": "call_1_0"}
    tool_delta = CODEC.encode("tool: 3\nassistant: ")
    assert completion.token_ids == CODEC.encode(call) + tool_delta + CODEC.encode("6")
    # The first request's tools are rendered into the prompt by the template.
    assert generator.requests[0].prompt_token_ids[: len(CODEC.encode("tools: calculate\n"))] == CODEC.encode("tools: calculate\n")
    assert collector.counters["agent/unparsed_tool_calls_total"] == 0


def test_an_unparseable_tool_call_is_returned_as_text_and_counted():
    generator = TextGenerator(lambda request: "<tool_call>{not json</tool_call>")
    collector, batch = asyncio.run(first_batch(agent_recipe("tool_user"), generator))
    assert batch[0].rollouts[0].completion.episode.messages[0]["content"] == "<tool_call>{not json</tool_call>"
    assert collector.counters["agent/unparsed_tool_calls_total"] >= 2  # each episode's turn


@pytest.mark.parametrize(("agent", "counter", "words", "step_timeout_s"), [
    ("never_calls", "agent/failed/no_model_call", "without a model call", 30.0),
    ("raises", "agent/failed/raised", "raised ValueError: the agent's own bug", 30.0),
    ("bad_return", "agent/failed/bad_return", "returned 'yes'", 30.0),
    ("sleeps", "agent/failed/timeout", "neither called the model nor returned within env.step_timeout_s = 0.2 s", 0.2),
])
def test_bad_endings_fail_the_rollout_counted_and_named(agent, counter, words, step_timeout_s, caplog):
    caplog.set_level(logging.WARNING, logger="asyncgrpo")
    collector = make_collector(agent_recipe(agent, step_timeout_s=step_timeout_s), TextGenerator())
    asyncio.run(run_until(collector, lambda: collector.counters[counter] >= 2))
    assert collector.counters["env/errors_total"] >= 2 and collector.counters["rollout/failed_total"] >= 2
    logged = [r.getMessage() for r in caplog.records if counter in r.getMessage()]
    assert len(logged) == 1 and f"agent:tests.agents:{agent}" in logged[0] and words in logged[0]


def test_a_malformed_request_and_the_turn_limit_are_refused_with_errors_the_client_raises():
    collector, batch = asyncio.run(first_batch(agent_recipe("malformed_then_good"), TextGenerator()))
    assert set(agents.REFUSED) == {400} and collector.counters["agent/refused/malformed"] == len(agents.REFUSED) >= 2
    assert batch[0].rollouts[0].reward == 1.0
    agents.reset_all()
    collector, batch = asyncio.run(first_batch(agent_recipe("over_turns", max_turns=2), TextGenerator()))
    assert set(agents.REFUSED) == {400} and collector.counters["agent/refused/turn_limit"] == len(agents.REFUSED) >= 2
    episode = batch[0].rollouts[0].completion.episode
    assert episode.turns == 2 and episode.stop_reason == "max_turns" and episode.env_reward == 0.5


def agent_tasks() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("agent-")]


def test_a_stale_groups_agents_are_cancelled_with_their_request_in_flight_and_nothing_of_them_keeps_running():
    # Prompt 1's agents reach their second call, whose generation never answers; steps go on until the group is stale.
    generator = TextGenerator(hang=lambda request: request.prompt_id == 1 and request.request_id.endswith("-t1"))
    collector = make_collector(agent_recipe("two_turns", rollout={"max_requeues": 0}), generator)
    asyncio.run(train_until_stale(collector, generator))
    hung = [r for r in generator.requests if r.prompt_id == 1 and r.request_id.endswith("-t1")]
    assert len(hung) == 2 and generator.aborted >= 2  # the stale group's requests in flight were aborted
    assert agents.CANCELLED.count("say d: ") == 2  # prompt 1's agents' tasks were cancelled (their calls in flight)
    assert collector.counters["env/abandoned_total"] == 0  # each ended within the grace
    assert collector.counters["rollout/failed_total"] == 0 and collector.counters["env/errors_total"] == 0  # cancellation is no failure


def test_a_stubborn_agent_is_abandoned_counted_and_its_calls_after_the_close_are_refused(caplog):
    caplog.set_level(logging.WARNING, logger="asyncgrpo")
    generator = TextGenerator(hang=lambda request: request.request_id.endswith("-t2"), hangs_awaited=2)
    collector = make_collector(agent_recipe("stubborn", inflight=2, cancel_grace_s=0.2), generator)

    async def run():
        async with asyncio.timeout(60):
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(collector.run())
                await generator.all_hanging.wait()  # both agents of the group wait on their third call
                collector.stop()
            left = agent_tasks()
            assert len(left) == 2, "the abandoned agents are still running when the collector returns"
            await agents.refused_four_times.wait()  # the abandoned agents' calls keep failing
            agents.release.set()
            done, _ = await asyncio.wait(left, timeout=30)
            return len(done) == len(left)

    assert asyncio.run(run())
    assert collector.counters["env/abandoned_total"] == 2 and collector.counters["rollout/failed_total"] == 0
    assert agents.STUBBORN_CALLS[:2] == ["cancelled", "cancelled"]
    assert set(agents.STUBBORN_CALLS[2:]) <= {"APIStatusError", "APIConnectionError", "NotFoundError", "RuntimeError"}
    assert len(agents.STUBBORN_CALLS) > 2
    logged = [r.getMessage() for r in caplog.records if "abandoned" in r.getMessage()]
    assert len(logged) == 1 and "agent:tests.agents:stubborn" in logged[0]


def test_the_gateway_binds_127_0_0_1_and_refuses_a_key_it_does_not_hold():
    import openai

    from asyncgrpo.agents.gateway import Gateway

    async def run():
        gateway = Gateway()
        inbox = await gateway.open()
        assert inbox.base_url.startswith("http://127.0.0.1:") and inbox.key in inbox.base_url
        async with openai.AsyncOpenAI(base_url=inbox.base_url, api_key="x", max_retries=0) as client:
            try:
                assert [m.id for m in (await client.models.list()).data] == ["policy"]
                stranger = client.with_options(base_url=inbox.base_url.replace(inbox.key, "not-a-session"))
                with pytest.raises(openai.NotFoundError, match="no session 'not-a-session'"):
                    await stranger.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
            finally:
                assert await gateway.release(inbox, 5.0)
            with pytest.raises(openai.APIConnectionError):  # no session left: the port is closed
                await client.models.list()

    asyncio.run(run())


def test_a_server_stop_that_will_not_end_is_given_up_at_its_deadline_and_the_next_session_gets_a_fresh_server(monkeypatch):
    import openai
    from aiohttp import web

    from asyncgrpo.agents.gateway import Gateway

    async def run():
        gateway = Gateway()
        inbox = await gateway.open()
        stuck = gateway._runner
        never = asyncio.get_running_loop().create_future()
        cleanup = web.AppRunner.cleanup

        async def hang(runner):
            await (never if runner is stuck else cleanup(runner))

        monkeypatch.setattr(web.AppRunner, "cleanup", hang)  # the first server's stop never ends
        assert not await gateway.release(inbox, 0.2)
        assert inbox.closed
        again = await gateway.open()  # not blocked behind the stuck stop: a server of its own
        try:
            async with openai.AsyncOpenAI(base_url=again.base_url, api_key="x", max_retries=0) as client:
                assert [m.id for m in (await client.models.list()).data] == ["policy"]
        finally:
            assert await gateway.release(again, 5.0)
            await cleanup(stuck)

    asyncio.run(asyncio.wait_for(run(), 20))
