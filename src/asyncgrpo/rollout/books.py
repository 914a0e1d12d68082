"""The books of a run's rollouts: one place that records how each rollout, group and take ended.

No tasks and no I/O of its own (the ledger's sink and the observer do theirs: a run's outcomes.jsonl and timeline).

The collector hands every ending here exactly once, and each method updates every record the
ending touches, so no record can miss one:

- the accounting (rollout/accounting.py): which bucket the take is in;
- the counters (names in metric_names.py), the token books among them (rollout/token_books.py);
- the prompt ledger (rollout/ledger.py): a take that ended for good, trained or dropped;
- the observer (rollout/events.py; the run's timeline): every rollout and take ending;
- the failure policy (rollout/failures.py): every judged group, buffered or dropped (a cancellation never).

Endings of a take: `buffered`, `dropped` (a judged group's drop reason), `left_behind` (cancelled as
stale in flight: requeued or dropped `stale`); of a buffered group: `stale_buffered`, `trained`.
Endings of a rollout: `rollout_cancelled`, `rollout_ended` (finished or failed).

Invariants, checked after every chaos scenario (tests/sim/test_chaos.py, `check_books`):
- `accounting.balanced()`; the counters' drops and requeues equal the accounting's, and stale groups
  are the requeued ones plus those dropped `stale`;
- the ledger holds every take that was trained or dropped, and nothing else;
- the observer saw each ended take end once, with the accounting's outcome;
- the failure policy judged every buffered or dropped group once (`judged`);
- every generated token is trained, masked as older than the bound (`resume`), wasted for a reason, or still held.
Group endings return the failure policy's `Verdict` when a rule is now broken (the collector fails the run).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from asyncgrpo.metric_names import COUNTER_NAMES
from asyncgrpo.rollout import token_books
from asyncgrpo.rollout.accounting import Accounting
from asyncgrpo.rollout.episode import count_episode
from asyncgrpo.rollout.events import NoObserver, RolloutObserver
from asyncgrpo.rollout.failures import FailurePolicy, GroupEnding, Verdict
from asyncgrpo.rollout.in_flight import InFlightGroup
from asyncgrpo.rollout.ledger import PromptLedger
from asyncgrpo.rollout.stale_policy import LeftBehind
from asyncgrpo.types import Completion, Drop, DropReason, Group, Prompt


class Books:
    def __init__(self, policy: FailurePolicy, *, accounting: Accounting | None = None, ledger: PromptLedger | None = None,
                 counters: Mapping[str, int] | None = None, observer: RolloutObserver | None = None) -> None:
        """`accounting`, `ledger` and `counters` continue a checkpoint's (a fresh run starts them empty or at 0)."""
        self.policy = policy
        self.accounting = accounting if accounting is not None else Accounting()
        self.ledger = ledger if ledger is not None else PromptLedger()
        self.observer: RolloutObserver = observer if observer is not None else NoObserver()
        self.counters: dict[str, int] = {name: 0 for name in COUNTER_NAMES}
        self.counters.update(counters or {})

    # ------------------------------------------------------------------ rollouts

    def take(self) -> int:
        """A prompt was taken: its take's key, its number in the run (a resumed run's accounting continues it)."""
        self.accounting.take()
        return self.accounting.taken

    def rollout_started(self, group: InFlightGroup, member: int, t: float) -> None:
        self.observer.rollout_started(group.key, group.prompt.id, member, t)

    def rollout_cancelled(self, group: InFlightGroup, member: int, seconds: float, t: float) -> None:
        """A rollout was cancelled (stale, cut short, shutdown) after `seconds` of generator time: never a failure."""
        self.observer.rollout_ended(group.key, member, "cancelled", group.dispatch_versions[member], 0, t)
        token_books.rollout_ended(self.counters, seconds)

    def rollout_ended(self, group: InFlightGroup, member: int, result: Completion | BaseException, seconds: float, t: float) -> None:
        """A rollout finished (`result` a completion) or failed (its error) after `seconds`; kept on its group."""
        if isinstance(result, Completion):
            group.completions[member] = result
            self.counters["rollout/generated_tokens_total"] += result.model_tokens
            count_episode(self.counters, result)
            self.observer.rollout_ended(group.key, member, "finished", group.dispatch_versions[member], len(result.token_ids), t)
        else:
            group.errors[member] = result
            self.counters["rollout/failed_total"] += 1
            self.observer.rollout_ended(group.key, member, "failed", group.dispatch_versions[member], 0, t)
        group.ms[member] = token_books.rollout_ended(self.counters, seconds)

    def resumed(self, rollouts: int) -> None:
        """`rollout.on_stale: resume`: `rollouts` rollouts were interrupted to continue under newer weights (not an ending)."""
        self.counters["rollout/resumed_rollouts_total"] += rollouts

    def masked(self, tokens: int) -> None:
        """`rollout.on_stale: resume`: `tokens` tokens of a kept group were masked out of the loss as older than the bound."""
        token_books.masked(self.counters, tokens)

    def retried(self) -> None:
        """An attempt failed and is retried (not an ending: counted)."""
        self.counters["rollout/retries_total"] += 1

    # ------------------------------------------------------------------ takes

    def unscored(self, tokens: int) -> None:
        """A scored group's completions that got no reward are thrown away (`failed` waste)."""
        token_books.group_wasted(self.counters, "failed", tokens)

    def buffered(self, group: InFlightGroup, finished: Group, t: float) -> Verdict | None:
        """The take's group was judged trainable and buffered as `finished`."""
        self.observer.take_ended(group.key, group.prompt.id, "buffered", finished.seq, t)
        self.accounting.buffer()
        return self.policy.record("success", None)

    def dropped(self, group: InFlightGroup, drop: Drop, step: int, t: float) -> Verdict | None:
        """The take's group was judged and dropped for `drop.reason` (never `stale`), its finished tokens wasted."""
        self.observer.take_ended(group.key, group.prompt.id, drop.reason, None, t)
        self.accounting.drop_in_flight(drop.reason)
        self._count_drop(drop.reason, group.prompt, step)
        token_books.group_wasted(self.counters, drop.reason, group.finished_tokens())
        ending: GroupEnding = drop.reason  # type: ignore[assignment]  # judged drops are never `stale`
        return self.policy.record(ending, drop.error)

    def left_behind(self, group: InFlightGroup, samples: int, fate: LeftBehind, step: int, t: float) -> None:
        """The take was cancelled in flight as stale, with `samples` stale samples; its prompt requeued or dropped."""
        finished = sum(c is not None for c in group.completions)
        self._count_stale(samples, finished, group.finished_tokens())
        if fate == "requeue":
            self.observer.take_ended(group.key, group.prompt.id, "requeued", None, t)
            self.accounting.requeue_in_flight()
            self.counters["rollout/requeued_total"] += 1
        else:
            self.observer.take_ended(group.key, group.prompt.id, "stale", None, t)
            self.accounting.drop_in_flight("stale")
            self._count_drop("stale", group.prompt, step)

    # ------------------------------------------------------------------ buffered groups

    def stale_buffered(self, group: Group, step: int, t: float) -> None:
        """A buffered group was dropped as stale before step `step` took its batch."""
        self.observer.buffered_ended([group.seq], "stale", step, t)
        self.accounting.drop_buffered("stale")
        self._count_drop("stale", group.prompt, step)
        self._count_stale(len(group.rollouts), len(group.rollouts), sum(r.completion.model_tokens for r in group.rollouts))

    def trained(self, groups: Sequence[Group], step: int, t: float) -> None:
        """Step `step` trained `groups` and its weights are published."""
        self.accounting.train_buffered(len(groups))
        token_books.step_trained(self.counters, groups)
        self.observer.buffered_ended([g.seq for g in groups], "trained", step, t)
        for group in groups:
            self.ledger.trained(group.prompt, step)

    # ------------------------------------------------------------------ shared

    def _count_stale(self, samples: int, completions: int, tokens: int) -> None:
        """A group thrown away as stale, in flight or buffered: its samples, its finished completions and their tokens."""
        self.counters["rollout/stale_groups_total"] += 1
        self.counters["rollout/stale_samples_total"] += samples
        self.counters["rollout/stale_completions_total"] += completions
        self.counters["rollout/wasted_tokens_total"] += tokens
        token_books.group_wasted(self.counters, "stale", tokens)

    def _count_drop(self, reason: DropReason, prompt: Prompt, step: int) -> None:
        self.counters["rollout/dropped_groups_total"] += 1
        self.counters[f"rollout/dropped/{reason}"] += 1
        self.ledger.dropped(prompt, reason, step)
