"""What the collector needs from its prompt source and its scorer (rollout/collector.py): typing protocols only."""

from __future__ import annotations

from typing import Any, Protocol

from asyncgrpo.types import Prompt


class PromptSourceLike(Protocol):
    @property
    def exhausted(self) -> bool: ...

    def take(self) -> Prompt | None: ...

    def requeue(self, prompt: Prompt) -> Prompt: ...


class ScorerLike(Protocol):
    """Scores a group's survivors, given as `Completion`s: the reward functions (rewards/scoring.py) get their texts (an
    episode's messages) and token ids; under `algorithm: distill` the teacher (distill/teacher.py) scores their token ids."""

    async def score(self, prompt: Prompt, completions: list[Any]) -> list[Any]: ...
