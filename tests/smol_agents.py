"""An agent written with Hugging Face's smolagents (a test dependency), unmodified but for where its model lives: the
gateway's session (env.factory: agent:tests.smol_agents:calculator). smolagents is synchronous, so the agent runs on a
thread; the session's base URL and key are all it takes from the client asyncgrpo hands it. smolagents rewrites its
history (a tool call goes back as text, its result as a user "Observation"), so it needs env.agent_history: split."""

from __future__ import annotations

import asyncio

from smolagents import OpenAIServerModel, ToolCallingAgent, tool


@tool
def calculate(expression: str) -> str:
    """Evaluate a product of two integers.

    Args:
        expression: two integers joined by '*', e.g. 2*3.
    """
    left, right = expression.split("*")
    return str(int(left) * int(right))


def _run(base_url: str, api_key: str, task: str) -> object:
    model = OpenAIServerModel(model_id="policy", api_base=base_url, api_key=api_key)
    try:
        return ToolCallingAgent(tools=[calculate], model=model, max_steps=3, verbosity_level=0).run(task)
    finally:
        model.client.close()


async def calculator(client, row) -> float:
    answer = await asyncio.to_thread(_run, str(client.base_url), client.api_key, row["prompt"])
    return 1.0 if str(answer).strip() == "6" else 0.0
