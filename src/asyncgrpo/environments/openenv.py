"""OpenEnv 0.10 environments as asyncgrpo environments (``pip install asyncgrpo[openenv]``).

Two forms of `env.factory`:

- ``openenv:pkg.module:Class``: an OpenEnv server-side `Environment` class, instantiated once
  per episode in asyncgrpo's process or, with ``env.isolation: process``, in the episode's
  worker process (the one way to stop an OpenEnv step: OpenEnv has no cancellation).
- ``openenv+ws://host:port`` (or ``openenv+http://``, ``openenv+https://``, ``openenv+wss://``):
  a running OpenEnv server, one WebSocket session per episode (`OpenEnvServerHost`). A
  cancelled episode closes its session; a step still running on the server after the grace
  is abandoned (the server finishes it: OpenEnv cannot interrupt it), and `cancel` says so.

How the model's text becomes an OpenEnv action (`ActionCodec`):

- MCP environments (tools): a tool call is ``name: argument`` on the first non-empty line, e.g.
  ``echo: hello``. The argument text fills the tool's one required parameter; for tools with
  several parameters it is a JSON object (``add: {"a": 2, "b": 3}``). The reset observation
  lists the tools in this syntax. Text that is not a call of a listed tool is the model's
  final answer: the episode ends (done, no reward from the environment).
- Plain environments whose action has one string field (besides `metadata`): the whole text
  fills it. Any other action: the text must be the action as a JSON object.
- Text that cannot become an action (bad JSON, a wrong argument) is not an environment error:
  the model sees ``error: <why>`` as the observation and the episode goes on.

Observations become one message's text: a tool call's result (or ``error: <message>``), the
tool list, or the observation's own fields (one field: its value; several: ``name: value``
lines). `reward` and `done` come from the Observation; its `metadata` is the step's info.

Invariants: importing this module does not import OpenEnv (only using it does; a missing
package is a ConfigError naming the extra); nothing here blocks the event loop (the
in-process form is a sync environment, run by the host on its thread or worker process).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
import typing
from collections.abc import Callable, Mapping
from typing import Any

from asyncgrpo.environments.protocol import EpisodeCancelled, Message, StepResult, as_messages
from asyncgrpo.errors import ConfigError
from asyncgrpo.user_modules import import_user_module

SERVER_SCHEMES = ("openenv+ws://", "openenv+wss://", "openenv+http://", "openenv+https://")
_CALL_RE = re.compile(r"\s*([A-Za-z_][\w.-]*)\s*:[ \t]*(.*)", re.S)
_RESERVED = ("done", "reward", "metadata")


def require_openenv(spec: str) -> None:
    """A ConfigError naming the extra when OpenEnv is not importable (or is the old openenv-core)."""
    try:
        from openenv.core.env_server.interfaces import Environment  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"env.factory = {spec!r} needs OpenEnv, which is not importable ({exc}). Fix: pip install 'asyncgrpo[openenv]' "
            f"(openenv 0.10.x; uninstall openenv-core first: both install a package named openenv)."
        ) from exc


def is_server_url(spec: str) -> bool:
    return isinstance(spec, str) and spec.startswith(SERVER_SCHEMES)


def openenv_factory(target: str) -> Callable[[], OpenEnvEpisode]:
    """The factory for ``openenv:<target>``: each call makes one episode of the OpenEnv class `target` names."""
    spec = f"openenv:{target}"
    require_openenv(spec)
    from openenv.core.env_server.interfaces import Environment

    module_name, _, name = target.rpartition(":")
    if not module_name or not name:
        raise ConfigError(
            f"env.factory = {spec!r} is not of the form openenv:module:Class (e.g. openenv:my_env.server:MyEnvironment); OpenEnv "
            f"environments are not on PyPI: pip install the environment's package from its git repository or folder."
        )
    module = import_user_module(module_name, "env.factory", spec)
    if not hasattr(module, name):
        raise ConfigError(f"env.factory = {spec!r}: module {module_name!r} has no attribute {name!r}. Fix: name the Environment class.")
    cls = getattr(module, name)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(f"env.factory = {spec!r}: {name} is not a subclass of OpenEnv's Environment (openenv.core.env_server.interfaces).")
    return functools.partial(OpenEnvEpisode, cls)


def action_class(env_cls: Any) -> Any:
    """The pydantic Action class `env_cls.step` takes: its annotation, else the Environment's first type argument."""
    from openenv.core.env_server.types import Action

    candidates: list[Any] = []
    with contextlib.suppress(Exception):
        candidates.append(typing.get_type_hints(env_cls.step).get("action"))
    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            candidates.extend(typing.get_args(base)[:1])
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, Action) and candidate is not Action:
            return candidate
    return None


def _single_string_field(schema: Mapping[str, Any]) -> str | None:
    """The one string property of a JSON schema (ignoring OpenEnv's reserved fields), if it has exactly one field."""
    fields = {k: v for k, v in schema.get("properties", {}).items() if k not in _RESERVED}
    if len(fields) == 1:
        (name, prop), = fields.items()
        if prop.get("type") == "string":
            return name
    return None


class ActionCodec:
    """Turns the model's text into an OpenEnv action payload (a dict), or into the error the model sees."""

    def __init__(self, action_schema: Mapping[str, Any] | None, tools: list[Mapping[str, Any]] | None) -> None:
        self.tools = {str(t["name"]): t for t in tools or ()}
        self.text_field = None if action_schema is None else _single_string_field(action_schema)

    def tool_list(self) -> str:
        """The tools in the call syntax, for the reset observation."""
        lines = []
        for name, tool in self.tools.items():
            params = list(tool.get("input_schema", {}).get("properties", {}))
            argument = params[0] if len(params) == 1 else "{" + ", ".join(f'"{p}": ...' for p in params) + "}"
            lines.append(f"{name}: <{argument}>  {tool.get('description') or ''}".rstrip())
        return "tools (call one as 'name: argument'):\n" + "\n".join(lines)

    def parse(self, text: str) -> dict[str, Any] | str | None:
        """A payload; a string: the error to show the model; None: a final answer (MCP: the text calls no tool)."""
        if self.tools:
            match = _CALL_RE.match(text)
            if match is None or match.group(1) not in self.tools:
                return None
            name, argument = match.group(1), match.group(2).strip()
            schema = self.tools[name].get("input_schema", {})
            params = list(schema.get("properties", {}))
            if argument.startswith("{"):
                arguments = _json_object(argument)
                if isinstance(arguments, str):
                    return arguments
            elif len(params) == 1:
                arguments = {params[0]: argument}
            else:
                return f"error: {name} takes {', '.join(params) or 'no arguments'}; give them as a JSON object"
            return {"type": "call_tool", "tool_name": name, "arguments": arguments}
        if self.text_field is not None:
            return {self.text_field: text}
        return _json_object(text.strip())


def _json_object(text: str) -> dict[str, Any] | str:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"error: the action is not valid JSON ({exc.msg} at character {exc.pos})"
    return value if isinstance(value, dict) else "error: the action must be a JSON object"


def observation_text(observation: Mapping[str, Any]) -> str:
    """One message's text for an OpenEnv observation (as a dict: `model_dump()` or a server's JSON)."""
    if "tool_name" in observation and "result" in observation:  # CallToolObservation
        error = observation.get("error")
        if error:
            return f"error: {error.get('message', error) if isinstance(error, Mapping) else error}"
        result = observation.get("result")
        if isinstance(result, Mapping):
            if result.get("data") is not None:
                return str(result["data"])
            return "\n".join(str(c.get("text", "")) for c in result.get("content") or () if isinstance(c, Mapping))
        return "" if result is None else str(result)
    fields = {k: v for k, v in observation.items() if k not in _RESERVED}
    if len(fields) == 1:
        (value,) = fields.values()
        return value if isinstance(value, str) else json.dumps(value)
    return "\n".join(f"{k}: {v if isinstance(v, str) else json.dumps(v)}" for k, v in fields.items())


def _reward(value: Any) -> float | None:
    return None if value is None else float(value)


def _reset_kwargs(row: Mapping[str, Any]) -> dict[str, Any]:
    """The row's `seed` and `episode_id` columns, the arguments every OpenEnv reset takes."""
    return {k: row[k] for k in ("seed", "episode_id") if row.get(k) is not None}


class OpenEnvEpisode:
    """One episode of an in-process OpenEnv `Environment` class, in asyncgrpo's (sync) episode protocol."""

    def __init__(self, env_cls: type) -> None:
        from openenv.core.env_server.mcp_environment import MCPEnvironment

        self.env = env_cls()
        self.is_mcp = isinstance(self.env, MCPEnvironment)
        self.action_cls: Any = None if self.is_mcp else action_class(env_cls)
        if not self.is_mcp and self.action_cls is None:
            raise ConfigError(
                f"env.factory = 'openenv:{env_cls.__module__}:{env_cls.__name__}': its Action class cannot be told. Fix: annotate "
                f"step(self, action: MyAction, ...) or subclass Environment[MyAction, MyObservation, MyState]."
            )
        self.codec = ActionCodec(None if self.action_cls is None else self.action_cls.model_json_schema(), None)

    def reset(self, row: Mapping[str, Any]) -> str:
        text = observation_text(self.env.reset(**_reset_kwargs(row)).model_dump())
        if self.is_mcp:
            from openenv.core.env_server.mcp_types import ListToolsAction

            tools = self.env.step(ListToolsAction()).model_dump()["tools"]
            self.codec = ActionCodec(None, tools)
            text = f"{text}\n{self.codec.tool_list()}".strip()
        return text

    def step(self, action_text: str) -> tuple[str | None, float | None, bool, dict[str, Any]]:
        payload = self.codec.parse(action_text)
        if payload is None:
            return None, None, True, {"final_answer": True}
        if isinstance(payload, str):
            return payload, None, False, {"invalid_action": True}
        from pydantic import ValidationError

        try:
            if self.is_mcp:
                from openenv.core.env_server.mcp_types import CallToolAction

                action = CallToolAction.model_validate(payload)
            else:
                assert self.action_cls is not None
                action = self.action_cls.model_validate(payload)
        except ValidationError as exc:
            return f"error: {exc.errors()[0].get('msg', exc)}", None, False, {"invalid_action": True}
        observation = self.env.step(action)
        return observation_text(observation.model_dump()), _reward(observation.reward), bool(observation.done), dict(observation.metadata)

    def close(self) -> None:
        self.env.close()


class OpenEnvServerHost:
    """One episode on a running OpenEnv server: a WebSocket session (an `EnvironmentHost`; see the module docstring).

    The session opens at `reset`. `cancel(grace_s)` lets a step in flight finish within the
    grace, then closes the session; it returns False when a step was still running (the
    server keeps running it: abandoned, for the caller to count), True otherwise.
    """

    def __init__(self, url: str, observation_role: str) -> None:
        require_openenv(url)
        self.url = url
        self.base_url = url.removeprefix("openenv+")
        self.observation_role = observation_role
        self._client: Any = None
        self._codec = ActionCodec(None, None)
        self._in_flight: asyncio.Future[Any] | None = None
        self._cancelled = False
        self.close_error: BaseException | None = None  # a failed goodbye to the server is not the environment's error

    async def reset(self, row: Mapping[str, Any]) -> tuple[Message, ...]:
        from openenv.core.generic_client import GenericEnvClient

        self._client = GenericEnvClient(base_url=self.base_url)
        schema = await self._schema()
        result = await self._send(self._client.reset(**_reset_kwargs(row)))
        text = observation_text(result.observation)
        if "tool_name" in schema.get("properties", {}):  # an MCP environment (its action is CallToolAction)
            tools = await self._send(self._client.step({"type": "list_tools"}))
            self._codec = ActionCodec(None, tools.observation.get("tools", []))
            text = f"{text}\n{self._codec.tool_list()}".strip()
        else:
            self._codec = ActionCodec(schema, None)
        return as_messages(text, self.observation_role, source=f"{self.url} reset")

    async def step(self, action_text: str) -> StepResult:
        payload = self._codec.parse(action_text)
        if payload is None:
            return StepResult((), None, True, {"final_answer": True})
        if isinstance(payload, str):
            return StepResult(as_messages(payload, self.observation_role, source=self.url), None, False, {"invalid_action": True})
        result = await self._send(self._client.step(payload))
        messages = as_messages(observation_text(result.observation), self.observation_role, source=f"{self.url} step")
        return StepResult(messages, _reward(result.reward), bool(result.done), dict(result.observation.get("metadata") or {}))

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()

    async def cancel(self, grace_s: float) -> bool:
        self._cancelled = True
        stopped = True
        in_flight = self._in_flight
        if in_flight is not None and not in_flight.done():
            await asyncio.wait([in_flight], timeout=grace_s)
            stopped = in_flight.done()
            in_flight.cancel()
        with contextlib.suppress(Exception):  # the session is being dropped; a failed goodbye changes nothing
            await self.close()
        return stopped

    async def _send(self, call: Any) -> Any:
        """Await one request of the session; `cancel` can wait for it (shielded) while the caller is cancelled."""
        if self._cancelled or self._client is None:
            raise EpisodeCancelled(f"{self.url}: the episode was cancelled" if self._cancelled else f"{self.url}: reset first")
        in_flight = self._in_flight = asyncio.ensure_future(call)
        try:
            return await asyncio.shield(in_flight)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._cancelled and in_flight.cancelled() and not (task is not None and task.cancelling()):
                raise EpisodeCancelled(f"{self.url}: the episode was cancelled") from None
            raise

    async def _schema(self) -> dict[str, Any]:
        """The server's action schema (GET /schema), which says how text becomes an action."""
        import aiohttp

        http_url = re.sub(r"^ws", "http", self.base_url).rstrip("/")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            async with session.get(f"{http_url}/schema") as response:
                response.raise_for_status()
                body = await response.json()
        return dict(body.get("action") or {})
