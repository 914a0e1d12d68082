"""Evaluation on held-out prompts: mean reward (total and per function), pass@k, and how many samples could not be had.

A client of the same failure machinery as rollouts: every request goes through the retry policy
of rollout/retry.py (transient errors retried under `request_timeout_s` and the rollout
deadline), the requests of one prompt run concurrently. What still fails leaves that sample out
(`eval/failed_requests`, one warning); only a `FatalBackendError` (the backend cannot serve the
run at all) propagates, and `eval_diagnostic` makes it the run's diagnostic.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
from typing import Any

from asyncgrpo.config import Config
from asyncgrpo.errors import Diagnostic, FatalBackendError, GenerationError, RewardError
from asyncgrpo.generation.base import Generator
from asyncgrpo.rewards.scoring import RewardScorer, ScoredCompletion
from asyncgrpo.rollout.first_failure import format_traceback
from asyncgrpo.rollout.retry import generate_with_retries
from asyncgrpo.types import GenerationRequest, Prompt, SamplingParams

log = logging.getLogger("asyncgrpo")


async def evaluate(
    cfg: Config, engine: Generator, scorer: RewardScorer, prompts: list[Prompt], stop_ids: tuple[int, ...], *, step: int
) -> dict[str, float | None]:
    """Sample `eval.samples_per_prompt` completions per held-out prompt; report mean reward, each reward function's
    mean (`eval/reward/<function>`, as `reward/<function>` in training), pass@k and failures.

    Requests go through the same retry policy as rollouts (rollout/retry.py), those of one prompt
    concurrently. A request that still fails, or a reward that raises, leaves that sample out:
    the evaluation is incomplete (`eval/failed_requests`, one warning naming the first error),
    never a crash. A `FatalBackendError` propagates: the backend cannot serve the run at all."""
    sampling = SamplingParams(
        max_new_tokens=cfg.generation.max_new_tokens,
        temperature=cfg.eval.temperature,
        top_p=cfg.generation.top_p if cfg.eval.temperature > 0 else 1.0,
        stop_token_ids=stop_ids,
    )
    k = cfg.eval.samples_per_prompt
    jitter = random.Random(cfg.run.seed + step)
    failures: list[BaseException] = []

    async def generate(request: GenerationRequest) -> Any:
        try:
            return await generate_with_retries(engine, request, cfg.generation, jitter=jitter)
        except FatalBackendError:
            raise
        except (GenerationError, OSError) as exc:
            failures.append(exc)
            return None

    async def one(prompt: Prompt) -> list[ScoredCompletion]:
        requests = [
            GenerationRequest(f"eval-{step}-{prompt.id}-{i}", prompt.id, prompt.token_ids, sampling, seed=cfg.run.seed + i)
            for i in range(k)
        ]
        async with asyncio.TaskGroup() as task_group:
            tasks = [task_group.create_task(generate(request)) for request in requests]
        completions = [c for c in (t.result() for t in tasks) if c is not None]
        if not completions:
            return []
        try:
            return await scorer.score(prompt, completions)
        except RewardError as exc:
            failures.extend([exc] * len(completions))
            return []

    try:
        async with asyncio.TaskGroup() as task_group:
            tasks = [task_group.create_task(one(p)) for p in prompts]
    except* FatalBackendError as group:
        raise _first_leaf(group) from None
    per_prompt = [t.result() for t in tasks]
    if failures:
        log.warning(
            "warning: the evaluation after step %d is incomplete: %d of %d samples failed and are left out "
            "(first error: %s: %s)", step, len(failures), len(prompts) * k, type(failures[0]).__name__, failures[0],
        )
    samples = [s for scored in per_prompt for s in scored]
    passed = [any(s.reward is not None and s.reward >= cfg.eval.success_threshold for s in scored) for scored in per_prompt if scored]
    return {
        "eval/reward_mean": _mean([s.reward for s in samples]),
        "eval/pass_rate": sum(passed) / len(passed) if passed else None,
        "eval/failed_requests": len(failures),
        **{f"eval/reward/{name}": _mean([s.terms.get(name) for s in samples]) for name in scorer.names},
    }


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    """The first exception of a (possibly nested) group: task groups of task groups nest them."""
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def eval_diagnostic(exc: FatalBackendError, step: int) -> Diagnostic:
    return Diagnostic(
        kind=exc.kind,
        message=(
            f"The evaluation after step {step} could not be served: {exc}. Retrying cannot fix this; check the servers, "
            f"the model name, the URLs and the credentials. Every trained step's metrics are written."
        ),
        backend=exc.backend,
        trainer_step=step,
        original=exc,
        traceback=format_traceback(exc),
    )
