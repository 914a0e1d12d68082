"""Judging a finished group: which of its rollouts survive, and does the group train or drop? Pure; no tasks, no I/O.

A group is judged twice, around the scoring of its survivors (which the collector awaits):

- `survivors(completions, errors)`: the members whose generation succeeded, or the drop when
  too few did: `invalid_prompt` when every member's prompt was rejected, `failed` when every
  member failed otherwise, `too_few_survivors` when fewer than `min_survivors` are left.
- `scored_rollouts(...)`: GRPO's judge (algorithms/grpo.py; each algorithm judges through its `judge` hook):
  the members that got a reward, with their group-relative advantages,
  or the drop: `too_few_survivors` when fewer than `min_survivors` got a reward (the error names
  the reward functions that returned None), `filtered` when every reward is equal and
  `rollout.filter_zero_variance` is on.

A drop carries the error that stands for it in the failure policy (None for `filtered`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncgrpo.errors import PromptRejectedError
from asyncgrpo.rewards.scoring import unscored_group_error
from asyncgrpo.rollout.advantages import group_advantages
from asyncgrpo.types import Completion, Drop, Prompt, Rollout


def survivors(
    completions: Sequence[Completion | None], errors: Sequence[BaseException | None], *, min_survivors: int
) -> list[Completion] | Drop:
    """The finished members' completions, in member order, or the drop. Every member has exactly one of the two."""
    kept = [c for c in completions if c is not None]
    failed = [e for e in errors if e is not None]
    if len(kept) + len(failed) != len(completions):
        raise AssertionError(f"{len(kept)} survivors + {len(failed)} errors != {len(completions)} members")
    if not kept:
        rejected = [e for e in failed if isinstance(e, PromptRejectedError)]
        if len(rejected) == len(failed):
            return Drop("invalid_prompt", rejected[0])
        return Drop("failed", next(e for e in failed if not isinstance(e, PromptRejectedError)))
    if len(kept) < min_survivors:
        return Drop("too_few_survivors", failed[0] if failed else None)
    return kept


def scored_rollouts(
    prompt: Prompt,
    completions: Sequence[Completion],
    scored: Sequence[Any],
    *,
    min_survivors: int,
    filter_zero_variance: bool,
    scale_by_std: bool,
) -> tuple[Rollout, ...] | Drop:
    """The rollouts of the completions whose score (`.reward`, `.terms`) has a reward, or the drop."""
    kept = [(c, s) for c, s in zip(completions, scored) if s.reward is not None]
    if len(kept) < min_survivors:
        return Drop("too_few_survivors", unscored_group_error(prompt, scored, min_survivors))
    rewards = [float(s.reward) for _, s in kept]
    if filter_zero_variance and max(rewards) == min(rewards):
        return Drop("filtered", None)
    advantages = group_advantages(rewards, scale_by_std=scale_by_std)
    return tuple(
        Rollout(completion=c, reward=r, advantage=a, reward_terms=dict(s.terms), extra=dict(s.extra))
        for (c, s), r, a in zip(kept, rewards, advantages)
    )
