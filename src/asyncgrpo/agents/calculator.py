"""The calculator as an agent written against the OpenAI client (`env.factory: agent:asyncgrpo.agents.calculator:agent`).

Job: play one `builtin:calculator` question as a chat: ask the model, run the calculator on each
turn that calls it, send the result back as a `tool` message, and return the environment's reward
when the model answers. The rules and rewards are the calculator environment's
(environments/calculator.py, reused, not restated): a turn starting with ``=`` is a call, any other
turn the answer.

The model calls the tool in text, not through `tools=[...]`: builtin:tiny's chat template renders
no tools and its alphabet has no ``<``, ``{`` or ``"`` for a ``<tool_call>`` block (docs/agents.md).

Invariants: the agent's reward is the sum of the environment's step rewards so far when the episode
ends, whether the model answered or the gateway refused a further turn (env.max_turns, env.max_tokens:
the refusal is the agent's signal that the episode is over).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import openai

from asyncgrpo.environments.calculator import CalculatorEnv

LIMITS = ("turn_limit", "context_length_exceeded")  # the gateway's refusals at env.max_turns and env.max_tokens (agents/wire.py)


async def agent(client: openai.AsyncOpenAI, row: Mapping[str, Any]) -> dict[str, Any]:
    env = CalculatorEnv()
    env.reset(row)
    prompt = row["prompt"]  # builtin:calculator's prompts are chat messages; a text prompt is one user message
    messages: list[Any] = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    reward = 0.0
    info: dict[str, Any] = {}
    while True:
        try:
            response = await client.chat.completions.create(model="policy", messages=messages)
        except openai.BadRequestError as error:
            if error.code not in LIMITS:
                raise
            return {"reward": reward, **info}  # a limit of the episode (turns or tokens): it ends with the reward so far
        text = response.choices[0].message.content or ""
        observation, step_reward, done, step_info = env.step(text)
        reward += step_reward
        info |= step_info
        if done:
            return {"reward": reward, **info}
        messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": observation}]
