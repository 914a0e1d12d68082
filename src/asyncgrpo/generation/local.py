"""The in-process generation engine: batched KV-cache sampling on one thread it owns.

Job: turn `GenerationRequest`s into `Completion`s with any transformers causal LM that accepts a
`DynamicCache`, while the event loop (and the trainer) keep running.

Design and invariants:
- **Waves.** The engine thread takes up to `max_batch_size` queued requests and decodes them
  together (left padding, attention mask, explicit position ids) until every row has stopped.
  Requests that arrive meanwhile wait for the next wave; they do not join the running batch.
  Rows that stop or are cancelled leave the batch at the next step boundary
  (`DynamicCache.batch_select_indices`), so they cost no more compute.
- **One thread.** `start()` creates it, `aclose()` stops and joins it (bounded, idempotent). It
  sleeps on a `threading.Condition` whose predicate is "work queued, weights queued or closing";
  nothing polls. Futures are resolved with `loop.call_soon_threadsafe` and a `done()` guard, so a
  cancelled future is never set.
- **Weights.** `load_weights` queues a state dict; the thread copies it into its parameters
  between two steps (under `torch.no_grad`) and only then reports the new `serving_version`. Or it
  queues a `WeightUpdate`, which the thread calls there with the parameters to write in place; what
  it raises fails the load (the version stays), and it must then have left the parameters as they were.
  Active rows are then re-prefilled with the new weights (prompt + tokens so far), so every later
  token's logprob is exactly log pi_new(token | prefix); `versions[t]` is the version whose
  forward pass produced token t. The engine owns the model passed to it (eval mode, no grads);
  the caller must not mutate `state` until `load_weights` returns.
- **Sampling.** Each row samples with its own `torch.Generator` seeded from `request.seed`, so a
  request is reproducible (bit for bit in the same batch composition; other batch shapes may
  differ by float rounding). Rows sample from their request's distribution (sampling.py: repetition
  penalty, temperature, min-p, top-k, top-p) and `logprobs` are log q of that distribution,
  renormalised over the kept support, the one the trainer scores; `temperature == 0` is greedy (after
  the repetition penalty) with logprobs at T = 1. A sampled stop token ends the row and is kept in
  `token_ids`; `text` drops it.
- **Sinks.** A request with a `TokenSink` gets each decoding step's token appended to it on its own
  loop (one callback per step, posted before any result of that step: a caller sees every token in
  its sink before its completion; `asyncgrpo serve` streams them), and none once it has ended.
- **Errors.** An exception on the engine thread fails every queued and active request (and any
  queued weight load) with a fresh, non-transient `GenerationError` chained to it; the engine is
  then closed and every later call raises at once, naming the cause. Bad prompts (empty, unknown
  ids, too long for the model) raise `PromptRejectedError` before they reach the thread.
- **Close.** `aclose` fails what is still queued or active with `GenerationError` ("closed"):
  cancel your requests first if they must not count as failures.
Text is decoded on the caller's event loop, never on the engine thread (fast tokenizers raise
"Already borrowed" when two threads use one).
- **Device and dtype.** The engine runs where its model's parameters are; `serving_copy` (serving_copy.py) builds
  that model in the serving dtype (`model.dtype`) on the engine's device (`generation.local.device`)
  without a float32 intermediate, and weight loads cast and move each tensor as they copy it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from asyncgrpo.errors import GenerationError, PromptRejectedError
from asyncgrpo.sampling import Processing, processed_logits
from asyncgrpo.types import Completion, GenerationRequest

StepHook = Callable[[dict[str, int]], None]
WeightUpdate = Callable[[Mapping[str, torch.Tensor]], None]  # writes weights() in place (module docstring, Weights)


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # cancelled, or already failed by shutdown
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _post(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
    try:
        loop.call_soon_threadsafe(_resolve, future, result, error)
    except RuntimeError:  # the loop is closed: nobody can await this future any more
        pass


def _deliver(tokens: list[tuple[_Job, int, float]], version: int) -> None:
    """Append one decoding step's tokens to their requests' sinks (on their loop); an ended request's sink takes none."""
    for job, token, logprob in tokens:
        if not job.cancelled and job.request.sink is not None:  # ended: its sink may already be the next attempt's
            job.request.sink.extend((token,), (logprob,), (version,))


@dataclass(eq=False)
class _Job:
    request: GenerationRequest
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    dispatch_version: int
    cancelled: bool = False
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    rng: torch.Generator | None = None


@dataclass(eq=False)
class _WeightLoad:
    state: Mapping[str, Any] | WeightUpdate | None
    version: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class LocalEngine:
    """In-process `Generator` over a causal LM it owns. See the module docstring for the design.

    `tokenizer` (optional) only decodes `Completion.text`. `version` is the serving version of the
    weights passed in. `step_hook(stats)` runs on the engine thread after every decoding step
    (results of that step already posted), with the same counters as `stats()`; tests use it to
    synchronise. `close_timeout_s` bounds `aclose`.
    """

    continues_in_flight = True  # rollout.on_stale: resume: weights change between decoding steps, a rollout continues in place

    def __init__(self, model: Any, tokenizer: Any = None, *, name: str = "local", max_batch_size: int = 64,
                 version: int = 0, step_hook: StepHook | None = None, close_timeout_s: float = 30.0) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.name = name
        self._model = model.eval().requires_grad_(False)
        self._tokenizer = tokenizer
        self._max_batch_size = max_batch_size
        self._step_hook = step_hook
        self._close_timeout_s = close_timeout_s
        self._device = next(model.parameters()).device
        self._vocab_size = model.get_input_embeddings().num_embeddings
        self._max_positions = getattr(model.config, "max_position_embeddings", None)
        self._targets = model.state_dict(keep_vars=True)  # tied aliases appear under every name
        forward_params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
        self._keep_last_logits = "logits_to_keep" in forward_params
        self._cond = threading.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._loads: collections.deque[_WeightLoad] = collections.deque()
        self._rows: list[_Job] = []  # the running wave; touched only by the engine thread
        self._taking: list[_WeightLoad] = []  # loads being applied; engine thread only
        self._exit_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._version = version
        self._requested_version = version
        self._counters = {"steps": 0, "waves": 0, "tokens_generated": 0}
        self._active = 0
        self._thread: threading.Thread | None = None
        self._closing = False
        self._exited = False
        self._failure: BaseException | None = None

    # ----------------------------------------------------------------- caller side (event loop)

    @property
    def serving_version(self) -> int:
        return self._version

    @property
    def failure(self) -> BaseException | None:
        """The exception that killed the engine thread, if any (the engine is then closed)."""
        return self._failure

    def stats(self) -> dict[str, int]:
        """Snapshot: active rows, queued requests, queued weight loads, steps, waves, tokens generated."""
        with self._cond:
            return {"active": self._active, "queued": len(self._queue), "pending_weight_loads": len(self._loads),
                    "serving_version": self._version, **self._counters}

    async def start(self) -> None:
        with self._cond:
            if self._closing:
                raise self._closed_error()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"asyncgrpo-engine-{self.name}", daemon=True)
                self._thread.start()

    async def generate(self, request: GenerationRequest) -> Completion:
        self._validate(request)
        loop = asyncio.get_running_loop()
        with self._cond:
            if self._closing:
                raise self._closed_error()
            if self._thread is None:
                raise GenerationError(f"local engine {self.name!r} is not started: await engine.start() first.", backend=self.name)
            job = _Job(request, loop.create_future(), loop, self._version)
            self._queue.append(job)
            self._cond.notify_all()
        try:
            tokens, logprobs, versions, reason = await job.future
        finally:
            with self._cond:
                job.cancelled = True  # no-op if it finished; otherwise it leaves the batch at the next step
                if job in self._queue:
                    self._queue.remove(job)
        body = tokens[:-1] if reason == "stop" else tokens
        text = self._tokenizer.decode(body, skip_special_tokens=True) if self._tokenizer is not None else ""
        return Completion(tuple(tokens), tuple(logprobs), tuple(versions), reason, job.dispatch_version, text)

    def weights(self) -> Mapping[str, Any]:
        """The live parameters by name (tied aliases under every name): read them, never write them (`load_weights` does)."""
        return self._targets

    async def load_weights(self, state: Mapping[str, Any] | WeightUpdate | None, version: int) -> None:
        """Install `state` (parameter name -> tensor; None: same weights; or a WeightUpdate) as `version`; returns once it serves.

        Cancelling the call withdraws the load only if the engine thread has not taken it yet.
        """
        if version < self._requested_version:
            raise ValueError(
                f"load_weights: version {version} is older than version {self._requested_version} already loaded or queued; "
                f"versions must not decrease."
            )
        if state is not None and not callable(state):
            self._check_state(state)
        loop = asyncio.get_running_loop()
        load = _WeightLoad(state, version, loop.create_future(), loop)
        with self._cond:
            if self._closing:
                raise self._closed_error()
            self._requested_version = version
            started = self._thread is not None
            if started:
                self._loads.append(load)
                self._cond.notify_all()
        if not started:  # no engine thread yet: nothing else touches the model
            self._apply([load])
        try:
            await load.future
        finally:
            with self._cond:
                if load in self._loads:  # cancelled before the thread took it
                    self._loads.remove(load)

    async def aclose(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread, exited = self._thread, self._exited
            if thread is not None and not exited:
                waiter = asyncio.get_running_loop().create_future()
                self._exit_waiters.append((asyncio.get_running_loop(), waiter))
        if thread is None:
            self._shutdown(None)
            return
        if not exited:
            try:
                async with asyncio.timeout(self._close_timeout_s):
                    await waiter
            except TimeoutError:
                raise GenerationError(
                    f"local engine {self.name!r} did not stop within {self._close_timeout_s:g} s: a forward pass is "
                    f"still running. Its thread is a daemon and will not block exit.", backend=self.name) from None
        thread.join(timeout=self._close_timeout_s)  # the thread has already signalled its last act

    def _validate(self, request: GenerationRequest) -> None:
        s, prompt = request.sampling, request.prompt_token_ids
        if (s.max_new_tokens < 1 or not (math.isfinite(s.temperature) and s.temperature >= 0) or not (0 < s.top_p <= 1)
                or s.top_k < 0 or not (0 <= s.min_p <= 1) or not (math.isfinite(s.repetition_penalty) and s.repetition_penalty > 0)):
            raise ValueError(f"request {request.request_id}: invalid sampling {s}: need max_new_tokens >= 1, temperature >= 0, "
                             f"0 < top_p <= 1, top_k >= 0, 0 <= min_p <= 1, repetition_penalty > 0.")
        if not prompt:
            raise PromptRejectedError(f"request {request.request_id}: the prompt is empty.", backend=self.name)
        bad = [t for t in prompt if not 0 <= t < self._vocab_size]
        if bad:
            raise PromptRejectedError(
                f"request {request.request_id}: token ids {bad[:5]} are outside the model's vocabulary of {self._vocab_size}.",
                backend=self.name,
            )
        if self._max_positions is not None and len(prompt) + s.max_new_tokens > self._max_positions:
            raise PromptRejectedError(
                f"request {request.request_id}: prompt of {len(prompt)} tokens + max_new_tokens {s.max_new_tokens} exceeds "
                f"the model's max_position_embeddings {self._max_positions}. Fix: lower data.max_prompt_tokens or "
                f"generation.max_new_tokens.", backend=self.name)

    def _check_state(self, state: Mapping[str, Any]) -> None:
        unknown = [k for k in state if k not in self._targets]
        wrong = [f"{k}: {tuple(v.shape)} vs {tuple(self._targets[k].shape)}" for k, v in state.items()
                 if k in self._targets and tuple(v.shape) != tuple(self._targets[k].shape)]
        covered = {id(self._targets[k]) for k in state if k in self._targets}
        missing = [k for k, v in self._targets.items() if id(v) not in covered]
        if unknown or wrong or missing:
            raise ValueError(f"load_weights: the state dict does not match the engine's model: unknown keys {unknown[:5]}, "
                             f"shape mismatches {wrong[:5]}, missing keys {missing[:5]}.")

    def _closed_error(self) -> GenerationError:
        """A fresh error per caller (never one instance raised twice), chained to the thread's failure."""
        if self._failure is None:
            return GenerationError(f"local engine {self.name!r} is closed; the request was not completed.", backend=self.name)
        cause = self._failure
        error = GenerationError(
            f"local engine {self.name!r} failed on its decoding thread with {type(cause).__name__}: {cause}. "
            f"Every queued and active request failed with it and the engine is closed; fix the cause and "
            f"start a new engine.", backend=self.name)
        error.__cause__ = cause
        return error

    # ----------------------------------------------------------------- engine thread

    def _run(self) -> None:
        failure: BaseException | None = None
        try:
            with torch.no_grad():
                while True:
                    with self._cond:
                        self._cond.wait_for(lambda: self._closing or self._queue or self._loads)
                        if self._closing:
                            return
                        self._taking = list(self._loads)
                        self._loads.clear()
                        count = min(len(self._queue), self._max_batch_size)
                        self._rows = [self._queue.popleft() for _ in range(count)]
                        self._active = count
                    self._apply(self._taking)
                    self._taking = []
                    if self._rows:
                        self._decode_wave()
        except BaseException as exc:  # reported to every waiter below, never swallowed
            failure = exc
        finally:
            self._shutdown(failure)

    def _shutdown(self, failure: BaseException | None) -> None:
        with self._cond:
            self._closing = True
            if failure is not None and self._failure is None:
                self._failure = failure
            pending = [(j.loop, j.future) for j in [*self._rows, *self._queue]]
            pending += [(w.loop, w.future) for w in [*self._taking, *self._loads]]
            self._rows, self._taking = [], []
            self._queue.clear()
            self._loads.clear()
            self._active = 0
            self._exited = True
            waiters, self._exit_waiters = self._exit_waiters, []
            errors = [self._closed_error() for _ in pending]
        for (loop, future), error in zip(pending, errors):
            _post(loop, future, error=error)
        for loop, future in waiters:
            _post(loop, future, result=None)

    def _apply(self, loads: list[_WeightLoad]) -> None:
        for load in loads:
            if callable(load.state):
                try:
                    load.state(self._targets)
                except Exception as exc:  # noqa: BLE001 - the update refused (weights unchanged): its caller's error
                    _post(load.loop, load.future, error=exc)
                    continue
            elif load.state is not None:
                with torch.no_grad():
                    for key, value in load.state.items():
                        self._targets[key].copy_(value)
            with self._cond:
                self._version = load.version
            _post(load.loop, load.future)

    def _forward(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        kwargs = {"logits_to_keep": 1} if self._keep_last_logits else {}
        out = self._model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                          use_cache=True, **{self._cache_kwarg: cache}, **kwargs)
        return out.logits[:, -1, :].float()

    def _prefill(self, rows: list[_Job]) -> tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor]:
        seqs = [list(j.request.prompt_token_ids) + j.tokens for j in rows]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, seq in enumerate(seqs):
            ids[i, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
            mask[i, width - len(seq):] = 1
        ids, mask = ids.to(self._device), mask.to(self._device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self._model.config)
        return self._forward(ids, mask, positions, cache), cache, mask, positions[:, -1]

    def _sample(self, rows: list[_Job], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """One token per row from its sampling distribution (sampling.py): argmax (T = 0) or inverse-CDF
        sampling with the row's own generator; the token's log q under that distribution."""
        processed = torch.empty_like(logits, dtype=torch.float32)
        by_processing: dict[Processing, list[int]] = {}
        for i, job in enumerate(rows):
            by_processing.setdefault(job.request.sampling.processing, []).append(i)
        for processing, members in by_processing.items():
            index = torch.tensor(members, device=logits.device)
            seen = self._seen([rows[i] for i in members]) if processing.penalises else None
            processed[index] = processed_logits(logits[index], processing, seen=seen)
        logq = torch.log_softmax(processed, dim=-1)
        chosen = logq.argmax(dim=-1)
        sampled = [i for i, j in enumerate(rows) if j.request.sampling.temperature > 0]
        if sampled:
            index = torch.tensor(sampled, device=logits.device)
            cdf = logq[index].exp().double().cumsum(-1)  # tokens outside the kept support have probability 0
            uniforms = torch.cat([self._uniform(rows[i]) for i in sampled])
            total = cdf[:, -1]
            target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
            # first index whose cdf exceeds the target: always a token of positive probability
            chosen[index] = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
        return chosen.tolist(), logq.gather(1, chosen[:, None]).squeeze(1).tolist()

    def _seen(self, rows: list[_Job]) -> torch.Tensor:
        """Bool `[rows, V]`: the tokens of each row's context (prompt and tokens so far), for the repetition penalty."""
        seen = torch.zeros(len(rows), self._vocab_size, dtype=torch.bool, device=self._device)
        for i, job in enumerate(rows):
            seen[i, torch.tensor([*job.request.prompt_token_ids, *job.tokens], dtype=torch.long, device=self._device)] = True
        return seen

    def _uniform(self, job: _Job) -> torch.Tensor:
        if job.rng is None:
            job.rng = torch.Generator(device=self._device).manual_seed(job.request.seed & 0xFFFF_FFFF_FFFF_FFFF)
        return torch.rand(1, generator=job.rng, dtype=torch.float64, device=self._device)

    def _decode_wave(self) -> None:
        rows = self._rows
        with self._cond:
            self._counters["waves"] += 1
        prefill = True
        cache: Any = None
        next_ids: torch.Tensor | None = None  # the last sampled token of each row, fed to the next decode step
        while rows:
            if prefill:
                logits, cache, mask, last_pos = self._prefill(rows)
                prefill = False
            else:
                mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
                last_pos = last_pos + 1
                assert next_ids is not None  # set at the end of every step that keeps rows without a new prefill
                logits = self._forward(next_ids[:, None], mask, last_pos[:, None], cache)
            version = self._version  # only this thread changes it
            tokens, logprobs = self._sample(rows, logits)
            keep, done = [], []
            for i, (job, token, logprob) in enumerate(zip(rows, tokens, logprobs)):
                job.tokens.append(token)
                job.logprobs.append(logprob)
                job.versions.append(version)
                s = job.request.sampling
                if token in s.stop_token_ids:
                    done.append((job, "stop"))
                elif len(job.tokens) >= s.max_new_tokens:
                    done.append((job, "length"))
                else:
                    keep.append(i)
            with self._cond:  # counters first, so a caller that sees its result sees them too
                self._counters["steps"] += 1
                self._counters["tokens_generated"] += len(rows)
                self._active = len(keep)
                snapshot = {"active": len(keep), "queued": len(self._queue), **self._counters}
            streamed = [(job, token, logprob) for job, token, logprob in zip(rows, tokens, logprobs) if job.request.sink is not None]
            for loop in {job.loop for job, _, _ in streamed}:  # before the results: every token is in its sink first
                with contextlib.suppress(RuntimeError):  # a closed loop: nobody reads its sinks
                    loop.call_soon_threadsafe(_deliver, [t for t in streamed if t[0].loop is loop], version)
            for job, reason in done:
                _post(job.loop, job.future, (job.tokens, job.logprobs, job.versions, reason))
            if self._step_hook is not None:
                self._step_hook(snapshot)
            with self._cond:  # step boundary: cancellations, weight loads, close
                if self._closing:
                    self._rows = [rows[i] for i in keep]
                    return
                keep = [i for i in keep if not rows[i].cancelled]
                self._taking = list(self._loads)
                self._loads.clear()
                self._active = len(keep)
            if self._taking:
                self._apply(self._taking)
                self._taking = []
                prefill = True  # recompute the cache with the new weights
            if len(keep) < len(rows) and keep and not prefill:
                index = torch.tensor(keep, device=mask.device)
                cache.batch_select_indices(index)
                mask, last_pos = mask[index], last_pos[index]
            rows = self._rows = [rows[i] for i in keep]
            if rows and not prefill:
                next_ids = torch.tensor([j.tokens[-1] for j in rows], device=mask.device)
        self._rows = []
