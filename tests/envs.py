"""Environments for the tests, named by `env.factory` as tests.envs:<Class>.

Each class keeps its instances (`instances`) so a test can look at what every episode did; a test
calls `reset_all()` first. `STARTED` is released once per step that began, so a test can wait
for N episodes to be inside `step` (with a deadline) without polling.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import Any

from asyncgrpo.environments.protocol import CancelToken, TransientEnvironmentError

STARTED = threading.Semaphore(0)


class _Recorded:
    instances: list[Any]

    def __init__(self) -> None:
        type(self).instances.append(self)
        self.closed = 0
        self.steps = 0
        self.raised = False

    def close(self) -> None:
        self.closed += 1


class Cooperative(_Recorded):
    """Its first step counts (a side effect) until its token is cancelled; then it returns."""

    instances: list[Any] = []

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.returned = threading.Event()

    def reset(self, row: dict[str, Any]) -> str:
        return "count"

    def step(self, action_text: str, token: CancelToken) -> tuple[Any, float | None, bool, dict[str, Any]]:
        STARTED.release()
        try:
            while not token.cancelled:
                self.count += 1
                token.wait(0.001)
        finally:
            self.returned.set()
        return None, 1.0, True, {}


class Stubborn(_Recorded):
    """Its step ignores the token and close(), and blocks until the test sets `release`."""

    instances: list[Any] = []
    release = threading.Event()

    def reset(self, row: dict[str, Any]) -> None:
        return None

    def step(self, action_text: str) -> tuple[Any, float | None, bool, dict[str, Any]]:
        STARTED.release()
        Stubborn.release.wait(60)
        return None, 1.0, True, {}


class Counting(_Recorded):
    """Two turns: the reward is the number of the model's turns; member 1 of each group raises in its first step."""

    instances: list[Any] = []

    def reset(self, row: dict[str, Any]) -> dict[str, str]:
        return {"role": "user", "content": "say something"}

    def step(self, action_text: str) -> tuple[Any, float | None, bool, dict[str, Any]]:
        self.steps += 1
        if action_text.endswith("-1-t0"):  # ProgrammedGenerator's text is the request id: member 1, turn 0
            self.raised = True
            raise RuntimeError("the tool crashed")
        return "again", 1.0, self.steps >= 2, {"step": self.steps}


class Transient(_Recorded):
    """The first reset of all fails with a transient error; every other episode plays one turn."""

    instances: list[Any] = []
    resets = itertools.count()

    def reset(self, row: dict[str, Any]) -> None:
        if next(Transient.resets) == 0:
            raise TransientEnvironmentError("the sandbox is not up yet")

    def step(self, action_text: str) -> tuple[Any, float | None, bool, dict[str, Any]]:
        return None, 1.0, True, {}


class AsyncEcho(_Recorded):
    """Async methods: echoes the action back as the observation; the reward is 1.0 if the action holds an 'a'."""

    instances: list[Any] = []

    async def reset(self, row: dict[str, Any]) -> str:
        return "echo:"

    async def step(self, action_text: str, token: CancelToken) -> tuple[Any, float | None, bool, dict[str, Any]]:
        await asyncio.sleep(0)
        self.steps += 1
        return action_text[-8:], float("a" in action_text), False, {}


class Flooding(_Recorded):
    """Each step answers with an observation of 2 million characters (an environment that dumps a whole log)."""

    instances: list[Any] = []

    def reset(self, row: dict[str, Any]) -> None:
        return None

    def step(self, action_text: str) -> tuple[Any, float | None, bool, dict[str, Any]]:
        self.steps += 1
        return "x" * 2_000_000, 1.0, False, {}


class FloodingReset(Flooding):
    """Its first observation is 2 million characters."""

    instances: list[Any] = []

    def reset(self, row: dict[str, Any]) -> str:
        return "x" * 2_000_000


class NanForPromptZero(_Recorded):
    """One turn; the reward is NaN in the episodes of prompt 0 (the ProgrammedGenerator's text starts with the prompt id)."""

    instances: list[Any] = []

    def reset(self, row: dict[str, Any]) -> None:
        return None

    def step(self, action_text: str) -> tuple[Any, float | None, bool, dict[str, Any]]:
        return None, float("nan") if action_text.startswith("0-") else 1.0, True, {}


class Overflowing(_Recorded):
    """Two turns of reward 1e308 each: finite steps whose sum is not."""

    instances: list[Any] = []

    def reset(self, row: dict[str, Any]) -> None:
        return None

    def step(self, action_text: str) -> tuple[Any, float | None, bool, dict[str, Any]]:
        self.steps += 1
        return "more", 1e308, self.steps >= 2, {}


class Exits(_Recorded):
    """Its step calls sys.exit (a library that exits on a bad input)."""

    instances: list[Any] = []

    def reset(self, row: dict[str, Any]) -> None:
        return None

    def step(self, action_text: str) -> tuple[Any, float | None, bool, dict[str, Any]]:
        raise SystemExit(0)


class CloseRaises(Cooperative):
    """Cooperative, and its close() raises every time."""

    instances: list[Any] = []

    def close(self) -> None:
        super().close()
        raise RuntimeError("close broke")


class SleepsOnTheLoop(_Recorded):
    """An async step that calls time.sleep: the pipeline's event loop, which runs async environment methods, stops turning
    for an hour (only a signal and the shutdown timer end the run)."""

    instances: list[Any] = []

    async def reset(self, row: dict[str, Any]) -> None:
        return None

    async def step(self, action_text: str) -> tuple[Any, float | None, bool, dict[str, Any]]:
        time.sleep(3600)
        return None, 1.0, True, {}


def reset_all() -> None:
    for cls in (Cooperative, Stubborn, Counting, Transient, AsyncEcho, SlowToMake, Flooding, FloodingReset, NanForPromptZero,
                Overflowing, Exits, CloseRaises):
        cls.instances = []
    Transient.resets = itertools.count()
    Stubborn.release = threading.Event()
    while STARTED.acquire(blocking=False):
        pass


class SlowToMake(_Recorded):
    """Its constructor takes a moment (a sandbox starting): a cancel during it must still close what it makes."""

    instances: list[Any] = []

    def __init__(self) -> None:
        STARTED.release()
        time.sleep(0.05)
        super().__init__()

    def reset(self, row: dict[str, Any]) -> None:
        return None

    def step(self, action_text: str) -> tuple[Any, float | None, bool, dict[str, Any]]:
        return None, None, True, {}
