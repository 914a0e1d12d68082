"""Agents for the gateway's tests (env.factory: agent:tests.agents:<name>), written against the real openai client.

`CALLS` counts each agent's model calls that were answered; `REFUSED` collects the status codes of the calls the gateway refused;
`STUBBORN_CALLS` counts the calls a stubborn agent makes after its cancellation; `release` lets stubborn agents end;
`MARKERS` lists the markers of the `takes_turns` agents' conversations, `one_at_a_time` makes their later turns wait for
each other.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import openai

CALLS: Counter[str] = Counter()
REFUSED: list[int] = []
STUBBORN_CALLS: list[str] = []
STARTED: list[str] = []
release = asyncio.Event()
refused_four_times = asyncio.Event()  # set when stubborn agents have seen 4 errors or cancellations (replaced per test)
CANCELLED: list[str] = []  # the prompts of the agents whose task was cancelled
MARKERS: list[str] = []
one_at_a_time = asyncio.Lock()


def reset_all() -> None:
    global refused_four_times, one_at_a_time
    refused_four_times = asyncio.Event()
    one_at_a_time = asyncio.Lock()
    MARKERS.clear()
    CALLS.clear()
    REFUSED.clear()
    STUBBORN_CALLS.clear()
    STARTED.clear()
    CANCELLED.clear()
    release.clear()


def _question(row) -> str:
    prompt = row["prompt"]
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


async def one_turn(client: openai.AsyncOpenAI, row) -> float:
    """One model call; its reward is the length of the answer's text."""
    response = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": _question(row)}])
    CALLS["one_turn"] += 1
    return float(len(response.choices[0].message.content or ""))


async def two_turns(client: openai.AsyncOpenAI, row) -> dict:
    """Two model calls with a user message between them; a dict return with info. Its cancellation is recorded in CANCELLED."""
    messages = [{"role": "user", "content": _question(row)}]
    first = await client.chat.completions.create(model="policy", messages=messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "again"}]
    try:
        await client.chat.completions.create(model="policy", messages=messages)
    except asyncio.CancelledError:
        CANCELLED.append(_question(row))
        raise
    CALLS["two_turns"] += 1
    return {"reward": 1.0, "turns": 2}


async def never_calls(client: openai.AsyncOpenAI, row) -> float:
    return 1.0


async def sleeps(client: openai.AsyncOpenAI, row) -> float:
    """Neither calls the model nor returns (until cancelled)."""
    await asyncio.Event().wait()
    return 1.0


async def raises(client: openai.AsyncOpenAI, row) -> float:
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    raise ValueError("the agent's own bug")


async def bad_return(client: openai.AsyncOpenAI, row) -> str:
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    return "yes"


async def over_turns(client: openai.AsyncOpenAI, row) -> float:
    """Calls until the gateway refuses (the turn limit), then returns a reward."""
    messages = [{"role": "user", "content": "hi"}]
    while True:
        try:
            response = await client.chat.completions.create(model="policy", messages=messages)
        except openai.BadRequestError as error:
            REFUSED.append(error.status_code)
            return 0.5
        messages += [{"role": "assistant", "content": response.choices[0].message.content}, {"role": "user", "content": "more"}]


async def malformed_then_good(client: openai.AsyncOpenAI, row) -> float:
    """A malformed request (a message without a role), refused; then a good one."""
    try:
        await client.chat.completions.create(model="policy", messages=[{"content": "no role"}])  # type: ignore[list-item,typeddict-item]
    except openai.BadRequestError as error:
        REFUSED.append(error.status_code)
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    return 1.0


async def forever(client: openai.AsyncOpenAI, row) -> float:
    """Keeps calling the model (one turn at a time, growing the conversation) until it is cancelled."""
    STARTED.append(row["prompt"] if isinstance(row["prompt"], str) else "chat")
    messages = [{"role": "user", "content": "go"}]
    while True:
        response = await client.chat.completions.create(model="policy", messages=messages)
        CALLS["forever"] += 1
        messages += [{"role": "assistant", "content": response.choices[0].message.content}, {"role": "user", "content": "go"}]


async def stubborn(client: openai.AsyncOpenAI, row) -> float:
    """Ignores its cancellation and every error, and keeps calling (a call every 0.05 s after an error) until `release` is set."""
    messages = [{"role": "user", "content": "go"}]
    STARTED.append("stubborn")
    while not release.is_set():
        try:
            response = await client.chat.completions.create(model="policy", messages=messages)
            messages += [{"role": "assistant", "content": response.choices[0].message.content}, {"role": "user", "content": "go"}]
        except asyncio.CancelledError:
            STUBBORN_CALLS.append("cancelled")
        except (openai.APIError, RuntimeError) as error:  # RuntimeError: its client was closed under it (it goes on regardless)
            STUBBORN_CALLS.append(type(error).__name__)
            await asyncio.sleep(0.05)
        if len(STUBBORN_CALLS) >= 4:
            refused_four_times.set()
    return 0.0


CALCULATOR = {"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an integer expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}}


async def tool_user(client: openai.AsyncOpenAI, row) -> float:
    """Asks with tools, runs every tool call it gets, and answers: the OpenAI tool loop."""
    messages: list = [{"role": "user", "content": _question(row)}]
    for _ in range(3):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return 1.0
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(len(arguments.get("expression", "")))})
    return 0.0


async def takes_turns(client: openai.AsyncOpenAI, row) -> float:
    """Three calls in one conversation, marked " #<n>" (n: the agents started before it); the second and third are made
    while no other `takes_turns` agent makes one (`one_at_a_time`), so each is alone at its server pool."""
    marker = f" #{len(MARKERS)}"
    MARKERS.append(marker)
    messages = [{"role": "user", "content": _question(row) + marker}]
    response = await client.chat.completions.create(model="policy", messages=messages)
    CALLS["takes_turns/first"] += 1
    async with one_at_a_time:
        for _ in range(2):
            messages += [{"role": "assistant", "content": response.choices[0].message.content}, {"role": "user", "content": "more"}]
            response = await client.chat.completions.create(model="policy", messages=messages)
    CALLS["takes_turns"] += 1
    return 1.0
