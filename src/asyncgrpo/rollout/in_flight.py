"""An in-flight group: one take of a prompt between its admission and its ending, member by member.

The collector's record of a group whose rollouts are being generated or scored. Lists are
indexed by member (rollout) number; a member has a completion or an error once it finished,
and `dispatch_versions` holds the serving version of its latest attempt.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from asyncgrpo.types import Completion, GenerationRequest, Prompt, SamplingParams


@dataclass
class InFlightGroup:
    """A group between its take and its ending. Lists are indexed by member (rollout) number."""

    key: int
    prompt: Prompt
    size: int
    task: asyncio.Task[None] | None = None
    target_step: int | None = None  # rollout.on_stale: wait: the step that trains it (rollout/stale_policy.py)
    dispatched: int = 0
    dispatch_versions: list[int | None] = field(default_factory=list)
    completions: list[Completion | None] = field(default_factory=list)
    errors: list[BaseException | None] = field(default_factory=list)
    ms: list[int] = field(default_factory=list)  # a finished member's time from its start to its end, in milliseconds
    member_tasks: list[asyncio.Task[None] | None] = field(default_factory=list)
    cut: list[bool] = field(default_factory=list)  # rollout.partial_groups: members cancelled so the group could end early
    interrupts: list[int] = field(default_factory=list)  # rollout.on_stale: resume: interruptions sent and not yet taken
    resumptions: list[int] = field(default_factory=list)  # rollout.on_stale: resume: times each member was resumed
    # rollout.on_stale: resume: the member awaits a request an interruption may cut (never an episode's environment call)
    generating: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.dispatch_versions = [None] * self.size
        self.completions = [None] * self.size
        self.errors = [None] * self.size
        self.ms = [0] * self.size
        self.member_tasks = [None] * self.size
        self.cut = [False] * self.size
        self.interrupts = [0] * self.size
        self.resumptions = [0] * self.size
        self.generating = [False] * self.size

    def interrupt(self, member: int) -> None:
        """rollout.on_stale: resume: stop the member's attempt; its rollout keeps the tokens and continues (a cancellation
        its task takes back, rollout/resumption.py)."""
        task = self.member_tasks[member]
        assert task is not None
        self.interrupts[member] += 1
        self.resumptions[member] += 1
        task.cancel()

    def version_floor(self) -> int | None:
        """Lowest version any of its surviving tokens has or can have (a member being retried counts with
        its current attempt's version); None while nothing live is dispatched."""
        versions: list[int] = []
        for completion, dispatched, error, cut in zip(self.completions, self.dispatch_versions, self.errors, self.cut):
            if error is not None or cut:
                continue
            if completion is not None:
                versions.append(completion.generation_version)
            elif dispatched is not None:
                versions.append(dispatched)
        return min(versions, default=None)

    def live_members(self) -> int:
        """Members dispatched that have not failed: finished, or still being generated."""
        return sum(d is not None and e is None for d, e in zip(self.dispatch_versions, self.errors))

    def finish_early(self) -> None:
        """End the group with the members that have ended: cancel the others (a cancellation, not a failure)."""
        for member, task in enumerate(self.member_tasks):
            if task is not None and not task.done():
                self.cut[member] = True
                task.cancel()

    def kept(self) -> tuple[list[Completion | None], list[BaseException | None]]:
        """The completions and errors of the members not cut (what the group is judged on)."""
        keep = [not cut for cut in self.cut]
        return [c for c, k in zip(self.completions, keep) if k], [e for e, k in zip(self.errors, keep) if k]

    def finished_tokens(self) -> int:
        return sum(c.model_tokens for c in self.completions if c is not None)

    def ms_of(self, kept: Sequence[Completion]) -> int:
        """Generator time of the members whose completions are in `kept` (compared by identity)."""
        ids = {id(c) for c in kept}
        return sum(ms for c, ms in zip(self.completions, self.ms) if id(c) in ids)


def rollout_request(run_seed: int, prompt: Prompt, member: int, sampling: SamplingParams) -> GenerationRequest:
    """The request of member `member` of a take of `prompt`; every attempt of the rollout sends it."""
    return GenerationRequest(
        request_id=f"{prompt.id}-{prompt.epoch}-{prompt.requeues}-{member}",
        prompt_id=prompt.id,
        prompt_token_ids=prompt.token_ids,
        sampling=sampling,
        seed=request_seed(run_seed, prompt, member),
    )


def request_seed(run_seed: int, prompt: Prompt, member: int) -> int:
    """A per-request sampling seed, stable across runs and resumes for the same take of a prompt."""
    text = f"{run_seed}:{prompt.id}:{prompt.epoch}:{prompt.requeues}:{member}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1
