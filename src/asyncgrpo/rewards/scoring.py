"""Scoring a group's completions with the reward functions (resolved by rewards/resolve.py).

Convention (TRL's): a reward function is called with keyword arguments

    reward(prompts=[...], completions=[...], completion_ids=[...], **columns) -> list[float | None]

one prompt and one completion per entry: strings for text prompts; for conversational prompts
(chat messages) the prompt's message list and ``[{"role": "assistant", "content": text}]``, as
TRL does (so ``completion[0]["content"]`` is the text and `trl.rewards` functions work);
`completion_ids` each completion's token ids (a final stop token included, as TRL's; an episode's
are every token after the prompt, the environment's too, as TRL's tool loop passes them),
when the caller scores `Completion`s (training and evaluation do; plain texts have none); every
column of the prompt's row repeated as a list aligned with `completions`; and TRL's `trainer_state`,
`log_metric` and `log_extra` (rewards/trl_args.py: the step to schedule on; metrics that reach
metrics.jsonl and the sinks as `user/<name>`; columns written beside each completion in samples.jsonl,
`ScoredCompletion.extra`). A function whose signature has no ``**kwargs`` receives only the arguments
and columns it names. Functions may be sync or async (``async def``, or returning an awaitable).
None means "no opinion on this completion": it is excluded from that function's term.

Invariants:
- `RewardScorer.score` returns exactly one `ScoredCompletion` per completion, or raises
  `RewardError`. A function that raises (any BaseException but our own cancellation: SystemExit
  and KeyboardInterrupt included), outlives ``reward.timeout_s``, returns the wrong
  number of values, or a value that is not a finite real number is an error, reported with
  the function's name and one offending input, chained to the original exception; so is a
  weighted total that is not a finite number (naming every function's value and weight). An error
  never becomes a 0.0 reward; what to do with it (fail or drop the group) is the caller's
  policy.
- Cancelling `score` propagates as cancellation, never as a `RewardError`.
- Functions are called one after another, in config order, once per group.

Async functions (``async def``) run on a reward loop of their own, on a thread (rewards/async_loop.py),
under ``thread`` and ``process``: one that blocks its loop (``time.sleep`` in a coroutine) still
meets ``reward.timeout_s``, and the loop is then written off. Isolation of sync functions (``reward.isolation``):
- ``thread``: each call on one of up to ``reward.workers`` reusable daemon threads
  (asyncgrpo.threads.DaemonThreadPool), so a slow one blocks neither generation nor training.
  A call that times out is abandoned (Python cannot stop a thread) and its thread written off:
  a later call gets a new one, and no thread keeps the process from exiting; but one stuck in C
  code that holds the GIL (a catastrophic regex) starves the event loop for good. Waiting for a
  free thread is not part of ``reward.timeout_s``. `aclose` ends the idle threads.
- ``process``: each call in a worker process (rewards/pool.py) that re-resolves the functions by
  name. A call that times out has its worker killed (SIGKILL) and replaced; a worker that dies
  (segfault, os._exit) is a `RewardError` naming the function and the exit code. `aclose` ends
  the workers; the owner calls it on every exit path.
- ``inline`` (the simulator, on virtual time, no threads): every function runs on the loop and
  the timeout can only catch async functions that await.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from asyncgrpo.errors import ConfigError, RewardError
from asyncgrpo.rewards.async_loop import AsyncRewardLoop
from asyncgrpo.rewards.pool import RewardWorkerPool, WorkerCrashed, WorkerStartError
from asyncgrpo.rewards.resolve import resolve_rewards
from asyncgrpo.rewards.trl_args import TRL_ARGUMENTS, CallLog, RewardLog, TrainerState
from asyncgrpo.threads import DaemonThreadPool, PoolClosed
from asyncgrpo.types import Completion, Prompt

Message = Mapping[str, Any]

if TYPE_CHECKING:
    from asyncgrpo.config import RewardConfig

RESERVED_ARGUMENTS = ("prompts", "completions", "completion_ids", *TRL_ARGUMENTS)
Isolation = Literal["inline", "thread", "process"]


@dataclass(frozen=True)
class ScoredCompletion:
    """One completion's reward: the weighted total (None: no function gave a usable value), each function's value,
    and the columns the functions logged for it with `log_extra`."""

    reward: float | None
    terms: Mapping[str, float | None] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)


class RewardFunctionError(RewardError):
    """A `RewardError` that names the function and the input it failed on."""

    def __init__(self, message: str, *, function: str, prompt: str, completion: str) -> None:
        super().__init__(message)
        self.function = function
        self.prompt = prompt
        self.completion = completion


@dataclass(frozen=True)
class _Entry:
    index: int  # position in reward.functions, by which a worker process finds the function
    name: str
    fn: Callable[..., Any]
    weight: float
    is_async: bool
    accepted: frozenset[str] | None  # None: takes **kwargs, so every column


class RewardScorer:
    """Scores the completions of one group with every configured reward function."""

    def __init__(
        self,
        functions: Sequence[tuple[str, Callable[..., Any]]],
        weights: Sequence[float] | None = None,
        timeout_s: float = 30.0,
        isolation: Isolation = "thread",
        specs: Sequence[str] | None = None,
        workers: int = 4,
        trainer_state: Callable[[], TrainerState] = TrainerState,
    ) -> None:
        """`specs` (the ``reward.functions`` entries `functions` were resolved from) is used by
        ``isolation="process"`` only; `workers` is the most worker processes or threads (process, thread);
        `trainer_state` gives TRL's argument when a group is scored (the run's steps; a fresh TrainerState alone).
        With no function (an environment gives the reward) every completion scores None with no terms."""
        if weights is None:
            weights = [1.0] * len(functions)
        if len(weights) != len(functions):
            raise ConfigError(
                f"reward.weights has {len(weights)} values but reward.functions has {len(functions)}: give one weight "
                f"per function, or drop reward.weights to weigh each 1.0."
            )
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        entries = []
        seen: dict[str, int] = {}
        for index, ((name, fn), weight) in enumerate(zip(functions, weights)):
            if not math.isfinite(float(weight)):
                raise ConfigError(f"reward.weights: weight {weight!r} of {name!r} is not a finite number.")
            seen[name] = seen.get(name, 0) + 1
            unique = name if seen[name] == 1 else f"{name}_{seen[name]}"
            entries.append(_Entry(index, unique, fn, float(weight), _is_async(fn), _accepted_keywords(fn)))
        self._entries: tuple[_Entry, ...] = tuple(entries)
        self.timeout_s = float(timeout_s)
        self.log = RewardLog()  # what the functions' log_metric calls logged (drained once per step)
        self.trainer_state = trainer_state
        self.isolation = isolation
        self._pool: RewardWorkerPool | None = None
        self._threads: DaemonThreadPool | None = None
        self._async = AsyncRewardLoop() if isolation != "inline" and any(e.is_async for e in entries) else None
        if isolation == "process" and not all(e.is_async for e in entries):
            if specs is None or len(specs) != len(functions):
                raise ValueError("isolation='process' needs `specs`, one per function, for the workers to resolve them by")
            self._pool = RewardWorkerPool(specs, workers)
        elif isolation == "thread" and not all(e.is_async for e in entries):
            self._threads = DaemonThreadPool(workers, name="asyncgrpo-reward")

    @classmethod
    def from_config(cls, reward: RewardConfig, *, isolation: Isolation | None = None,
                    trainer_state: Callable[[], TrainerState] = TrainerState) -> RewardScorer:
        """The scorer of a ``reward`` config section; `isolation` overrides ``reward.isolation`` (the simulator's inline)."""
        return cls(
            resolve_rewards(reward.functions),
            reward.weights,
            reward.timeout_s,
            isolation=isolation or reward.isolation,
            specs=reward.functions,
            workers=reward.workers,
            trainer_state=trainer_state,
        )

    async def aclose(self) -> None:
        """End the worker processes or threads, if any (bounded); a later `score` raises RewardError."""
        if self._threads is not None:
            self._threads.close()
        if self._async is not None:
            self._async.close()
        if self._pool is not None:
            await self._pool.aclose()

    async def __aenter__(self) -> RewardScorer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def names(self) -> list[str]:
        """Function names, as used in `ScoredCompletion.terms` and the `reward/<name>` metrics."""
        return [e.name for e in self._entries]

    async def score(self, prompt: Prompt, completions: Sequence[Completion | str | list[Message]]) -> list[ScoredCompletion]:
        """Score `completions` of `prompt`; one result per completion, or `RewardError`. A `Completion` is scored on its
        text (an episode's on its messages) and its token ids; a text or a message list stands for itself, with no ids."""
        if not completions:
            return []
        shown = [reward_input(c) if isinstance(c, Completion) else c for c in completions]
        ids = [list(c.token_ids) for c in completions if isinstance(c, Completion)]
        state = self.trainer_state()
        calls = [await self._call(entry, prompt, shown, ids if len(ids) == len(shown) else None, state) for entry in self._entries]
        for _, log in calls:
            self.log.add(log)
        results = []
        for i in range(len(completions)):
            terms = {entry.name: values[i] for entry, (values, _) in zip(self._entries, calls)}
            used = [entry.weight * v for entry, v in zip(self._entries, terms.values()) if v is not None]
            total = finite_sum(used) if used else None
            if used and total is None:
                raise self._total_error(prompt, shown[i], terms)
            extra = {column: value for _, log in calls for column, value in log.extra_of(i).items()}
            results.append(ScoredCompletion(reward=total, terms=terms, extra=extra))
        return results

    def _total_error(self, prompt: Prompt, completion: str | list[Message], terms: Mapping[str, float | None]) -> RewardFunctionError:
        parts = ", ".join(f"{e.name} {terms[e.name]!r} x weight {e.weight:g}" for e in self._entries if terms[e.name] is not None)
        names = [e.name for e in self._entries if terms[e.name] is not None]
        text = completion if isinstance(completion, str) else repr(completion)
        return RewardFunctionError(
            f"reward functions {', '.join(map(repr, names))} gave a total that is not a finite number ({parts} does not fit a "
            f"float). Input: prompt {_clip(prompt.text)} (id {prompt.id}), completion {_clip(text)}. Fix: keep each "
            f"function's values and reward.weights small enough that their weighted sum stays finite (rewards on the "
            f"order of 1 are usual).",
            function=", ".join(names),
            prompt=prompt.text,
            completion=text,
        )

    async def _call(
        self, entry: _Entry, prompt: Prompt, completions: list[str | list[Message]], completion_ids: list[list[int]] | None = None,
        state: TrainerState | None = None,
    ) -> tuple[list[float | None], CallLog]:
        """One function on the group: its values and what it logged (TRL's log_metric / log_extra)."""
        n = len(completions)
        log = CallLog(n)
        kwargs: dict[str, Any] = {
            name: [value] * n
            for name, value in prompt.columns.items()
            if name not in RESERVED_ARGUMENTS and (entry.accepted is None or name in entry.accepted)
        }
        kwargs["prompts"], kwargs["completions"] = trl_shaped(prompt, completions)
        if completion_ids is not None and (entry.accepted is None or "completion_ids" in entry.accepted):
            kwargs["completion_ids"] = completion_ids
        if entry.accepted is None or "trainer_state" in entry.accepted:
            kwargs["trainer_state"] = state if state is not None else TrainerState()
        callbacks = tuple(name for name in ("log_metric", "log_extra") if entry.accepted is None or name in entry.accepted)
        if self._pool is None or entry.is_async:  # in this process: the call logs straight into `log`
            kwargs.update({name: getattr(log, name) for name in callbacks})
        deadline: asyncio.Timeout | None = None  # made when the call starts: asyncio.timeout fixes its deadline then
        try:
            if self._pool is not None and not entry.is_async:
                async with self._pool.worker() as worker:  # waiting for or starting a worker is not part of the deadline
                    async with (deadline := asyncio.timeout(self.timeout_s)):
                        result, records = await worker.call(entry.index, kwargs, callbacks)  # callbacks made in the worker
                        log.merge(records)
            elif self._threads is not None and not entry.is_async:
                async with self._threads.worker() as thread:  # waiting for a free thread is not part of the deadline
                    async with (deadline := asyncio.timeout(self.timeout_s)):
                        result = await _awaited(await thread.call(functools.partial(entry.fn, **kwargs)))
            elif self._async is not None and entry.is_async:
                async with (deadline := asyncio.timeout(self.timeout_s)):
                    result = await self._async.call(entry.fn, kwargs, deadline)
            else:
                async with (deadline := asyncio.timeout(self.timeout_s)):
                    result = await self._run(entry, kwargs)
        except WorkerStartError:
            raise
        except PoolClosed as exc:
            raise WorkerStartError(f"reward.isolation: {self.isolation}: the reward threads are closed (the run is ending).") from exc
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # our own cancellation (an expired deadline arrives as TimeoutError, below)
            raise self._error(entry, prompt, completions[0], f"raised {_describe(exc)} by itself",
                              "fix the function (the original traceback is chained below)") from exc
        except BaseException as exc:  # noqa: BLE001 - user code: SystemExit and KeyboardInterrupt are reward errors too
            if deadline is not None and deadline.expired():
                raise self._error(
                    entry,
                    prompt,
                    completions[0],
                    f"did not return within reward.timeout_s = {self.timeout_s:g} s for a group of {n} completions",
                    "make the function faster, or raise reward.timeout_s",
                ) from exc
            if isinstance(exc, WorkerCrashed):
                raise self._error(
                    entry,
                    prompt,
                    completions[0],
                    f"crashed its worker process: it {exc}",
                    "the function, or a library it calls, ended the process (a segfault, os._exit); call it on this "
                    "input outside asyncgrpo to see why. The worker was replaced",
                ) from exc
            raise self._error(
                entry,
                prompt,
                completions[0],
                f"raised {_describe(exc)}",
                "fix the function (the original traceback is chained below)",
            ) from exc
        return self._check(entry, prompt, completions, result), log

    async def _run(self, entry: _Entry, kwargs: dict[str, Any]) -> Any:
        """One call on the loop: awaited, or inline."""
        return await _awaited(await entry.fn(**kwargs) if entry.is_async else entry.fn(**kwargs))

    def _check(self, entry: _Entry, prompt: Prompt, completions: list[str | list[Message]], result: Any) -> list[float | None]:
        n = len(completions)
        contract = "return a list with one float (or None) per completion"
        if isinstance(result, (str, bytes, Mapping)) or not hasattr(result, "__len__") or not hasattr(result, "__iter__"):
            raise self._error(
                entry, prompt, completions[0], f"returned a {type(result).__name__}, not a list of {n} values", contract
            )
        values = list(result)
        if len(values) != n:
            raise self._error(
                entry, prompt, completions[0], f"returned {len(values)} values for {n} completions", contract
            )
        out: list[float | None] = []
        for i, value in enumerate(values):
            if value is None:
                out.append(None)
                continue
            number = _as_float(value)
            if number is None:
                raise self._error(
                    entry,
                    prompt,
                    completions[i],
                    f"returned {_short_repr(value)} ({type(value).__name__}) for completion {i}, not a number",
                    contract,
                )
            if not math.isfinite(number):
                raise self._error(
                    entry,
                    prompt,
                    completions[i],
                    f"returned {number!r} for completion {i}, which is not finite",
                    "return finite values, or None to exclude a completion",
                )
            out.append(number)
        return out

    @staticmethod
    def _error(entry: _Entry, prompt: Prompt, completion: str | list[Message], what: str, fix: str) -> RewardFunctionError:
        text = completion if isinstance(completion, str) else repr(completion)
        return RewardFunctionError(
            f"reward function {entry.name!r} {what}. Input: prompt {_clip(prompt.text)} (id {prompt.id}), "
            f"completion {_clip(text)}. Fix: {fix}.",
            function=entry.name,
            prompt=prompt.text,
            completion=text,
        )


def reward_input(completion: Completion) -> str | list[Message]:
    """What the reward functions get as a completion: the text, or an episode's messages."""
    return completion.text if completion.episode is None else [dict(m) for m in completion.episode.messages]


def trl_shaped(prompt: Prompt, completions: Sequence[str | list[Message]]) -> tuple[list[Any], list[Any]]:
    """`prompts` and `completions` as TRL passes them: strings for a text prompt; for a conversational
    prompt, its message list and ``[{"role": "assistant", "content": text}]`` per completion. An episode's
    completion (a message list: its assistant turns and the environment's observations) is passed as its
    messages, whatever the prompt. Every entry is a fresh list of plain dicts (a function that mutates one
    changes nothing else; they pickle)."""
    n = len(completions)
    prompts: list[Any] = [prompt.text] * n if prompt.messages is None else [[dict(m) for m in prompt.messages] for _ in range(n)]
    shaped: list[Any] = []
    for completion in completions:
        if not isinstance(completion, str):
            shaped.append([dict(m) for m in completion])
        elif prompt.messages is None:
            shaped.append(completion)
        else:
            shaped.append([{"role": "assistant", "content": completion}])
    return prompts, shaped


class UnscoredGroupError(RewardError):
    """Too few completions of a group got a score; the message names the functions that returned None.

    Not raised: it is the cause a `too_few_survivors` drop carries into the run's diagnostic."""


def unscored_group_error(prompt: Prompt, scored: Sequence[ScoredCompletion], needed: int) -> UnscoredGroupError:
    """Why fewer than `needed` of `scored` have a reward: each function's count of None, by name."""
    n = len(scored)
    names = list(scored[0].terms) if scored else []
    nones = {name: sum(s.terms[name] is None for s in scored) for name in names}
    parts = [
        f"{name!r} returned None for {'all ' + str(n) if count == n else f'{count} of {n}'} completions"
        for name, count in nones.items()
        if count
    ]
    have = sum(s.reward is not None for s in scored)
    return UnscoredGroupError(
        f"only {have} of {n} completions of prompt {_clip(prompt.text)} (id {prompt.id}) got a reward, fewer than "
        f"rollout.min_group_survivors = {needed}: reward function {', '.join(parts)}. None means no score (TRL's semantics): "
        f"a completion that no function scores is left out of training. Fix: return a number where the "
        f"function can judge (e.g. 0.0 for a wrong answer), or check why it cannot judge these completions."
    )


def finite_sum(parts: Sequence[float]) -> float | None:
    """The exact sum of `parts`, or None when it is not a finite float (math.fsum raises OverflowError on some overflows)."""
    try:
        total = math.fsum(parts)
    except OverflowError:
        return None
    return total if math.isfinite(total) else None


async def _awaited(result: Any) -> Any:
    """A sync function may return an awaitable (TRL allows it): its value."""
    return await result if inspect.isawaitable(result) else result


def _is_async(fn: Callable[..., Any]) -> bool:
    if inspect.iscoroutinefunction(fn):
        return True
    return inspect.iscoroutinefunction(type(fn).__call__) if callable(fn) else False


def _accepted_keywords(fn: Callable[..., Any]) -> frozenset[str] | None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        return None
    return frozenset(
        name
        for name, p in signature.parameters.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    )


def _as_float(value: Any) -> float | None:
    if isinstance(value, numbers.Real):
        return float(value)
    if getattr(value, "shape", None) in ((), []) and hasattr(value, "item"):  # numpy / torch 0-d
        item = value.item()
        if isinstance(item, numbers.Real):
            return float(item)
    return None


def _clip(text: str, limit: int = 200) -> str:
    text = str(text)
    if len(text) <= limit:
        return repr(text)
    return repr(text[:limit]) + f"... ({len(text)} chars)"


def _short_repr(value: Any, limit: int = 80) -> str:
    return _truncate(repr(value), limit)


def _describe(exc: BaseException) -> str:
    name = getattr(exc, "remote_type", type(exc).__name__)  # a worker's exception that could not be pickled
    message = _truncate(str(exc), 300)
    return f"{name}: {message}" if message else name


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
