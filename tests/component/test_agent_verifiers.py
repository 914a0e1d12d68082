"""A verifiers environment (the `verifiers` package, 0.3: its classic stack) trains through the gateway unchanged: its
rollout's model calls are the session's, its tool calls run by verifiers, its rubric's reward the episode's.

Skipped where verifiers is not installed: it is not in `test` (docs/agents.md says why); `make test-verifiers` builds
its own venv (.venv-verifiers) and runs this file there.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

pytest.importorskip("verifiers", reason="verifiers is not installed (pip install 'asyncgrpo[verifiers]'; make test-verifiers)")

import verifiers as vf  # noqa: E402
from datasets import Dataset  # noqa: E402

from asyncgrpo.agents.verifiers_env import verifiers_agent  # noqa: E402
from tests.agent_runs import CODEC, TextGenerator, first_batch, run_until  # noqa: E402
from tests.sim.fakes import make_collector, recipe  # noqa: E402


def correct(completion, answer, **kwargs) -> float:
    return 1.0 if completion[-1]["content"].strip() == answer else 0.0


def calculate(expression: str) -> str:
    """Evaluate an integer expression such as 56+2.

    Args:
        expression: the expression
    """
    left, right = expression.split("+")
    return str(int(left) + int(right))


def broken(completion, answer, **kwargs) -> float:
    raise ValueError("the rubric's own bug")


def dataset() -> Dataset:
    """The environment's own dataset, which verifiers requires (the run's rows come from its data.source)."""
    return Dataset.from_list([{"question": "what is 56+2?", "answer": "58"}])


single_turn = verifiers_agent(lambda: vf.SingleTurnEnv(dataset=dataset(), rubric=vf.Rubric(funcs=[correct])))
with_tools = verifiers_agent(lambda: vf.ToolEnv(dataset=dataset(), tools=[calculate], max_turns=3, rubric=vf.Rubric(funcs=[correct])))
broken_rubric = verifiers_agent(lambda: vf.SingleTurnEnv(dataset=dataset(), rubric=vf.Rubric(funcs=[broken])))


def verifiers_recipe(agent: str):
    return recipe(data={"source": "builtin:calculator", "builtin_size": 1, "num_epochs": 1}, reward={"functions": []},
                  env={"factory": f"agent:tests.component.test_agent_verifiers:{agent}", "max_turns": 3, "step_timeout_s": 30.0},
                  generation={"max_inflight": 2}, rollout={"group_size": 2, "groups_per_step": 1, "min_group_survivors": 2})


def test_a_verifiers_single_turn_environment_is_scored_by_its_rubric():
    collector, batch = asyncio.run(first_batch(verifiers_recipe("single_turn"), TextGenerator(lambda request: "58")))
    rollout = batch[0].rollouts[0]
    assert rollout.reward == 1.0 and rollout.completion.episode.turns == 1
    assert rollout.completion.token_ids == CODEC.encode("58")
    assert rollout.completion.prompt_token_ids == CODEC.encode("user: what is 56+2?\nassistant: ")
    assert collector.counters["env/errors_total"] == 0


def test_a_verifiers_tool_environment_runs_the_tool_the_model_called_and_the_result_is_masked_out():
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "56+2"}}</tool_call>'
    generator = TextGenerator(lambda request: call if request.request_id.endswith("-t0") else "58")
    collector, batch = asyncio.run(first_batch(verifiers_recipe("with_tools"), generator))
    completion = batch[0].rollouts[0].completion
    messages = [dict(m) for m in completion.episode.messages]
    assert batch[0].rollouts[0].reward == 1.0 and completion.episode.turns == 2
    assert messages[1]["role"] == "tool" and messages[1]["content"] == "58"  # verifiers ran the tool
    delta = CODEC.encode("tool: 58\nassistant: ")
    assert completion.token_ids == CODEC.encode(call) + delta + CODEC.encode("58")
    assert completion.loss_mask == (True,) * len(call) + (False,) * len(delta) + (True,) * 2
    assert completion.prompt_token_ids[: len("tools: calculate\n")] == CODEC.encode("tools: calculate\n")


def test_a_rollout_verifiers_ended_with_an_error_is_a_counted_failure_never_a_reward(caplog):
    caplog.set_level(logging.WARNING, logger="asyncgrpo")
    collector = make_collector(verifiers_recipe("broken_rubric"), TextGenerator(lambda request: "58"))
    asyncio.run(run_until(collector, lambda: collector.counters["agent/failed/raised"] >= 2))
    logged = [r.getMessage() for r in caplog.records if "agent/failed/raised" in r.getMessage()]
    assert len(logged) == 1 and "VerifiersRolloutError" in logged[0] and "the rubric's own bug" in logged[0], logged
