"""An episode's turns and environment calls, reported to the observer of the rollout that plays it (the run's timeline).

Job: carry the rollout's observer to the episode runner (rollout/episode.py) without a parameter through the collector.
The rollout observer's `rollout_started` hook (rollout/events.py), which the collector calls in the rollout's own task
just before the episode starts, binds an `EpisodeObserver` for that (take, member) with `observe_episode`; the runner
reports each environment call (reset, step) and each turn's generation to `episode_observer()`.

Invariants: a context variable is per task (each rollout runs in a task of its own, which copies its context when it is
created), so one rollout's binding never reaches another's; unbound (no timeline, a unit test's runner), reports go to
`UNOBSERVED`, which drops them. Times are the event loop's (virtual seconds in a simulation), as the collector's hooks.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Literal, Protocol

EnvCall = Literal["reset", "step"]


class EpisodeObserver(Protocol):
    def env_call(self, call: EnvCall, start: float, end: float, *, done: bool | None = None, reward: float | None = None) -> None:
        """An environment call returned: `done` and `reward` are a step's (None for a reset)."""

    def turn(self, start: float, end: float, tokens: int, limit: int | None = None) -> None:
        """A turn's generation returned `tokens` model tokens (its retries inside [start, end]); `limit`: its max_new_tokens
        when the episode's env.max_tokens cut it below generation.max_new_tokens."""

    def observed(self, tokens: int) -> None:
        """The observation of the step reported last joined the episode as `tokens` environment tokens."""


class Unobserved:
    """The episode observer of a rollout nobody watches."""

    def env_call(self, call: EnvCall, start: float, end: float, *, done: bool | None = None, reward: float | None = None) -> None:
        pass

    def turn(self, start: float, end: float, tokens: int, limit: int | None = None) -> None:
        pass

    def observed(self, tokens: int) -> None:
        pass


UNOBSERVED = Unobserved()
_OBSERVER: ContextVar[EpisodeObserver] = ContextVar("asyncgrpo_episode_observer", default=UNOBSERVED)


def observe_episode(observer: EpisodeObserver) -> None:
    """Bind `observer` to the current task's episode (from a rollout observer's `rollout_started`)."""
    _OBSERVER.set(observer)


def episode_observer() -> EpisodeObserver:
    """The current task's episode observer (UNOBSERVED when none was bound)."""
    return _OBSERVER.get()
