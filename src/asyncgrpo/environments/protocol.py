"""The episode protocol: what a multi-turn environment implements, and the token that cancels it.

A user's environment is a class (or any factory) named by `env.factory` ("module:callable"),
called with no arguments once per episode. asyncgrpo drives each instance like this:

    observation = env.reset(row)                                   # once
    observation, reward, done, info = env.step(action_text)        # once per model turn
    env.close()                                                    # always, exactly once

- Each method may be a plain function or an `async def`. Plain ones never run on the event
  loop (a host runs them on a thread it owns, or in a worker process).
- `row` is the prompt row's columns (a dict, the prompt column included).
- `action_text` is the model's completion text of that turn.
- An observation is None (nothing to add), a string (one message of role
  `env.observation_role`), one chat message `{"role": ..., "content": ...}`, or a list of them.
  The observation of `reset` follows the row's prompt messages.
- `reward` is a float or None (this step scores nothing); the episode's environment reward is
  the sum of its steps' rewards, None when every step said None.
- `done` ends the episode; `info` (a mapping, may be empty) is recorded with the episode.
- `reset` and `step` that declare a keyword parameter named `token` receive the episode's
  `CancelToken`; a long step should poll `token.cancelled` or call `token.raise_if_cancelled()`.
- Raising `TransientEnvironmentError` marks a failure worth retrying; any other exception
  fails the rollout (counted under the rollout failure policy, never a 0.0 reward).
- `close()` may be called from another thread while `step` runs (to interrupt it), and must
  be idempotent.

Invariants of this module: it imports nothing from asyncgrpo's upper layers (types.py only) and does no I/O;
`CancelToken` is safe to use from any thread, and once cancelled stays cancelled.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncgrpo.types import EpisodeStop

Message = Mapping[str, Any]
Observation = str | Message | Sequence[Message] | None

StopReason = EpisodeStop  # defined with the carriers (types.py), which record it per episode
STOP_REASONS: tuple[StopReason, ...] = ("done", "max_turns", "max_tokens", "cancelled", "env_error")


class EpisodeCancelled(Exception):
    """Raised by `CancelToken.raise_if_cancelled()` inside an environment whose episode was cancelled."""


class TransientEnvironmentError(Exception):
    """Raised by an environment for a failure that may pass if the rollout is tried again."""


class CancelToken:
    """An episode's cancellation flag, set once by asyncgrpo, read from any thread or process-local copy."""

    def __init__(self) -> None:
        self._event = threading.Event()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def cancel(self) -> None:
        self._event.set()

    def wait(self, timeout: float) -> bool:
        """Block up to `timeout` seconds for the cancellation; True if the episode is cancelled."""
        return self._event.wait(timeout)

    def raise_if_cancelled(self) -> None:
        if self._event.is_set():
            raise EpisodeCancelled("the episode was cancelled")


class Environment(Protocol):
    """What `env.factory()` returns (each method sync or async; see the module docstring)."""

    def reset(self, row: Mapping[str, Any]) -> Observation | Awaitable[Observation]: ...

    def step(self, action_text: str) -> Any: ...  # (Observation, float | None, bool, Mapping) or an awaitable of it

    def close(self) -> None | Awaitable[None]: ...


@dataclass(frozen=True)
class StepResult:
    """One environment step, normalised: the messages it adds, its reward, whether the episode is over."""

    messages: tuple[Message, ...]
    reward: float | None
    done: bool
    info: Mapping[str, Any] = field(default_factory=dict)


class EnvironmentHost(Protocol):
    """Where one episode's environment instance lives (a thread of ours, a worker process, a server session).

    `reset`, `step` and `close` are the protocol's calls, normalised (`as_messages`, `StepResult`);
    they raise what the environment raised. `cancel(grace_s)` is the one way an episode is stopped
    early: it sets the token, calls `close()` from elsewhere, waits up to `grace_s` for the
    environment's work to end, then stops it by force where the host can (a process is killed).
    It returns True when the work stopped, False when it is still running and abandoned.
    `close_error` is what the `close()` that `cancel` called raised (None: it returned, or was not
    called, or the host cannot tell); the caller counts and logs it.
    """

    close_error: BaseException | None

    async def reset(self, row: Mapping[str, Any]) -> tuple[Message, ...]: ...

    async def step(self, action_text: str) -> StepResult: ...

    async def close(self) -> None: ...

    async def cancel(self, grace_s: float) -> bool: ...


def as_messages(observation: Observation, role: str, *, source: str) -> tuple[Message, ...]:
    """An observation as a tuple of chat messages; `source` names the call for the error (e.g. "MyEnv.step")."""
    if observation is None:
        return ()
    if isinstance(observation, str):
        return ({"role": role, "content": observation},)
    if isinstance(observation, Mapping):
        observation = [observation]
    if isinstance(observation, Sequence):
        messages: tuple[Message, ...] = tuple(observation)  # type: ignore[arg-type]  # checked just below
        for message in messages:
            if not (isinstance(message, Mapping) and isinstance(message.get("role"), str) and "content" in message):
                raise TypeError(
                    f"{source} returned an observation holding {message!r}; each message must be a mapping with a "
                    "string 'role' and a 'content' (or return a plain string, or None)"
                )
        return messages
    raise TypeError(f"{source} returned an observation of type {type(observation).__name__}; return a string, a message, a list of messages, or None")


def as_step_result(value: Any, role: str, *, source: str) -> StepResult:
    """The value `step` returned, checked and normalised; a wrong shape is a TypeError naming `source`."""
    if not (isinstance(value, tuple | list) and len(value) == 4):
        raise TypeError(f"{source} returned {type(value).__name__}; step must return (observation, reward, done, info)")
    observation, reward, done, info = value
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
        raise TypeError(f"{source} returned reward {reward!r}; a reward is a number or None")
    if not isinstance(done, bool):
        raise TypeError(f"{source} returned done={done!r}; done must be True or False")
    if info is None:
        info = {}
    if not isinstance(info, Mapping):
        raise TypeError(f"{source} returned info of type {type(info).__name__}; info must be a mapping (or None)")
    return StepResult(as_messages(observation, role, source=source), None if reward is None else float(reward), done, dict(info))
