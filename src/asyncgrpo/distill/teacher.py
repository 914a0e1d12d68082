"""The teacher: a causal LM on a thread it owns that scores the student's sampled tokens, in batches.

Job: `score(prompt, completions)` returns, per completion, log pi_teacher of each completion token given the
prompt and the tokens before it, at the sampling temperature (the trainer's own `token_logprobs`), while the
event loop, generation and training go on.

Design and invariants:
- **One thread.** `start()` creates it, `aclose()` stops and joins it (bounded, idempotent); the run that
  built the worker owns it. The thread sleeps on a `threading.Condition` whose predicate is "samples queued
  or closing"; nothing polls. Results go back with `loop.call_soon_threadsafe` and a `done()` guard.
- **A bounded queue.** At most `queue_size` samples wait; a caller waits for room on a `StateSignal` the thread
  notifies (through the loop) each time it takes a batch. The whole call, waiting for room included, is
  under `timeout_s`: past it the caller's samples leave the queue and it raises `TeacherTimeoutError`.
- **Batches.** The thread takes up to `batch_size` queued samples and scores them in one forward pass
  (prompts left-padded, completions right-padded, as the trainer collates them).
- **Errors, classified** (all `TeacherError`; `distill.on_error` decides between fatal and dropped): a sample
  that does not fit the teacher (a token id outside its vocabulary, longer than its positions) fails alone
  before it is queued; a forward pass that raises fails the samples of its batch, each with a fresh error
  chained to the cause, and the worker goes on; a worker that stopped (closed, or its thread died) fails
  every queued and later call, naming the cause.
- **Cancellation.** A cancelled caller (a stale sample, shutdown) withdraws its queued samples; a batch
  already running finishes and the results nobody awaits are dropped.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncgrpo.config import Config
from asyncgrpo.distill.teacher_path import load_teacher
from asyncgrpo.errors import ConfigError, TeacherError, TeacherTimeoutError
from asyncgrpo.models.device import resolve_device
from asyncgrpo.sampling import token_logprobs
from asyncgrpo.sync import StateSignal
from asyncgrpo.types import Completion, Prompt


def teacher_logprobs(model: Any, samples: Sequence[tuple[Sequence[int], Sequence[int]]], temperature: float, *,
                     pad_id: int = 0) -> list[list[float]]:
    """log pi_model of each completion token, for (prompt ids, completion ids) pairs, in one forward pass.

    Prompts are left-padded and completions right-padded, so every completion starts at the same column and
    only its C logits are needed; the tempered log-softmax is the trainer's (`token_logprobs`)."""
    scored = [i for i, (_, completion) in enumerate(samples) if completion]
    out: list[list[float]] = [[] for _ in samples]
    if not scored:
        return out
    device = next(model.parameters()).device
    width_p = max(len(samples[i][0]) for i in scored)
    width_c = max(len(samples[i][1]) for i in scored)
    length = width_p + width_c - 1
    inputs, attention, targets = [], [], []
    for i in scored:
        prompt, completion = samples[i]
        body = [*prompt, *completion[:-1]]
        left = width_p - len(prompt)
        right = length - left - len(body)
        inputs.append([pad_id] * left + body + [pad_id] * right)
        attention.append([0] * left + [1] * len(body) + [0] * right)
        targets.append([*completion] + [pad_id] * (width_c - len(completion)))
    mask = torch.tensor(attention, dtype=torch.long, device=device)
    kwargs: dict[str, Any] = {
        "input_ids": torch.tensor(inputs, dtype=torch.long, device=device),
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "use_cache": False,
    }
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = width_c
    with torch.no_grad():
        logits = model(**kwargs).logits[:, -width_c:, :]
        logp, _ = token_logprobs(logits, torch.tensor(targets, dtype=torch.long, device=device), temperature, with_entropy=False)
    rows = logp.float().cpu().tolist()
    for row, i in zip(rows, scored):
        out[i] = row[: len(samples[i][1])]
    return out


@dataclass(eq=False)
class _Job:
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    future: asyncio.Future[list[float]]
    loop: asyncio.AbstractEventLoop


def _resolve(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller gave up (timeout, cancellation)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _post(loop: asyncio.AbstractEventLoop, call: Any, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(call, *args)
    except RuntimeError:  # the loop is closed: nobody waits any more
        pass


class TeacherWorker:
    """Scores samples with `model` on one thread it owns; see the module docstring.

    `name` names the teacher in errors and the stall diagnostic; `pad_id` pads batches (never attended to)."""

    def __init__(self, model: Any, *, temperature: float, batch_size: int, queue_size: int, timeout_s: float,
                 name: str = "teacher", pad_id: int = 0, close_timeout_s: float = 30.0) -> None:
        if batch_size < 1 or queue_size < 1 or not timeout_s > 0 or not temperature > 0:
            raise ValueError(f"TeacherWorker needs batch_size, queue_size >= 1 and timeout_s, temperature > 0, got "
                             f"{batch_size}, {queue_size}, {timeout_s}, {temperature}")
        self.name = name
        self.temperature = temperature
        self.batch_size = batch_size
        self.queue_size = queue_size
        self.timeout_s = timeout_s
        self._model = model.eval().requires_grad_(False)
        self._pad_id = pad_id
        self._close_timeout_s = close_timeout_s
        self._vocab_size = model.get_input_embeddings().num_embeddings
        self._max_positions = getattr(model.config, "max_position_embeddings", None)
        self._cond = threading.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._running = 0  # samples in the batch being scored
        self._batches = 0
        self._room = StateSignal()  # loop side: the queue has room, the worker stopped, or its thread exited
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._exited = False  # set (under the lock) by the thread's last act
        self._failure: BaseException | None = None

    # ----------------------------------------------------------------- caller side (event loop)

    async def start(self) -> None:
        with self._cond:
            if self._closing:
                raise self._stopped_error()
            if self._thread is None:
                self._loop = asyncio.get_running_loop()
                self._thread = threading.Thread(target=self._run, name=f"asyncgrpo-teacher-{self.name}", daemon=True)
                self._thread.start()

    def state(self) -> str:
        """For the stall diagnostic: what the teacher holds now."""
        with self._cond:
            alive = self._thread is not None and not self._exited
            return (f"teacher {self.name}: {len(self._queue)} samples queued, {self._running} being scored, "
                    f"{self._batches} batches scored, thread {'running' if alive else 'stopped'}")

    async def score(self, prompt: Prompt, completions: Sequence[Completion]) -> list[list[float]]:
        """The teacher's log-probs of each completion's tokens; `TeacherError` (or `TeacherTimeoutError`) if it cannot."""
        for completion in completions:
            self._check_fits(prompt, completion)
        jobs: list[_Job] = []
        loop = asyncio.get_running_loop()
        deadline = asyncio.timeout(self.timeout_s)
        try:
            async with deadline:
                for completion in completions:
                    await self._room.wait_for(self._has_room)
                    with self._cond:
                        if self._closing:
                            raise self._stopped_error()
                        if self._thread is None:
                            raise TeacherError(f"teacher {self.name!r} is not started: await teacher.start() first.")
                        job = _Job(tuple(prompt.token_ids), tuple(completion.token_ids), loop.create_future(), loop)
                        self._queue.append(job)
                        jobs.append(job)
                        self._cond.notify_all()
                return [await job.future for job in jobs]
        except TimeoutError:
            if not deadline.expired():
                raise
            raise TeacherTimeoutError(
                f"teacher {self.name!r} did not score {len(completions)} sample(s) of prompt {prompt.id} within "
                f"distill.timeout_s = {self.timeout_s:g} s ({self.state()}). Fix: raise distill.timeout_s, or make the teacher "
                f"faster (distill.device, a smaller distill.batch_size), or lower generation.max_inflight."
            ) from None
        finally:
            with self._cond:
                for job in jobs:
                    if job in self._queue:
                        self._queue.remove(job)

    async def aclose(self) -> None:
        """Stop the thread (it finishes the batch it is scoring) and fail whatever is still queued; bounded."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        self._room.notify()
        if thread is None:
            return
        try:
            async with asyncio.timeout(self._close_timeout_s):
                await self._room.wait_for(self._has_exited)
        except TimeoutError:
            raise TeacherError(f"teacher {self.name!r} did not stop within {self._close_timeout_s:g} s: a forward pass is still "
                               f"running. Its thread is a daemon and will not block exit.") from None
        thread.join(timeout=self._close_timeout_s)  # the thread has already signalled its last act

    def _has_exited(self) -> bool:
        with self._cond:
            return self._exited

    def _has_room(self) -> bool:
        with self._cond:
            return self._closing or len(self._queue) < self.queue_size

    def _check_fits(self, prompt: Prompt, completion: Completion) -> None:
        ids = [*prompt.token_ids, *completion.token_ids]
        bad = [t for t in ids if not 0 <= t < self._vocab_size]
        if bad:
            raise TeacherError(
                f"prompt {prompt.id}: token ids {bad[:5]} are outside teacher {self.name!r}'s vocabulary of {self._vocab_size}: "
                f"the teacher must share the student's tokenizer. Fix: pick a teacher of the student's model family."
            )
        if completion.token_ids and not prompt.token_ids:
            raise TeacherError(f"prompt {prompt.id} has no tokens: the teacher cannot score a first token predicted from nothing.")
        if self._max_positions is not None and len(ids) > self._max_positions:
            raise TeacherError(
                f"prompt {prompt.id}: {len(ids)} prompt and completion tokens exceed teacher {self.name!r}'s "
                f"max_position_embeddings {self._max_positions}. Fix: lower data.max_prompt_tokens or generation.max_new_tokens."
            )

    def _stopped_error(self) -> TeacherError:
        """A fresh error per caller, chained to the thread's failure if it died."""
        if self._failure is None:
            return TeacherError(f"teacher {self.name!r} is closed; the sample was not scored.")
        error = TeacherError(
            f"teacher {self.name!r} stopped: its thread failed with {type(self._failure).__name__}: {self._failure}. "
            f"Every queued sample failed with it."
        )
        error.__cause__ = self._failure
        return error

    # ----------------------------------------------------------------- the teacher thread

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: bool(self._queue) or self._closing)
                    if self._closing:
                        return
                    batch = [self._queue.popleft() for _ in range(min(self.batch_size, len(self._queue)))]
                    self._running = len(batch)
                if self._loop is not None:
                    _post(self._loop, self._room.notify)
                self._score_batch(batch)
        except BaseException as exc:  # noqa: BLE001 - kept, and every waiting caller is failed with it
            self._failure = exc
        finally:
            with self._cond:
                self._closing = True
                pending = list(self._queue)
                self._queue.clear()
                self._running = 0
            for job in pending:
                _post(job.loop, _resolve, job.future, None, self._stopped_error())
            with self._cond:
                self._exited = True
            if self._loop is not None:
                _post(self._loop, self._room.notify)

    def _score_batch(self, batch: list[_Job]) -> None:
        try:
            rows = teacher_logprobs(self._model, [(j.prompt_ids, j.completion_ids) for j in batch], self.temperature, pad_id=self._pad_id)
            if not all(math.isfinite(v) for row in rows for v in row):
                raise FloatingPointError("the teacher's log-probs are not all finite (NaN or inf in its weights or logits)")
        except Exception as exc:  # noqa: BLE001 - classified: the batch's samples fail with it, the worker goes on
            for job in batch:
                error = TeacherError(
                    f"teacher {self.name!r} failed to score a batch of {len(batch)} samples: {type(exc).__name__}: {exc}"
                )
                error.__cause__ = exc
                _post(job.loop, _resolve, job.future, None, error)
        else:
            for job, row in zip(batch, rows):
                _post(job.loop, _resolve, job.future, row, None)
        finally:
            with self._cond:
                self._running = 0
                self._batches += 1


def build_teacher(cfg: Config, student_tokenizer: Any) -> TeacherWorker:
    """The recipe's teacher (`distill.*`) on `distill.device` (auto: train.device), not started.

    ConfigError when its vocabulary is not the student's: it would score other tokens than were sampled."""
    model, tokenizer = load_teacher(cfg)
    if tokenizer.get_vocab() != student_tokenizer.get_vocab():
        raise ConfigError(
            f"distill.teacher = {cfg.distill.teacher!r} has a vocabulary of {len(tokenizer.get_vocab())} tokens that differs from "
            f"the student's ({len(student_tokenizer.get_vocab())} tokens, model.path = {cfg.model.path!r}): it would score other "
            f"tokens than the student sampled. Fix: pick a teacher that shares the student's tokenizer (the same model family)."
        )
    d = cfg.distill
    device = resolve_device(d.device if d.device != "auto" else cfg.train.device, key="distill.device")
    return TeacherWorker(
        model.to(device), temperature=cfg.generation.temperature, batch_size=d.batch_size, queue_size=d.queue_size,
        timeout_s=d.timeout_s, name=d.teacher, pad_id=tokenizer.pad_token_id or 0,
    )
