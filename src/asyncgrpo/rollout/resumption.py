"""What becomes of the rollouts the steps leave behind, as the staleness policy says: the policy decides, a runner acts.

The collector (rollout/collector.py) generates every rollout through its run's runner and hands it each group
that no remaining step can train at the group's oldest version, and each weight publication; it has no mode
switch of its own. `runner_for` picks the runner from the policy (rollout/stale_policy.py) and the backend:

- `Cancelling` (every policy but `resume`): a rollout is one request under the retry policy; a group left
  behind is cancelled as stale (the collector ends it); a publication changes nothing.
- `Resuming` (`rollout.on_stale: resume`): a rollout is a chain of requests, each continuing from the tokens
  of those interrupted before it (rollout/resume.py: `resumed_request`, `join`). When the steps leave a group
  behind, or weights are published, its running rollouts whose attempt is of an older version are interrupted,
  all of the group's at once, if the policy's `may_resume` allows it; a group left behind that it does not
  allow, or one already sure to be masked past the limit (below), is cancelled as stale. On a backend that
  installs weights between decoding steps (`continues_in_flight`: the local engine) every rollout continues in
  place, each token stamped with its version: nothing is interrupted, the policy still decides whether a group
  left behind is cancelled (the early cut below does not apply: no sink records its tokens so far), and a rollout
  that went on under newer weights than its first token's has a resumed prefix, as an interrupted one has
  (resume.py `rollout_bound`: `rollout.max_prefix_staleness` bounds its tokens, K its siblings').

An episode (`env:`, rollout/episode.py) generates each turn through `rollouts` too, so under `Resuming` each
turn's request is such a chain with a sink of its own: an interrupted turn keeps its tokens and continues, the
episode's finished turns, its environment and the observations it gave are untouched. An interruption is only
ever sent to a member while it awaits a request (`group.generating`, set here around each request): a member in
an environment call (not replayable) is left alone, and its next turn is generated under the newest weights
anyway. Under `resume` a turn's dispatch version is its own (no floor from the episode's earlier turns): those
turns are a prefix, held to the bound token by token as a resumed prefix is.

A group is cut early (`_hopeless`, at each publication and when the steps leave it behind): once the tokens masked at
the earliest step that can train it (older than that step minus the widest bound the group can have) make one rollout's
share past `rollout.max_masked_share` even if every running rollout generates its whole budget unmasked
(`generation.max_new_tokens`, or `env.max_tokens` for an episode; `StalePolicy.hopeless`), the collector ends it as stale,
as it would end it at its finish; nothing is polled per token. Each running member's tokens so far are recorded in a
`Progress` (its episode's finished turns, the turn's prefix, the attempt's sink), the records of ended groups dropped at
the next publication.

Invariants: an interruption is a cancellation of the member's task that the task takes back (`Task.uncancel`),
counted in `group.interrupts` until taken, so a cancellation the task did not get from here (stale, shutdown)
always propagates; it is sent only while `group.generating[member]`, so it always lands in a request, never in
an environment call; a rollout's completion keeps every token of its requests in order; every interruption
reaches the books (`Books.resumed`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Coroutine, Iterable, Sequence
from typing import Protocol

from asyncgrpo.rollout.books import Books
from asyncgrpo.rollout.in_flight import InFlightGroup
from asyncgrpo.rollout.resume import has_resumed_prefix, join, partial, resumed_request
from asyncgrpo.rollout.slots import Slot
from asyncgrpo.rollout.stale_policy import StalePolicy
from asyncgrpo.types import Completion, GenerationRequest, TokenSink


class Attempts(Protocol):
    """Member `member` of a group generating `request` while holding `slot`: one request under the retry policy (the
    collector's), or a rollout (an episode's turn) made of such requests. `floor`: the oldest version of an episode's
    earlier turns, which the collector's retry policy keeps as the member's dispatch version (None: a plain rollout)."""

    def __call__(self, request: GenerationRequest, group: InFlightGroup, member: int, slot: Slot, floor: int | None = None, /
                 ) -> Coroutine[object, object, Completion]: ...


class Cancelling:
    """Every policy but `resume`: one request per rollout, and a group the steps leave behind is cancelled as stale."""

    def rollouts(self, attempts: Attempts) -> Attempts:
        """How a rollout is generated, given how each of its requests is: here `attempts` itself (no wrapper: not one call
        or coroutine more per rollout)."""
        return attempts

    def resume(self, group: InFlightGroup, step: int) -> bool:
        """`group`'s oldest version is stale at `step`: does it go on (True), or is it cancelled as stale (False)?"""
        return False

    def weights_published(self, groups: Iterable[InFlightGroup], version: int, step: int) -> Sequence[InFlightGroup]:
        """The generator now serves `version` and `step` is the next step to take a batch. Returns the groups to cancel as
        stale now (none here)."""
        return ()

    def bound_of(self, group: InFlightGroup) -> int | None:
        """The staleness bound of `group`'s finished `Group` (None: the run's K)."""
        return None


class Resuming(Cancelling):
    """`rollout.on_stale: resume`: rollouts left behind are interrupted and continued under the newest weights."""

    def __init__(self, policy: StalePolicy, books: Books, *, in_place: bool, episode_tokens: int | None = None) -> None:
        """`in_place`: the backend continues every rollout in place (`continues_in_flight`): nothing to interrupt.
        `episode_tokens`: `env.max_tokens` when every rollout is an episode (None: a rollout is one request)."""
        self.policy = policy
        self.books = books
        self.in_place = in_place
        self.episode_tokens = episode_tokens
        self._progress: dict[tuple[int, int], Progress] = {}  # (group key, member): its tokens so far, for `_hopeless`

    def rollouts(self, attempts: Attempts) -> Attempts:
        # In place: no sink to fill, and no coroutine more than the request's own.
        return functools.partial(self._in_place if self.in_place else self._resumable, attempts)

    @staticmethod
    def _in_place(attempts: Attempts, request: GenerationRequest, group: InFlightGroup, member: int, slot: Slot, floor: int | None = None,
                  ) -> Coroutine[object, object, Completion]:
        """The request itself, with no floor: an episode's earlier turns are held to the bound token by token."""
        return attempts(request, group, member, slot)

    async def _resumable(self, attempts: Attempts, request: GenerationRequest, group: InFlightGroup, member: int, slot: Slot,
                         floor: int | None = None) -> Completion:
        """The rollout's (or turn's) requests, each continuing from the tokens of those interrupted before it (`_interrupt`
        interrupts, only while `group.generating[member]`: a cancellation this task takes back); its completion is their
        concatenation. `floor` is not applied: an episode's earlier turns are a prefix, held to the bound token by token."""
        sink = TokenSink()
        prefix: Completion | None = None
        key = (group.key, member)
        earlier = self._progress[key].earlier if floor is not None and key in self._progress else ()
        budget = self.episode_tokens if self.episode_tokens is not None else request.sampling.max_new_tokens
        progress = self._progress[key] = Progress(budget, earlier, sink)
        while True:
            group.generating[member] = True
            try:
                continuation = await attempts(resumed_request(request, prefix, sink), group, member, slot)
            except asyncio.CancelledError:
                task, pending = asyncio.current_task(), group.interrupts[member]
                if not pending or task is None or task.cancelling() != pending:
                    raise  # cancelled (stale, shutdown), not (only) interrupted
                for _ in range(pending):
                    task.uncancel()
                group.interrupts[member] = 0
                version = group.dispatch_versions[member]
                assert version is not None  # an interrupted member was dispatched
                prefix = progress.prefix = join(prefix, partial(sink, version))
                continue
            finally:
                group.generating[member] = False
            completion = join(prefix, continuation)
            progress.turn_done(completion)
            return completion

    def resume(self, group: InFlightGroup, step: int) -> bool:
        """Interrupt, all at once, the group's running rollouts whose attempt no remaining step can train, to continue under
        the newest weights; or, when the policy says so (a finished rollout masked past the limit, a rollout resumed too
        often), let the group be cancelled as stale."""
        return not self._hopeless(group, step) and self._interrupt(group, older_than=step - self.policy.max_staleness, step=step,
                                                                   may_end=True)

    def weights_published(self, groups: Iterable[InFlightGroup], version: int, step: int) -> Sequence[InFlightGroup]:
        """Every running rollout of an older version (with resumptions left) is interrupted, all of a group's together; the
        groups returned are hopeless (`_hopeless`) and to be cancelled as stale instead."""
        if self.in_place:
            return ()
        groups = list(groups)
        live = {group.key for group in groups}
        self._progress = {key: p for key, p in self._progress.items() if key[0] in live}  # ended groups' records go
        cut = []
        for group in groups:
            if self._hopeless(group, step):
                cut.append(group)
            else:
                self._interrupt(group, older_than=version, step=step, may_end=False)
        return cut

    def bound_of(self, group: InFlightGroup) -> int | None:
        """The widest bound of the finished group's rollouts: `rollout.max_prefix_staleness` if one has a resumed prefix
        (its tokens span versions: interrupted and continued, or continued in place), else None (K). Each rollout's tokens
        are masked by their own bound (resume.py `rollout_bound`)."""
        resumed = any(c is not None and has_resumed_prefix(c) for c in group.completions)
        return self.policy.bound_of_resumed if resumed else None

    def _hopeless(self, group: InFlightGroup, step: int) -> bool:
        """Is a rollout of `group` sure to be masked past `rollout.max_masked_share` at `step` (the earliest step that can train it)
        or later, whatever its running rollouts still generate (`StalePolicy.hopeless`)? Then generating the rest would be in
        vain. Judged: the finished members (their budget is their length), and the members awaiting a request, whose records are
        their current episode's (a member in an environment call, or waiting to retry a fresh episode, may hold the record of
        an episode it has given up)."""
        finished = [(c.versions, len(c.versions)) for c in group.kept()[0] if c is not None]
        running = [(p.versions(), p.budget) for m in range(group.size)
                   if group.generating[m] and (p := self._progress.get((group.key, m))) is not None]
        return bool(running) and self.policy.hopeless(finished + running, step)

    def _interrupt(self, group: InFlightGroup, *, older_than: int, step: int, may_end: bool) -> bool:
        """Interrupt the group's rollouts awaiting a request (never one in an environment call) whose attempt is of a version
        below `older_than`, all at once, if the policy lets it resume them at `step`. False: it does not, and the group is to
        be cancelled as stale (`may_end`: they would be stale) or left as it is. In place, those rollouts are resumed as they
        run (under the newest weights, token by token): the policy decides the same way, and nothing is interrupted."""
        behind = [m for m in range(group.size) if self._running(group, m) and not group.interrupts[m]
                  and (v := group.dispatch_versions[m]) is not None and v < older_than]
        if not behind and not may_end:
            return True
        if not self.policy.may_resume(group.kept()[0], [group.resumptions[m] for m in behind], step):
            return False
        if self.in_place:
            return True
        for member in behind:
            group.interrupt(member)
        self.books.resumed(len(behind))
        return True

    def _running(self, group: InFlightGroup, member: int) -> bool:
        """Is `member` generating: awaiting a request, or, in place, dispatched and not ended?"""
        if not self.in_place:
            return group.generating[member]
        return group.dispatch_versions[member] is not None and group.completions[member] is None and group.errors[member] is None


def runner_for(policy: StalePolicy, books: Books, *, continues_in_flight: bool, episode_tokens: int | None = None) -> Cancelling:
    """The runner of `policy` (`rollout.on_stale`) on a backend that does (or does not) continue rollouts in place;
    `episode_tokens`: `env.max_tokens` when rollouts are episodes."""
    return Resuming(policy, books, in_place=continues_in_flight, episode_tokens=episode_tokens) if policy.resumes else Cancelling()


class Progress:
    """A running rollout's tokens so far, as `Resuming` sees them: the model tokens' versions of its episode's finished turns
    (`earlier`), the turn's prefix (its interrupted attempts, joined) and the sink of its current attempt; `budget`: the most
    tokens it can have at its end (`generation.max_new_tokens`, or `env.max_tokens` for an episode). An episode's
    environment tokens are not counted among its versions (they would only add masked tokens: the count is a lower bound)."""

    __slots__ = ("budget", "earlier", "prefix", "sink")

    def __init__(self, budget: int, earlier: tuple[int, ...], sink: TokenSink | None) -> None:
        self.budget, self.earlier, self.sink = budget, earlier, sink
        self.prefix: Completion | None = None

    def versions(self) -> tuple[int, ...]:
        prefix = self.prefix.versions if self.prefix is not None else ()
        return self.earlier + prefix + (tuple(self.sink.versions) if self.sink is not None else ())

    def turn_done(self, completion: Completion) -> None:
        """The request (an episode's turn) ended with `completion`: its tokens join the earlier turns'."""
        self.earlier, self.prefix, self.sink = self.earlier + completion.versions, None, None
