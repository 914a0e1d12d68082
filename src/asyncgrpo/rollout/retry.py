"""One request's generation under the failure policy: classified retries with backoff, under deadlines.

Used by the collector for rollouts and by evaluation, so both treat a backend the same way:
- a `TransientGenerationError` (refused, reset, 429, 5xx, an attempt past `request_timeout_s`)
  is retried after a jittered exponential delay (`retry_backoff_s` doubling to
  `retry_backoff_max_s`), as long as the retry can start before `rollout_deadline_s` runs out;
  then `RolloutDeadlineError` names the attempts and the last error;
- anything else (a rejected prompt, a fatal backend error, a bug) propagates at once;
- every attempt is bounded by `min(request_timeout_s, time left)`: by the caller's `SharedTimeout` of
  `request_timeout_s` (one loop timer for all its attempts) while the rollout deadline is farther than
  that, by an `asyncio.timeout` of its own once it is nearer (or without a shared one).

The caller decides what happens between attempts (`between_attempts(delay)`: the collector frees
its request slot while it waits) and is told of each retry (`on_retry(error)`). A request's `TokenSink`
(`rollout.on_stale: resume`, rollout/resumption.py) holds its current attempt's tokens only: it is emptied
before each attempt and after a failed one (a failed attempt's tokens are no prefix).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

from asyncgrpo.config import GenerationConfig
from asyncgrpo.errors import RequestTimeoutError, RolloutDeadlineError, TransientGenerationError
from asyncgrpo.generation.base import Generator
from asyncgrpo.sync import SharedTimeout
from asyncgrpo.types import Completion, GenerationRequest


def retry_delay(g: GenerationConfig, attempt: int, uniform: float) -> float:
    """The wait before retry number `attempt` (1 = the first retry); `uniform` in [0, 1) is the jitter."""
    return min(g.retry_backoff_max_s, g.retry_backoff_s * 2 ** (attempt - 1)) * (0.5 + 0.5 * uniform)


def delay_before_deadline(g: GenerationConfig, attempt: int, jitter: random.Random, deadline: float) -> float | None:
    """The wait before retry number `attempt`, or None when the retry would start at or past `deadline` (loop time)."""
    delay = retry_delay(g, attempt, jitter.random())
    return None if asyncio.get_running_loop().time() + delay >= deadline else delay


async def generate_with_retries(
    generator: Generator,
    request: GenerationRequest,
    g: GenerationConfig,
    *,
    jitter: random.Random,
    before_attempt: Callable[[], None] | None = None,
    on_retry: Callable[[TransientGenerationError], None] | None = None,
    between_attempts: Callable[[float], Awaitable[None]] | None = None,
    timeouts: SharedTimeout | None = None,
) -> Completion:
    """Generate `request` on `generator` under the policy of the module docstring. `timeouts`: shared timeouts of
    `g.request_timeout_s` for the attempts the rollout deadline does not cut short."""
    if timeouts is not None and timeouts.duration_s != g.request_timeout_s:
        raise ValueError(f"shared timeouts of {timeouts.duration_s:g} s for generation.request_timeout_s = {g.request_timeout_s:g}")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + g.rollout_deadline_s
    attempt = 0
    while True:
        if request.sink is not None:
            request.sink.empty()
        if before_attempt is not None:
            before_attempt()
        limit = min(g.request_timeout_s, deadline - loop.time())
        try:
            async with timeouts.timeout() if timeouts is not None and limit == g.request_timeout_s else asyncio.timeout(limit):
                return await generator.generate(request)
        except TimeoutError as exc:
            error: TransientGenerationError = RequestTimeoutError(
                f"request {request.request_id} got no answer within {limit:g} s (generation.request_timeout_s = {g.request_timeout_s:g})",
                backend=generator.name,
            )
            error.__cause__ = exc
        except TransientGenerationError as exc:
            error = exc
        attempt += 1
        delay = delay_before_deadline(g, attempt, jitter, deadline)
        if delay is None:
            raise RolloutDeadlineError(
                f"request {request.request_id} still failing after {attempt} attempts when its "
                f"generation.rollout_deadline_s = {g.rollout_deadline_s:g} ran out; last error: {error}",
                backend=generator.name,
            ) from error
        if request.sink is not None:
            request.sink.empty()  # an interruption while the retry waits keeps none of the failed attempt's tokens
        if on_retry is not None:
            on_retry(error)
        if between_attempts is not None:
            await between_attempts(delay)
        else:
            await asyncio.sleep(delay)
