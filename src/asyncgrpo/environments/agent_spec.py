"""`env.factory: agent:module:function` or `agent-command:<command line>`: the agent of a run (agents/), checked before the run starts.

Job: `load_agent(spec)` imports the module and returns the `async def agent(client, row)` it names
(or an object whose `__call__` is one), or, for a command, its `AgentCommand`: the command line split
as a shell would (never run through one), whose program must be found (agents/command.py runs it).
It lives here, below agents/, so that the preflight of `env.factory` (factories.py) checks an agent
spec as it checks an environment's. Invariant: every failure is a `ConfigError` naming
`env.factory`, the value, what is wrong and the fix; the agent is never called here.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import shlex
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncgrpo.config.env import AGENT_COMMAND_PREFIX as COMMAND_PREFIX
from asyncgrpo.config.env import AGENT_PREFIX as PREFIX
from asyncgrpo.errors import ConfigError
from asyncgrpo.user_modules import import_user_module, lookup_attribute

KEY = "env.factory"


@dataclass(frozen=True)
class AgentCommand:
    """An agent that is a program: its command line, split (`argv`), and the spec that names it."""

    argv: tuple[str, ...]
    spec: str


def load_command(spec: str) -> AgentCommand:
    """The command agent of `spec` ("agent-command:<command line>"), its program found on PATH (or at its path)."""
    try:
        argv = shlex.split(spec.removeprefix(COMMAND_PREFIX))
    except ValueError as error:
        raise ConfigError(f"{KEY} = {spec!r}: its command line cannot be split ({error}). Fix: close the quotes.") from None
    if not argv:
        raise ConfigError(f"{KEY} = {spec!r} names no command. Fix: write the command after agent-command:, e.g. "
                          "agent-command:python my_agent.py.")
    if shutil.which(argv[0]) is None:
        raise ConfigError(f"{KEY} = {spec!r}: {argv[0]!r} is not an executable file on PATH or at that path (from the working directory "
                          f"{os.getcwd()}). Fix: name an installed program (e.g. python my_agent.py), or give the script's path and make "
                          "it executable.")
    return AgentCommand(tuple(argv), spec)


def load_agent(spec: str) -> Callable[..., Any] | AgentCommand:
    """The agent named by `spec` ("agent:module:function" or "agent-command:<command line>")."""
    if spec.startswith(COMMAND_PREFIX):
        return load_command(spec)
    if importlib.util.find_spec("openai") is None:
        raise ConfigError(f"{KEY} = {spec!r} names an agent, which is given an openai.AsyncOpenAI client, but the openai package is not "
                          "installed. Fix: pip install 'asyncgrpo[agents]'.")
    target = spec.removeprefix(PREFIX)
    module_name, sep, attr_path = target.rpartition(":")
    if not sep or not module_name or not attr_path:
        raise ConfigError(f"{KEY} = {spec!r} is not of the form agent:module:function, e.g. agent:my_agents:solve for "
                          "`async def solve(client, row)` in my_agents.py.")
    agent = lookup_attribute(import_user_module(module_name, KEY, spec), module_name, attr_path, KEY, spec,
                             fix=lambda _obj, _part: "name the async function that plays one episode.")
    if not (inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(getattr(agent, "__call__", None))):  # noqa: B004
        raise ConfigError(f"{KEY} = {spec!r}: {attr_path} is a {type(agent).__name__}, not an async function. Fix: define it as "
                          "`async def agent(client, row)`, taking an openai.AsyncOpenAI and the prompt's row and returning a reward "
                          "(a number, None, or a dict with 'reward').")
    return agent
