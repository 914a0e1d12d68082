"""The staleness policies (`rollout.on_stale`): what the trainer does about groups the steps would leave behind. Pure.

Every policy keeps the hard bound (no group trained past K steps of staleness; the buffer's
check before every take enforces it whatever the policy). They differ in what they trade:

- `requeue` and `drop`: the trainer takes a batch as soon as `groups_per_step` groups are
  buffered; groups in flight that the next step would leave past the bound are cancelled, their
  prompts requeued (up to `max_requeues`) or dropped. Most throughput; the cancelled rollouts are
  the slow ones, so with latency that follows length the trained completions are shorter than
  the policy's (length bias) and long prompts are dropped more often.
- `wait` (NeMo-RL's semantics): each admitted group carries the step it targets (`StepTargets`), the
  lowest step with room at admission, and a step trains only its own groups. Within the admission
  bound that step is at most K steps past the group's version, so nothing is ever stale: no waste,
  no length bias, and the trainer waits for its slowest group.
- `patience` (the default, `rollout.patience_share` 1): `requeue`, except that once a batch is ready
  the trainer waits up to `rollout.patience_share` of the last step's training time for
  *stragglers*: in-flight groups still within the bound at this step that the next step would
  cancel (`is_straggler`). Finished in time, they are the oldest in the buffer, so they are
  trained first.

An opt-in for `requeue`, `drop` and `patience`, `rollout.partial_groups` (`may_finish_early`): when a
batch is ready, a straggler with at least `min_group_survivors` finished members ends with them,
its unfinished members cancelled, and is trained in this step. It wastes less and biases more: the
members it keeps are the group's fast (short) ones.

Admission is the same for every policy (rollout/admission.py): `StepTargets.assign` finds room
exactly when `may_admit_group` admits, since the admitted groups not yet taken are the ones
holding targets in [next_step, serving_version + K].
"""

from __future__ import annotations

from collections import Counter

from asyncgrpo.rollout.admission import is_stale


class StepTargets:
    """`wait`: how many live groups (admitted, not dropped, not yet taken) target each step."""

    def __init__(self, groups_per_step: int) -> None:
        self.groups_per_step = groups_per_step
        self._live: Counter[int] = Counter()

    def assign(self, next_step: int, last_step: int) -> int:
        """Target a new group at the lowest step in [next_step, last_step] with room; the admission rule guarantees one."""
        step = next_step
        while self._live[step] >= self.groups_per_step:
            step += 1
        if step > last_step:
            raise AssertionError(f"admitted a group with every step from {next_step} to {last_step} full: {dict(self._live)}")
        self._live[step] += 1
        return step

    def release(self, step: int) -> None:
        """A group targeting `step` was dropped or taken: its room is free again."""
        if self._live[step] <= 0:
            raise AssertionError(f"released a target of step {step}, which has none")
        self._live[step] -= 1
        if not self._live[step]:
            del self._live[step]

    def live(self, step: int) -> int:
        return self._live[step]


def is_straggler(*, version_floor: int | None, step: int, max_staleness: int) -> bool:
    """`patience`: an in-flight group that step `step` may still train and step `step + 1` would cancel as stale."""
    if version_floor is None:
        return False
    return not is_stale(generation_version=version_floor, step=step, max_staleness=max_staleness) and is_stale(
        generation_version=version_floor, step=step + 1, max_staleness=max_staleness
    )


def may_finish_early(*, version_floor: int | None, step: int, max_staleness: int, dispatched: bool, finished: int,
                     min_survivors: int) -> bool:
    """`rollout.partial_groups`: end a straggler now with its finished members (its others cancelled) so that step
    `step` can train it? Only a fully dispatched straggler with at least `min_survivors` finished members."""
    return dispatched and finished >= min_survivors and is_straggler(version_floor=version_floor, step=step, max_staleness=max_staleness)


def patience_deadline(*, now: float, last_step_s: float | None, share: float) -> float:
    """`patience`: until when a ready batch may wait for stragglers (no wait before a step has been timed)."""
    return now + share * (last_step_s or 0.0)
