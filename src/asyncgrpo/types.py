"""Small frozen carriers that flow through the pipeline.

PromptSource -> Prompt -> (Generator) Completion -> (Rewards) Rollout -> Group -> Trainer -> StepRecord.

Invariants:
- Every carrier is immutable; stages build new ones instead of mutating.
- A `Completion` carries one policy version per generated token (`versions`), so the
  generation version of a group is the minimum over all its tokens (DESIGN.md §1). The
  completion of a multi-turn episode also holds the environment's tokens, marked out by
  `loss_mask`; its generation version is the minimum over the model's tokens only.
- `DropReason` is the closed set of reasons a taken prompt can end without training; the
  accounting object always reports every one of them. A `Drop` carries one, and the error that
  stands for it in the failure policy (None for `filtered`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # sampling.py needs torch; this module does not
    from asyncgrpo.sampling import Processing

DropReason = Literal["stale", "failed", "too_few_survivors", "invalid_prompt", "filtered", "reward_error"]
DROP_REASONS: tuple[DropReason, ...] = (
    "stale",
    "failed",
    "too_few_survivors",
    "invalid_prompt",
    "filtered",
    "reward_error",
)


@dataclass(frozen=True)
class Drop:
    """The group ends without training: why, and the error that stands for it."""

    reason: DropReason
    error: BaseException | None


FinishReason = Literal["stop", "length"]

# How an episode ended (environments/protocol.py). Only done, max_turns and max_tokens end in a
# sample; a cancelled episode leaves no sample and an env_error one fails its rollout.
EpisodeStop = Literal["done", "max_turns", "max_tokens", "cancelled", "env_error"]


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
    """How to sample one completion. `temperature >= 0` (0 = greedy); stop tokens end the completion and are kept in it.

    `top_k` (0: off), `top_p` (1: off), `min_p` (0: off) and `repetition_penalty` (1: off) have vLLM's,
    transformers' and TRL's meanings; sampling.py applies them (the order and the exact rules are there)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def processing(self) -> Processing:
        """The logits processing of this distribution (sampling.py)."""
        from asyncgrpo.sampling import Processing

        return Processing(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                          repetition_penalty=self.repetition_penalty)


class TokenSink:
    """Where a backend records a request's tokens as it generates them (`rollout.on_stale: resume`), so an interrupted
    request loses none: the resumption runner (rollout/resumption.py) reads what the current attempt generated. The retry
    loop (rollout/retry.py) empties it before each attempt and after a failed one (a failed attempt's tokens are not the
    prefix of its retry); the backend only appends. `text` is the text of
    those tokens as far as the backend decoded it (an HTTP server streams it; a backend without text leaves it empty)."""

    __slots__ = ("token_ids", "logprobs", "versions", "text")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.text: list[str] = []

    def extend(self, token_ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int], text: str = "") -> None:
        if not (len(token_ids) == len(logprobs) == len(versions)):
            raise ValueError(f"TokenSink.extend got {len(token_ids)} ids, {len(logprobs)} logprobs, {len(versions)} versions")
        self.token_ids.extend(token_ids)
        self.logprobs.extend(logprobs)
        self.versions.extend(versions)
        if text:
            self.text.append(text)

    def empty(self) -> None:
        self.token_ids.clear()
        self.logprobs.clear()
        self.versions.clear()
        self.text.clear()

    def __len__(self) -> int:
        return len(self.token_ids)


class Affinity:
    """A session's token: the requests that carry the same one go to the same server while it can take work (an agent
    session's turns: generation/http.py). A backend keys what it remembers of it weakly: it is forgotten with the session.
    `name` says whose it is (in log lines)."""

    __slots__ = ("name", "__weakref__")

    def __init__(self, name: str) -> None:
        self.name = name


@dataclass(frozen=True)
class GenerationRequest:
    """One completion request sent to a `Generator` (one rollout is one request).

    `seed` makes sampling reproducible per request; `prompt_id` lets scripted backends
    inject faults for given prompts. A resumed request (`rollout.on_stale: resume`) continues an
    interrupted rollout: the last `resumed_tokens` of `prompt_token_ids` are the rollout's own
    earlier tokens and `sampling.max_new_tokens` is the budget left; its completion is the
    continuation only. `sink` (None: the caller does not resume) receives each generated token. `affinity` (None: any
    server) is the session the request belongs to: a backend with several servers sends a session's requests to one.
    """

    request_id: str
    prompt_id: int
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    seed: int
    resumed_tokens: int = 0
    sink: TokenSink | None = field(default=None, compare=False, repr=False)
    affinity: Affinity | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Episode:
    """What a multi-turn episode adds to its `Completion`.

    `messages`: the conversation after the prompt (assistant turns and the environment's
    observations, in order); `turns`: model generations; `env_reward`: the sum of the
    environment's step rewards (None: no step gave one); `version_span`: the lowest and highest
    policy version of the model's tokens; `drift_turns`: turns whose ids (as sampled) were not a
    prefix of the chat template's rendering of the history (the ids were kept, never re-rendered);
    `step_rewards`: each step's reward, in turn order (what a non-finite `env_reward` is reported from).
    """

    messages: tuple[Mapping[str, Any], ...]
    turns: int
    stop_reason: EpisodeStop
    env_reward: float | None
    version_span: tuple[int, int]
    drift_turns: int = 0
    info: tuple[Mapping[str, Any], ...] = ()
    step_rewards: tuple[float | None, ...] = ()


@dataclass(frozen=True)
class Completion:
    """What a generator returns for one request.

    Shapes: `token_ids`, `logprobs` and `versions` all have length T (generated tokens,
    including a final stop token if one was sampled). `logprobs[t]` is log pi_gen of
    `token_ids[t]` under the distribution actually sampled: after repetition penalty and temperature,
    renormalised over the support top-k / top-p / min-p kept (sampling.py); the trainer scores the
    same distribution of its own logits;
    `versions[t]` is the policy version whose weights produced token t.
    `dispatch_version` is the serving version when the request was dispatched; it stands
    in for the generation version of an empty completion.

    An episode's completion (`episode` set) holds every token after the prompt: the model's,
    exactly as sampled, and the environment's, with `loss_mask` False (their logprobs are 0.0
    and their version is that of the model token before them). Only masked-in tokens are
    trained, and only they count for the generation version.

    `segments`: an agent episode split where its agent rewrote its history (`env.agent_history: split`,
    agents/session.py): its earlier samples, each a completion of its own prompt (`prompt_token_ids`) trained as a
    sequence of its own with this rollout's advantage; this completion is the last sample. They count for the
    generation version and the model's tokens as this completion's own tokens do.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish_reason: FinishReason
    dispatch_version: int
    text: str = ""
    loss_mask: tuple[bool, ...] | None = None  # None: every token is the model's
    episode: Episode | None = None
    prompt_token_ids: tuple[int, ...] | None = None  # an episode whose reset observation joined its prompt: that prompt
    segments: tuple[Completion, ...] = ()

    def __post_init__(self) -> None:
        if not (len(self.token_ids) == len(self.logprobs) == len(self.versions)):
            raise ValueError(
                f"Completion fields disagree in length: {len(self.token_ids)} token_ids, "
                f"{len(self.logprobs)} logprobs, {len(self.versions)} versions"
            )
        if self.loss_mask is not None and len(self.loss_mask) != len(self.token_ids):
            raise ValueError(f"Completion loss_mask has {len(self.loss_mask)} entries for {len(self.token_ids)} tokens")

    @cached_property  # read on every staleness check: a min over the tokens once, not per read
    def generation_version(self) -> int:
        """Lowest policy version that produced any of the model's tokens of this completion (its segments' included)."""
        if self.loss_mask is None:
            own = min(self.versions, default=self.dispatch_version)
        else:
            own = min((v for v, m in zip(self.versions, self.loss_mask) if m), default=self.dispatch_version)
        return min((own, *(s.generation_version for s in self.segments)))

    @property
    def model_tokens(self) -> int:
        """Tokens the model generated (an episode's environment tokens excluded, its segments' included)."""
        own = len(self.token_ids) if self.loss_mask is None else sum(self.loss_mask)
        return own + sum(s.model_tokens for s in self.segments)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass(frozen=True)
class Rollout:
    """A scored completion inside a group. `reward_terms` maps reward function name to its value (None: excluded).

    `teacher_logprobs` (`algorithm: distill`): log pi_teacher of each of `completion.token_ids`, at the
    sampling temperature; one per token, like `completion.logprobs`."""

    completion: Completion
    reward: float
    advantage: float
    reward_terms: Mapping[str, float | None] = field(default_factory=dict)
    teacher_logprobs: tuple[float, ...] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)  # columns reward functions logged for it (TRL's log_extra)

    def __post_init__(self) -> None:
        if self.teacher_logprobs is not None and len(self.teacher_logprobs) != len(self.completion.token_ids):
            raise ValueError(
                f"Rollout has {len(self.teacher_logprobs)} teacher logprobs for {len(self.completion.token_ids)} completion tokens"
            )


@dataclass(frozen=True)
class Group:
    """One prompt and its surviving scored rollouts: the unit of admission, training and accounting.

    `seq` is the completion order (ties in the buffer break by it); `failed_rollouts` counts
    members that failed after their retries (they are not in `rollouts`); `generation_ms` is the
    generator time of its `rollouts` (each from its start to its end, retries included).
    """

    prompt: Prompt
    rollouts: tuple[Rollout, ...]
    seq: int
    failed_rollouts: int = 0
    generation_ms: int = 0
    target_step: int | None = None  # rollout.on_stale: wait: the step that trains it
    max_staleness: int | None = None  # rollout.max_prefix_staleness: a resumed group's bound, when not rollout.max_staleness

    @cached_property
    def generation_version(self) -> int:
        """The oldest version of a trained token: over the rollouts with a loss token (`rollout.on_stale: resume` may mask
        every token of one), or over all when none has."""
        trained = [r.completion.generation_version for r in self.rollouts if r.completion.loss_mask is None or any(r.completion.loss_mask)]
        return min(trained or [r.completion.generation_version for r in self.rollouts])

    def staleness_at(self, step: int) -> int:
        return step - self.generation_version

    def bound(self, max_staleness: int) -> int:
        """The most steps its trained tokens may be old: its own bound (a resumed group's), or the run's `max_staleness`."""
        return max_staleness if self.max_staleness is None else self.max_staleness


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
