"""Two tiny environments in OpenEnv 0.10's shape, written for asyncgrpo's tests (needs `openenv`; no Docker, no network).

- `TinyEchoEnv`, an MCP environment (like OpenEnv's echo env): tools `echo(message)` and
  `add(a, b)`; echoing "bye" ends the episode with reward 1.0, any other echo scores 0.0.
- `TinyTextEnv`, a plain environment whose action has one string field: it answers
  "heard <text>" with reward len(text); "bye" ends the episode; "slow" ticks into the file
  named by $TINY_OPENENV_TICKS for `SLOW_S` seconds before answering (a step that outlives a
  cancellation grace).

`app` serves `TinyTextEnv` (python -m uvicorn tests.tiny_openenv:app).
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State

SLOW_S = 60.0  # far longer than any test waits: a cancelled step is still running when the test looks (the server is killed at teardown)


class TinyEchoEnv(MCPEnvironment):
    def __init__(self) -> None:
        mcp = FastMCP("tiny_echo")

        @mcp.tool
        def echo(message: str) -> str:
            """Say the message back."""
            return message

        @mcp.tool
        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        super().__init__(mcp)
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        return Observation(done=False, reward=None, metadata={})

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        self._state.step_count += 1
        observation = super().step(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction) and isinstance(observation, CallToolObservation) and action.tool_name == "echo":
            said = action.arguments.get("message")
            observation.reward = 1.0 if said == "bye" else 0.0
            observation.done = said == "bye"
        return observation

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=None, metadata={"error": f"unknown action {type(action).__name__}"})

    @property
    def state(self) -> State:
        return self._state


class TextAction(Action):
    text: str


class TextObservation(Observation):
    heard: str = ""


class TinyTextEnv(Environment[TextAction, TextObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> TextObservation:
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        return TextObservation(heard="ready", done=False, reward=None)

    def step(self, action: TextAction, timeout_s: float | None = None, **kwargs: Any) -> TextObservation:
        self._state.step_count += 1
        if action.text == "slow":
            deadline = time.monotonic() + SLOW_S
            with open(os.environ["TINY_OPENENV_TICKS"], "a") as out:
                while time.monotonic() < deadline:
                    out.write("tick\n")
                    out.flush()
                    time.sleep(0.01)
        return TextObservation(heard=f"heard {action.text}", done=action.text == "bye", reward=float(len(action.text)))

    @property
    def state(self) -> State:
        return self._state


app = create_app(TinyTextEnv, TextAction, TextObservation, env_name="tiny_text", max_concurrent_envs=4)
