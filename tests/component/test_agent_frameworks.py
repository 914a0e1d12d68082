"""An agent written with an agent framework from the package index (the OpenAI Agents SDK, `pip install 'asyncgrpo[agents-sdk]'`)
trains through the gateway: its tool call comes back parsed, the SDK runs the tool and sends the result, the episode is the
sample. Skipped where the SDK is not installed (its websockets<17 pin conflicts with the test environment's; docs/agents.md)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("agents", reason="the OpenAI Agents SDK (openai-agents) is not installed")

from tests.agent_runs import CODEC, TextGenerator, first_batch  # noqa: E402
from tests.sim.fakes import recipe  # noqa: E402


def test_an_openai_agents_sdk_agent_trains_through_the_gateway():
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "2*3"}}</tool_call>'
    generator = TextGenerator(lambda request: call if request.request_id.endswith("-t0") else "six")
    # One prompt: no episode is still running when the test stops the collector (the SDK's runner, cancelled inside a turn,
    # leaves a coroutine unawaited, which the test's warnings-as-errors would report).
    cfg = recipe(data={"builtin_size": 1, "num_epochs": 1}, reward={"functions": []},
                 env={"factory": "agent:tests.sdk_agents:calculator", "max_turns": 3, "step_timeout_s": 30.0},
                 generation={"max_inflight": 2}, rollout={"group_size": 2, "groups_per_step": 1, "min_group_survivors": 2})
    collector, batch = asyncio.run(first_batch(cfg, generator))
    rollout = batch[0].rollouts[0]
    messages = [dict(m) for m in rollout.completion.episode.messages]
    assert rollout.reward == 1.0 and rollout.completion.episode.turns == 2
    assert messages[0]["tool_calls"][0]["function"] == {"name": "calculate", "arguments": {"expression": "2*3"}}
    assert messages[1] == {"role": "tool", "content": "3", "tool_call_id": "call_1_0"}  # the SDK ran the tool
    assert messages[2] == {"role": "assistant", "content": "six"}
    # The sample's prompt holds the SDK's instructions and the tool's schema, rendered by the template.
    assert CODEC.encode("tools: calculate\n") == rollout.completion.prompt_token_ids[: len("tools: calculate\n")]
    assert collector.counters["env/errors_total"] == 0
