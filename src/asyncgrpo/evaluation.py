"""Evaluation on held-out prompts: samples scored with the reward functions, reported as the algorithm says
(algorithms/ `eval_metrics`; GRPO's and distillation's: mean reward, total and per function, and pass@k), and
how many samples could not be had.

A client of the same failure machinery as rollouts: every request goes through the retry policy
of rollout/retry.py (transient errors retried under `request_timeout_s` and the rollout
deadline), the requests of one prompt run concurrently. What still fails leaves that sample out
(`eval/failed_requests`, one warning); only a `FatalBackendError` (the backend cannot serve the
run at all) propagates, and `eval_diagnostic` makes it the run's diagnostic.

With an `env:` section each sample is an episode, played as training plays one (rollout/episode.py:
the same `env.factory`, isolation, turn and token limits, cancel grace and transient retries),
and scored with the environment's reward added (`eval/reward/env`). Evaluation's episodes:
- keep counters of their own: their environment errors are failed samples
  (`eval/failed_requests`), never training's `env/*` totals;
- run at most `generation.max_inflight` at once (the environments alive at once, as in training);
- each end within `config.episode_limit_s` (the reset and env.max_turns turns of a generation and a
  step, each within its own deadline; a second guard over those): one that does not is cancelled
  like any cancelled episode (token, close(), grace; a process worker killed) and counted as failed;
- are cancelled with the evaluation (the run stopping): each episode's environment is stopped
  before the cancellation goes on, so none outlives it (with `env.isolation: process`, no worker).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from collections.abc import Awaitable, Callable

from asyncgrpo.algorithms.registry import algorithm_for
from asyncgrpo.config import Config, episode_limit_s
from asyncgrpo.environments.conversation import Codec
from asyncgrpo.errors import Diagnostic, EpisodeError, FatalBackendError, GenerationError, RewardError
from asyncgrpo.generation.base import Generator
from asyncgrpo.rewards.scoring import RewardScorer, ScoredCompletion
from asyncgrpo.rollout.episode import EpisodeRunner, add_env_reward, term_names
from asyncgrpo.rollout.first_failure import format_traceback
from asyncgrpo.rollout.retry import generate_with_retries
from asyncgrpo.types import Completion, GenerationRequest, Prompt, SamplingParams

log = logging.getLogger("asyncgrpo")


async def evaluate(
    cfg: Config,
    engine: Generator,
    scorer: RewardScorer,
    prompts: list[Prompt],
    stop_ids: tuple[int, ...],
    *,
    step: int,
    codec: Codec | None = None,
) -> dict[str, float | None]:
    """Sample `eval.samples_per_prompt` completions (episodes, with an `env:` section; `codec` tokenizes them) per
    held-out prompt, score them with `scorer` (and an environment's reward), and report what the algorithm makes of
    the scores (`eval_metrics`; GRPO's: mean reward, each reward term's mean as `eval/reward/<function>`, and
    `eval/reward/env` with an environment, as `reward/<function>` in training, and pass@k) and the failures.

    Requests go through the same retry policy as rollouts (rollout/retry.py), those of one prompt
    concurrently. A request or episode that still fails, or a reward that raises, leaves that sample out:
    the evaluation is incomplete (`eval/failed_requests`, one warning naming the first error),
    never a crash. A `FatalBackendError` propagates: the backend cannot serve the run at all."""
    sampling = SamplingParams(
        max_new_tokens=cfg.generation.max_new_tokens,
        temperature=cfg.eval.temperature,
        top_p=cfg.generation.top_p if cfg.eval.temperature > 0 else 1.0,
        stop_token_ids=stop_ids,
        top_k=cfg.generation.top_k if cfg.eval.temperature > 0 else 0,
        min_p=cfg.generation.min_p if cfg.eval.temperature > 0 else 0.0,
        repetition_penalty=cfg.generation.repetition_penalty,
    )
    k = cfg.eval.samples_per_prompt
    jitter = random.Random(cfg.run.seed + step)
    failures: list[BaseException] = []
    sample = _sampler(cfg, engine, codec, jitter)

    async def one(prompt: Prompt) -> list[ScoredCompletion]:
        requests = [
            GenerationRequest(f"eval-{step}-{prompt.id}-{i}", prompt.id, prompt.token_ids, sampling, seed=cfg.run.seed + i)
            for i in range(k)
        ]

        async def kept(request: GenerationRequest) -> Completion | None:
            try:
                return await sample(prompt, request)
            except FatalBackendError:
                raise
            except (GenerationError, EpisodeError, OSError) as exc:
                failures.append(exc)
                return None

        async with asyncio.TaskGroup() as task_group:
            tasks = [task_group.create_task(kept(request)) for request in requests]
        completions = [c for c in (t.result() for t in tasks) if c is not None]
        if not completions:
            return []
        try:
            scored = await scorer.score(prompt, completions)
            return add_env_reward(scored, completions, cfg.env, prompt) if cfg.env is not None else scored
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
    report = algorithm_for(cfg).eval_metrics([scored for scored in per_prompt if scored], term_names(scorer.names, cfg.env))
    return {**report, "eval/failed_requests": len(failures)}


Sampler = Callable[[Prompt, GenerationRequest], Awaitable[Completion]]


def _sampler(cfg: Config, engine: Generator, codec: Codec | None, jitter: random.Random) -> Sampler:
    """How one evaluation sample is had: a completion under the retry policy, or with an `env:` section an episode
    under the rules of the module docstring."""

    def generate(request: GenerationRequest, _floor: int | None = None) -> Awaitable[Completion]:
        return generate_with_retries(engine, request, cfg.generation, jitter=jitter)

    env = cfg.env
    if env is None:
        return lambda prompt, request: generate(request)
    if codec is None:
        raise ValueError("evaluating with an env: section needs the codec that tokenizes its episodes")
    # Counters of its own: an evaluation episode's errors are its failed samples, not training's env/* totals.
    episodes = EpisodeRunner(env, cfg.generation, codec, Counter(), prompt_key=cfg.data.prompt_key,
                             max_prompt_tokens=cfg.data.max_prompt_tokens, jitter=jitter)
    slots = asyncio.Semaphore(cfg.generation.max_inflight)  # holders end within limit_s + the cancel grace
    limit_s = episode_limit_s(env, cfg.generation)

    async def play(prompt: Prompt, request: GenerationRequest) -> Completion:
        async with slots:
            try:
                async with asyncio.timeout(limit_s):
                    return await episodes.run(prompt, request, generate, on_retry=lambda error: None, between_attempts=asyncio.sleep)
            except TimeoutError as exc:  # the episode was cancelled (its environment stopped) when the limit struck
                raise EpisodeError(
                    f"the evaluation episode of prompt {prompt.id} did not end within {limit_s:g} s (env.step_timeout_s = "
                    f"{env.step_timeout_s:g} for the reset, then env.max_turns = {env.max_turns} x (generation.rollout_deadline_s = "
                    f"{cfg.generation.rollout_deadline_s:g} + env.step_timeout_s)); it was stopped and is left out. Fix: make the "
                    f"environment's steps end sooner, or raise generation.rollout_deadline_s.",
                    backend=env.factory,
                ) from exc

    return play


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    """The first exception of a (possibly nested) group: task groups of task groups nest them."""
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def eval_diagnostic(exc: FatalBackendError, step: int) -> Diagnostic:
    return Diagnostic(
        kind=exc.kind,
        message=(
            f"The evaluation after step {step} could not be served: {str(exc).rstrip('.')}. Retrying cannot fix this; check the servers, "
            f"the model name, the URLs and the credentials. Every trained step's metrics are written."
        ),
        backend=exc.backend,
        trainer_step=step,
        original=exc,
        traceback=format_traceback(exc),
    )
