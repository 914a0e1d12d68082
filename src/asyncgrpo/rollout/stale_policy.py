"""The staleness policies (`rollout.on_stale`) as objects behind one interface. Pure: no tasks, no I/O, no clock.

A policy answers the collector's three questions about staleness; the collector, the trainer's side of it
(rollout/batches.py) and the policy's runner (rollout/resumption.py, picked by `resumes`) ask and act:

- What to admit: `target` names the step a newly admitted group must train in (None: any step),
  `release` frees that room when the group is dropped or taken, `ready` says whether a step's batch
  is there, and `prefer_target` which buffered groups the step takes first.
- What to do with a group the next step would leave behind (`left_behind`): it is cancelled, and
  its prompt requeued or dropped (under `resume` only once `may_resume` says no; until then its
  runner interrupts and resumes its rollouts); `finish_early` (`rollout.partial_groups`) says whether
  a straggler with enough finished members ends with them instead, to be trained now. Whether a
  finished group is trainable at a step, masked as the policy masks it, is `trainable`.
- How long a ready batch may wait for stragglers (`wait_until`, given the loop time `now`).

Every policy keeps the hard bound (no group trained past K steps of staleness; the buffer's
check before every take enforces it whatever the policy). They differ in what they trade:

- `patience` (the default, `rollout.patience_share` 1): `requeue`, except that once a batch is ready
  the trainer waits up to `rollout.patience_share` of the last step's training time for
  *stragglers*: in-flight groups still within the bound at this step that the next step would
  cancel (`is_straggler`). Finished in time, they are the oldest in the buffer, so they are
  trained first.
- `requeue` and `drop`: the trainer takes a batch as soon as `groups_per_step` groups are
  buffered; groups in flight that the next step would leave past the bound are cancelled, their
  prompts requeued (up to `max_requeues`) or dropped. Most throughput; the cancelled rollouts are
  the slow ones, so with latency that follows length the trained completions are shorter than
  the policy's (length bias) and long prompts are dropped more often.
- `wait` (NeMo-RL's semantics): each admitted group carries the step it targets (`StepTargets`), the
  lowest step with room at admission, and a step trains only its own groups. Within the admission
  bound that step is at most K steps past the group's version, so nothing is ever stale: no waste,
  no length bias, and the trainer waits for its slowest group. (Should the bound still cut a group,
  its prompt is dropped.)

- `resume`: `requeue`, except that a group the next step would leave behind is not cancelled: its running
  rollouts whose attempt is of a version the next step cannot train are interrupted and continued under the
  newest weights from the tokens they have (rollout/resume.py), and the bound holds per token: tokens older
  than the bound are masked out of the loss when the group is buffered and before a step takes it. A group
  is left behind as `requeue` leaves it (`left_behind`) when a rollout would be resumed more than
  `rollout.max_resumptions` times or have more than `rollout.max_masked_share` of its tokens masked. With
  `rollout.max_prefix_staleness` K' (>= K), a resumed group's tokens up to K' steps old stay in the loss,
  importance-weighted by their own behaviour logprobs, and only older ones are masked. A group one of whose rollouts (finished,
  or running and generating its whole budget unmasked) is sure to be masked past the limit at the earliest step that can
  train it (`hopeless`, `masked_past_limit`) is cut then, as stale, instead of being generated to its end and rejected.

An opt-in for `requeue`, `drop` and `patience`, `rollout.partial_groups` (`may_finish_early`): when a
batch is ready, a straggler with at least `min_group_survivors` finished members ends with them,
its unfinished members cancelled, and is trained in this step. It wastes less and biases more: the
members it keeps are the group's fast (short) ones.

Admission is the same for every policy (rollout/admission.py): `StepTargets.assign` finds room
exactly when `may_admit_group` admits, since the admitted groups not yet taken are the ones
holding targets in [next_step, serving_version + K]. `STALE_POLICIES` maps `rollout.on_stale` to
its class; `stale_policy` builds the recipe's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence, Sized
from typing import TYPE_CHECKING, Literal, Protocol

from asyncgrpo.rollout.admission import is_stale
from asyncgrpo.rollout.resume import mask_stale, masked_share, rollout_bound
from asyncgrpo.types import Completion, Group, Prompt

if TYPE_CHECKING:
    from asyncgrpo.config import RolloutConfig

LeftBehind = Literal["requeue", "drop"]


class Exhaustible(Protocol):
    """The prompt source as a policy sees it: will a new prompt still come?"""

    @property
    def exhausted(self) -> bool: ...


class Buffered(Sized, Protocol):
    """The replay buffer as a policy sees it: its size, and how many of its groups target a step (O(1))."""

    def count_target(self, step: int) -> int: ...


class StalePolicy:
    """The interface, with the answers of a policy that targets no step and never waits: take a batch as soon as
    `groups_per_step` groups are buffered, and cancel a group left behind, its prompt dropped."""

    def __init__(self, r: RolloutConfig) -> None:
        self.groups_per_step = r.groups_per_step
        self.max_requeues = r.max_requeues
        self.finish_early = r.partial_groups  # rollout.partial_groups: stragglers may end early with their finished members
        self.max_staleness = r.max_staleness
        self.bound_of_resumed: int | None = None  # `resume`: rollout.max_prefix_staleness, the bound of a resumed group's tokens

    resumes = False  # `resume`: a rollout left behind is interrupted and continued (rollout/resumption.py), not cancelled

    def target(self, next_step: int, last_step: int) -> int | None:
        """The step a group admitted now trains in, within [next_step, last_step]; None: whichever takes it."""
        return None

    def release(self, target: int | None) -> None:
        """A group holding `target` was dropped or taken: its room is free again."""

    def ready(self, step: int, buffer: Buffered, source: Exhaustible) -> bool:
        """Is step `step`'s batch buffered? `source`: where new groups come from. Read on every wake-up of the trainer:
        O(1) in the groups in flight and buffered."""
        return len(buffer) >= self.groups_per_step

    def prefer_target(self, step: int) -> int | None:
        """The target whose buffered groups step `step` takes first (None: oldest first)."""
        return None

    def left_behind(self, prompt: Prompt) -> LeftBehind:
        """A take of `prompt` was cancelled because no remaining step can train it: requeue the prompt, or drop it."""
        return "drop"

    def wait_until(self, now: float, last_step_s: float | None) -> float | None:
        """Until when (loop time) a ready batch waits for stragglers; None: it does not wait. `last_step_s`: how long
        the last step trained (None before one has)."""
        return None

    def mask(self, group: Group, step: int) -> tuple[Group, int] | None:
        """`group` as step `step` may train it, and the tokens masked anew; None: it is stale. Here the bound is on groups:
        the group as it is (the buffer's and the take's checks hold it to the bound)."""
        return group, 0

    def trainable(self, group: Group, step: int) -> tuple[Group | None, int]:
        """A finished group as step `step` may train it (`mask`) and the tokens `mask` masked anew; (None, 0) when it is stale
        at `step` (every one of its tokens is then wasted as stale, none counted masked: each token is counted once)."""
        masked = self.mask(group, step)
        if masked is None:
            return None, 0
        group, added = masked
        if is_stale(generation_version=group.generation_version, step=step, max_staleness=group.bound(self.max_staleness)):
            return None, 0
        return group, added

    def may_resume(self, finished: Iterable[Completion | None], resumptions: Iterable[int], step: int) -> bool:
        """`resume`: may a group whose finished rollouts are `finished` resume its rollouts resumed `resumptions` times so far,
        once the steps reached `step`? (No policy but `resume` resumes.)"""
        return False

    def hopeless(self, running: Iterable[tuple[Sequence[int], int]], step: int) -> bool:
        """`resume`: is a running rollout of a group sure to be masked past the limit however it ends? (Only `resume` masks.)"""
        return False


class DropPolicy(StalePolicy):
    """`drop`: a group left behind is cancelled and its prompt dropped as `stale`."""


class RequeuePolicy(StalePolicy):
    """`requeue`: a group left behind is cancelled and its prompt requeued, up to `rollout.max_requeues` times."""

    def left_behind(self, prompt: Prompt) -> LeftBehind:
        return "requeue" if prompt.requeues < self.max_requeues else "drop"


class PatiencePolicy(RequeuePolicy):
    """`patience`: `requeue`, but a ready batch waits up to `rollout.patience_share` of the last step for stragglers."""

    def __init__(self, r: RolloutConfig) -> None:
        super().__init__(r)
        self.share = r.patience_share

    def wait_until(self, now: float, last_step_s: float | None) -> float | None:
        return patience_deadline(now=now, last_step_s=last_step_s, share=self.share)


class WaitPolicy(StalePolicy):
    """`wait`: each admitted group targets a step, and a step trains its own groups (any, once none of its own is coming)."""

    def __init__(self, r: RolloutConfig) -> None:
        super().__init__(r)
        self.targets = StepTargets(r.groups_per_step)

    def target(self, next_step: int, last_step: int) -> int | None:
        return self.targets.assign(next_step, last_step)

    def release(self, target: int | None) -> None:
        if target is not None:
            self.targets.release(target)

    def ready(self, step: int, buffer: Buffered, source: Exhaustible) -> bool:
        buffered = buffer.count_target(step)
        if buffered >= self.groups_per_step:
            return len(buffer) >= self.groups_per_step
        # Live targets are the groups in flight plus those buffered (released when dropped or taken): counts, no scan.
        own_coming = self.targets.live(step) > buffered
        return source.exhausted and not own_coming and len(buffer) >= self.groups_per_step

    def prefer_target(self, step: int) -> int | None:
        return step


class ResumePolicy(RequeuePolicy):
    """`resume`: a rollout left behind is interrupted and continued under the newest weights; tokens older than the bound
    are masked out of the loss, and a group with too many of them, or resumed too often, is left behind as `requeue`."""

    resumes = True

    def __init__(self, r: RolloutConfig) -> None:
        super().__init__(r)
        self.max_masked_share = r.max_masked_share
        self.max_resumptions = r.max_resumptions
        self.bound_of_resumed = r.max_prefix_staleness

    def mask(self, group: Group, step: int) -> tuple[Group, int] | None:
        """`group` as step `step` may train it (tokens past the bound masked) and the tokens that masked anew; None: stale."""
        return mask_stale(group, step=step, bound=self.max_staleness, prefix_bound=self.bound_of_resumed, max_share=self.max_masked_share)

    def may_resume(self, finished: Iterable[Completion | None], resumptions: Iterable[int], step: int) -> bool:
        """Not when a rollout would be resumed more than `rollout.max_resumptions` times, nor when a finished one already has more
        than the limit masked at `step` (and so at every later step) under its own bound (`rollout_bound`: K, or
        `rollout.max_prefix_staleness` for a rollout with a resumed prefix), the bound it will be judged by."""
        if any(times >= self.max_resumptions for times in resumptions):
            return False
        return not any(c is not None and masked_share(c, step=step, bound=rollout_bound(
            c, bound=self.max_staleness, prefix_bound=self.bound_of_resumed)) > self.max_masked_share for c in finished)

    def hopeless(self, running: Iterable[tuple[Sequence[int], int]], step: int) -> bool:
        """Is a rollout of the group be masked past the limit at any step that can train it, whatever it still generates?
        `running`: each running rollout's versions so far and the most tokens it can have at its end (its budget); `step`:
        the earliest step that can train the group. Then the group is cut now, as stale (`masked_past_limit`)."""
        bound = max(self.max_staleness, self.bound_of_resumed or 0)  # the widest bound the group can have: masks the fewest
        return any(masked_past_limit(versions, step=step, bound=bound, budget=budget, max_share=self.max_masked_share)
                   for versions, budget in running)


STALE_POLICIES: dict[str, type[StalePolicy]] = {
    "patience": PatiencePolicy,
    "requeue": RequeuePolicy,
    "drop": DropPolicy,
    "wait": WaitPolicy,
    "resume": ResumePolicy,
}


def stale_policy(r: RolloutConfig) -> StalePolicy:
    """The policy `rollout.on_stale` names (config validation admits only the registry's names)."""
    return STALE_POLICIES[r.on_stale](r)


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


def masked_past_limit(versions: Sequence[int], *, step: int, bound: int, budget: int, max_share: float) -> bool:
    """`resume`: is a running rollout whose tokens so far have `versions` sure to have more than `max_share` of its tokens
    masked at step `step` or later, if it ends with at most `budget` tokens (at least its tokens so far)? Its tokens older
    than `step - bound` are masked at `step` and at every later step, and it cannot end with more tokens than its budget:
    its masked share at its end is at least their count over the budget. So this never cuts a rollout that could still end
    at or under the limit, and cuts one the moment its masked tokens make the limit unreachable."""
    masked = sum(v < step - bound for v in versions)
    return masked > max_share * max(budget, len(versions))


def is_straggler(*, version_floor: int | None, step: int, max_staleness: int) -> bool:
    """An in-flight group that step `step` may still train and step `step + 1` would cancel as stale."""
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
