"""An agent written with the OpenAI Agents SDK (`openai-agents`, imported as `agents`), unmodified but for its client: the one the
gateway gives it (env.factory: agent:tests.sdk_agents:calculator)."""

from __future__ import annotations

from agents import Agent, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool


@function_tool
def calculate(expression: str) -> str:
    """Evaluate an integer expression (here: its length, which is all the test needs)."""
    return str(len(expression))


async def calculator(client, row) -> float:
    agent = Agent(name="calculator", instructions="Use the calculator, then answer.", tools=[calculate],
                  model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
    result = await Runner.run(agent, row["prompt"], max_turns=3, run_config=RunConfig(tracing_disabled=True))
    return 1.0 if result.final_output else 0.0
