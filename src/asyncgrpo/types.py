"""Small frozen carriers that flow through the pipeline.

PromptSource -> Prompt -> (Generator) Completion -> (Rewards) Rollout -> Group -> Trainer -> StepRecord.

Invariants:
- Every carrier is immutable; stages build new ones instead of mutating.
- A `Completion` carries one policy version per generated token (`versions`), so the
  generation version of a group is the minimum over all its tokens (DESIGN.md §1).
- `DropReason` is the closed set of reasons a taken prompt can end without training; the
  accounting object always reports every one of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

DropReason = Literal["stale", "failed", "too_few_survivors", "invalid_prompt", "filtered", "reward_error"]
DROP_REASONS: tuple[DropReason, ...] = (
    "stale",
    "failed",
    "too_few_survivors",
    "invalid_prompt",
    "filtered",
    "reward_error",
)

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Prompt:
    """One prompt row, tokenized.

    `id` is the row's index in its dataset and is stable across epochs and resumes;
    `columns` holds the row's other columns, passed to reward functions by name.
    `requeues` counts how often this prompt was requeued after a stale cancellation.
    """

    id: int
    text: str
    token_ids: tuple[int, ...]
    columns: Mapping[str, Any] = field(default_factory=dict)
    epoch: int = 0
    requeues: int = 0
    messages: tuple[Mapping[str, Any], ...] | None = None  # the chat messages `text` was rendered from, if any


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion. `temperature >= 0` (0 = greedy); stop tokens end the completion and are kept in it."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class GenerationRequest:
    """One completion request sent to a `Generator` (one rollout is one request).

    `seed` makes sampling reproducible per request; `prompt_id` lets scripted backends
    inject faults for given prompts.
    """

    request_id: str
    prompt_id: int
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    seed: int


@dataclass(frozen=True)
class Completion:
    """What a generator returns for one request.

    Shapes: `token_ids`, `logprobs` and `versions` all have length T (generated tokens,
    including a final stop token if one was sampled). `logprobs[t]` is log pi_gen of
    `token_ids[t]` under the distribution actually sampled (after temperature);
    `versions[t]` is the policy version whose weights produced token t.
    `dispatch_version` is the serving version when the request was dispatched; it stands
    in for the generation version of an empty completion.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish_reason: FinishReason
    dispatch_version: int
    text: str = ""

    def __post_init__(self) -> None:
        if not (len(self.token_ids) == len(self.logprobs) == len(self.versions)):
            raise ValueError(
                f"Completion fields disagree in length: {len(self.token_ids)} token_ids, "
                f"{len(self.logprobs)} logprobs, {len(self.versions)} versions"
            )

    @cached_property  # read on every staleness check: a min over the tokens once, not per read
    def generation_version(self) -> int:
        """Lowest policy version that produced any token of this completion."""
        return min(self.versions, default=self.dispatch_version)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass(frozen=True)
class Rollout:
    """A scored completion inside a group. `reward_terms` maps reward function name to its value (None: excluded)."""

    completion: Completion
    reward: float
    advantage: float
    reward_terms: Mapping[str, float | None] = field(default_factory=dict)


@dataclass(frozen=True)
class Group:
    """One prompt and its surviving scored rollouts: the unit of admission, training and accounting.

    `seq` is the completion order (ties in the buffer break by it); `failed_rollouts` counts
    members that failed after their retries (they are not in `rollouts`).
    """

    prompt: Prompt
    rollouts: tuple[Rollout, ...]
    seq: int
    failed_rollouts: int = 0

    @cached_property
    def generation_version(self) -> int:
        return min(r.completion.generation_version for r in self.rollouts)

    def staleness_at(self, step: int) -> int:
        return step - self.generation_version


@dataclass(frozen=True)
class StepRecord:
    """Everything that happened in one step, for metrics and progress."""

    step: int
    batch: list[Group]
    train_metrics: dict[str, float]
    wait_s: float
    step_s: float
    weight_sync_s: float
    staleness: list[int]
