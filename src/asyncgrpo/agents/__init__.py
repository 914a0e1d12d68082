"""Agents written against the OpenAI client, trained unchanged (docs/agents.md).

`env.factory: agent:module:function` names an `async def agent(client, row)`; each episode opens a
session of the run's gateway (gateway.py), an OpenAI-compatible HTTP endpoint on 127.0.0.1 in front
of the run's generator, and runs the agent with an `openai.AsyncOpenAI` pointed at it
(episode.py). The session (session.py) keeps the exact sampled ids of each assistant turn and
builds the training sample from them; tool calls are parsed by toolcalls.py.
`env.factory: agent-command:<command line>` runs a program per episode instead (command.py), its
session's base URL and key in its environment, its reward the last line of its stdout.
"""
