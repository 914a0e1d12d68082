"""The run's timeline, `timeline.jsonl`: every rollout's span, every take's ending, every step's spans.

One JSON object per line, with an `"e"` field saying which event it is; times are seconds of the
run's own time: since the first event of its first process (the event loop's clock: virtual seconds
in a simulation), a resumed process continuing from the time its checkpoint recorded:

    {"e": "start", "server": NAME, "max_inflight": N, "group_size": G, "max_rollout_spans": M, "step": S, "at": T}
    {"e": "rollout", "take": K, "prompt": P, "member": I, "start": T, "end": T, "outcome": "finished"|"failed"|"cancelled",
     "version": V, "tokens": N, "server": NAME}
    {"e": "turn", "take": K, "member": I, "start": T, "end": T, "tokens": N, "limit": N}     (an episode's turn: its generation)
    {"e": "env", "take": K, "member": I, "call": "reset"|"step", "start": T, "end": T, "done": B, "reward": R, "tokens": N}
    {"e": "take", "take": K, "prompt": P, "end": T, "ending": "buffered"|"requeued"|<drop reason>}
    {"e": "buffered", "take": K, "end": T, "outcome": "trained"|"stale", "step": S}
    {"e": "step", "step": S, "wait": [T, T], "train": [T, T], "sync": [T, T], "unrecorded": {...}}
    {"e": "eval", "step": S, "span": [T, T]}

Invariants:
- Every take that ended has exactly one "take" line, and every buffered take that left the
  buffer one "buffered" line, so the file agrees with rollout/accounting.py (tests check it).
- Bounded: the first `logging.timeline_max_rollouts` rollout spans are written in full; after
  that rollout spans are summarised, and each step line counts the spans left out since the
  previous one (`unrecorded`: rollouts by outcome and their tokens). Takes, steps and evals
  are always written (one line per take, step or evaluation). An episode's "turn" and "env" lines
  (with an env: section: each turn's generation, each environment call that returned; `done` and
  `reward` only on a step, `tokens` only on a step whose observation joined the episode: its
  environment tokens; `limit` only on a turn whose max_new_tokens env.max_tokens cut) follow its
  rollout's line and share its fate: written when it is, left out with it (kept in memory only
  while the rollout runs).
  The limit is the run's, not each process's: a resume continues the count its checkpoint recorded.
- No I/O per event: lines are kept in memory and appended at each step and at `close()`, so
  the collector's hooks (rollout/events.py) cost a dict and a list append.
- One of the run's records, like metrics.jsonl: appended, never truncated. A resume continues the
  file from its checkpoint's copy (commands/train.py), with a "start" line naming the step it resumed at;
  the takes in flight or buffered at that checkpoint end there without a line (the accounting
  counts them requeued, rollout/accounting.py).
"""

from __future__ import annotations

from typing import Any

from asyncgrpo.rollout.episode_events import UNOBSERVED, EnvCall, observe_episode
from asyncgrpo.rollout.events import BufferedOutcome, RolloutOutcome
from asyncgrpo.telemetry.metrics import JsonlFile
from asyncgrpo.types import StepRecord


class Timeline:
    """Records the timeline of one process's part of a run (see the module docstring); a RolloutObserver."""

    def __init__(self, file: JsonlFile | None, *, server: str, max_inflight: int, group_size: int, max_rollout_spans: int,
                 start_step: int = 0, resumed: dict[str, Any] | None = None) -> None:
        """`file` is appended to (its owner closes it); None keeps the lines in memory. `resumed`: the
        `state()` a checkpoint recorded, so the run's time and its span limit continue from there."""
        self.file = file
        self.server = server
        self.max_rollout_spans = max_rollout_spans
        self.max_inflight = max_inflight
        self.rollout_spans = int(resumed["rollout_spans"]) if resumed else 0  # written in full, by the whole run
        self.rollout_seconds = 0.0  # summed over this process's rollouts, written or not: the generator's use
        self.lines: list[dict[str, Any]] = []  # not yet written (all of them when `file` is None)
        self._origin = float(resumed["elapsed_s"]) if resumed else 0.0  # the run's time when this process started
        self._t0: float | None = None
        self._started: dict[tuple[int, int], float] = {}
        self._episodes: dict[tuple[int, int], EpisodeLines] = {}  # of the rollouts running, their turn and env lines
        self._take_of_seq: dict[int, int] = {}
        self._unrecorded: dict[str, int] = {}
        self._emit({"e": "start", "server": server, "max_inflight": max_inflight, "group_size": group_size,
                    "max_rollout_spans": max_rollout_spans, "step": start_step, "at": self._origin})

    def _t(self, t: float) -> float:
        """Loop time `t` as the run's time."""
        return round(self._origin + self._since_start(t), 6)

    def _since_start(self, t: float) -> float:
        """Seconds since this process's first event."""
        if self._t0 is None:
            self._t0 = t
        return t - self._t0

    def state(self, now: float) -> dict[str, Any]:
        """What a checkpoint records, at loop time `now`, for a resume to continue the timeline."""
        return {"elapsed_s": self._t(now), "rollout_spans": self.rollout_spans}

    def _emit(self, line: dict[str, Any]) -> None:
        self.lines.append(line)

    # -- rollout/events.py's hooks ------------------------------------------------------

    def rollout_started(self, take: int, prompt_id: int, member: int, t: float) -> None:
        """Called in the rollout's own task: binds its episode's turns and environment calls to this timeline there."""
        self._started[(take, member)] = self._t(t)
        if self.rollout_spans >= self.max_rollout_spans:  # its span will not be written: nor will its episode's lines
            observe_episode(UNOBSERVED)
            return
        self._episodes[(take, member)] = lines = EpisodeLines(self, take, member)
        observe_episode(lines)

    def rollout_ended(self, take: int, member: int, outcome: RolloutOutcome, version: int | None, tokens: int, t: float) -> None:
        start = self._started.pop((take, member), None)
        episode = self._episodes.pop((take, member), None)
        if start is None:
            return
        self.rollout_seconds += self._t(t) - start
        if self.rollout_spans >= self.max_rollout_spans:
            self._unrecorded[outcome] = self._unrecorded.get(outcome, 0) + 1
            self._unrecorded["tokens"] = self._unrecorded.get("tokens", 0) + tokens
            return
        self.rollout_spans += 1
        self._emit({"e": "rollout", "take": take, "member": member, "start": start, "end": self._t(t), "outcome": outcome,
                    "version": version, "tokens": tokens, "server": self.server})
        if episode is not None:
            self.lines.extend(episode.lines)

    def take_ended(self, take: int, prompt_id: int, ending: str, seq: int | None, t: float) -> None:
        if seq is not None:
            self._take_of_seq[seq] = take
        self._emit({"e": "take", "take": take, "prompt": prompt_id, "end": self._t(t), "ending": ending})

    def buffered_ended(self, seqs: list[int], outcome: BufferedOutcome, step: int, t: float) -> None:
        for seq in seqs:
            self._emit({"e": "buffered", "take": self._take_of_seq.pop(seq, None), "end": self._t(t), "outcome": outcome, "step": step})

    # -- the run's side -----------------------------------------------------------------

    def step(self, record: StepRecord, now: float) -> None:
        """Step `record.step` ended (its weights published) at loop time `now`: its wait, train and sync spans."""
        sync_start = now - record.weight_sync_s
        train_start = sync_start - record.step_s
        wait_start = train_start - record.wait_s
        line: dict[str, Any] = {
            "e": "step",
            "step": record.step,
            "wait": [self._t(wait_start), self._t(train_start)],
            "train": [self._t(train_start), self._t(sync_start)],
            "sync": [self._t(sync_start), self._t(now)],
        }
        if self._unrecorded:
            line["unrecorded"], self._unrecorded = self._unrecorded, {}
        self._emit(line)
        self.flush()

    def utilisation(self, now: float) -> float | None:
        """Rollouts in progress per generation slot, on average since this process's first event (a rollout
        waiting to retry counts, though it holds no request slot); None before any time has passed."""
        elapsed = self._since_start(now)
        return self.rollout_seconds / (self.max_inflight * elapsed) if elapsed > 0 and self.max_inflight else None

    def evaluation(self, step: int, start: float, end: float) -> None:
        self._emit({"e": "eval", "step": step, "span": [self._t(start), self._t(end)]})

    def flush(self) -> None:
        """Append the lines kept since the last flush (in memory only when the timeline has no file)."""
        if self.file is None:
            return
        self.file.append_lines(self.lines)
        self.lines.clear()

    def close(self) -> None:
        """The last lines: what was left unrecorded, then a flush. The file stays open for its owner to close."""
        if self._unrecorded:
            self._emit({"e": "end", "unrecorded": self._unrecorded})
            self._unrecorded = {}
        self.flush()



class EpisodeLines:
    """One rollout's episode observer (rollout/episode_events.py): its "turn" and "env" lines, until the rollout ends."""

    def __init__(self, timeline: Timeline, take: int, member: int) -> None:
        self._timeline = timeline
        self._key = {"take": take, "member": member}
        self.lines: list[dict[str, Any]] = []

    def env_call(self, call: EnvCall, start: float, end: float, *, done: bool | None = None, reward: float | None = None) -> None:
        t = self._timeline._t
        line: dict[str, Any] = {"e": "env", **self._key, "call": call, "start": t(start), "end": t(end)}
        if call == "step":
            line.update(done=done, reward=reward)
        self.lines.append(line)

    def turn(self, start: float, end: float, tokens: int, limit: int | None = None) -> None:
        t = self._timeline._t
        line: dict[str, Any] = {"e": "turn", **self._key, "start": t(start), "end": t(end), "tokens": tokens}
        if limit is not None:
            line["limit"] = limit
        self.lines.append(line)

    def observed(self, tokens: int) -> None:
        self.lines[-1]["tokens"] = tokens  # the step's line: reported just before
