"""Judging a distilled sample: its completion and the teacher's log-probs become a trainable rollout. Pure.

Under `algorithm: distill` there are no rewards and no group-relative advantages: the training signal of
token t is the sampled-token estimate of the reverse KL, `log pi_gen(x_t) - log pi_teacher(x_t)`, which the
loss turns into a per-token advantage (distill/loss.py). So the rollout keeps the teacher's log-probs, its
`advantage` is 0.0 (unused), and its `reward` is minus the sample's mean per-token KL estimate (0.0 for an
empty completion), so `reward/mean` rises as the student approaches the teacher.

Invariants: one rollout per completion, in order; the teacher's log-probs have one finite entry per completion
token (both teachers answer so by construction: anything else is a bug, raised, never silently padded).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from asyncgrpo.types import Completion, Group, Rollout


def taught_rollouts(completions: Sequence[Completion], teacher_logprobs: Sequence[Sequence[float]]) -> tuple[Rollout, ...]:
    """The rollouts of `completions` with the teacher's log-probs of their tokens (one sequence per completion)."""
    if len(teacher_logprobs) != len(completions):
        raise AssertionError(f"the teacher returned {len(teacher_logprobs)} answers for {len(completions)} samples")
    rollouts = []
    for completion, logprobs in zip(completions, teacher_logprobs):
        teacher = tuple(float(v) for v in logprobs)
        if len(teacher) != len(completion.token_ids) or not all(math.isfinite(v) for v in teacher):
            raise AssertionError(
                f"the teacher returned {len(teacher)} log-probs (finite: {all(math.isfinite(v) for v in teacher)}) for a "
                f"completion of {len(completion.token_ids)} tokens; it must return one finite log-prob per token"
            )
        kl = token_kl(completion.logprobs, teacher)
        reward = -math.fsum(kl) / len(kl) if kl else 0.0
        rollouts.append(Rollout(completion=completion, reward=reward, advantage=0.0, teacher_logprobs=teacher))
    return tuple(rollouts)


def token_kl(student: Sequence[float], teacher: Sequence[float]) -> list[float]:
    """Per-token sampled estimate of the reverse KL: log pi_student(x_t) - log pi_teacher(x_t)."""
    return [s - t for s, t in zip(student, teacher)]


def kl_mean(groups: Sequence[Group]) -> float:
    """`distill/kl_mean`: the mean per-token reverse-KL estimate over every token of the batch's samples,
    with the generator's log-probs (the student that sampled them); 0.0 without tokens."""
    values = [
        v
        for g in groups
        for r in g.rollouts
        if r.teacher_logprobs is not None
        for v in token_kl(r.completion.logprobs, r.teacher_logprobs)
    ]
    return math.fsum(values) / len(values) if values else 0.0
