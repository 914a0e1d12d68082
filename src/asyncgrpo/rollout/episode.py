"""One rollout as a multi-turn episode: reset, then model turns and environment steps, until a stop.

Job (`EpisodeRunner.run`): play one episode of `env.factory` for one member of a group and return
it as one `Completion` (types.py): every token after the prompt, the model's exactly as sampled
(ids, logprobs, versions) and the environment's as the chat-template delta with loss mask 0
(environments/conversation.py), with the episode's record (`Episode`).

The loop: `reset(row)`, then per turn: generate on the ids so far (through the collector's retry
policy; the prompt of each turn is the previous prompt plus exactly what was sampled plus the
environment's tokens), `step(text)`. It stops when the environment says done, after
`env.max_turns` turns, or when `env.max_tokens` tokens follow the prompt (a turn's
`max_new_tokens` is cut to what is left; environment tokens that leave no room end the episode).

Failures and cancellation:
- An exception in reset/step/factory is an `EpisodeError` (counted in `env/errors_total`) that
  fails the rollout; one marked `TransientEnvironmentError` is retried as a fresh episode after the
  retry policy's backoff, while the rollout's `generation.rollout_deadline_s` allows. A generation
  error propagates as it is (the collector classifies it).
- Cancelled (the group is stale, shut down, or the run ends), the host's `cancel(env.cancel_grace_s)`
  runs before the cancellation goes on: the token is set, `close()` is called, the work is awaited
  up to the grace. Work that outlives it is counted in `env/abandoned_total` and logged with the
  environment's name; never counted as a failure.
- Every other ending closes the environment, bounded by the same grace (a close that will not
  return is abandoned and counted; one that raises is counted and logged, the sample kept).

Rewards (`add_env_reward`): the episode's reward is env reward x `env.reward_weight` plus the
weighted reward functions, which get the episode's messages as the completion (rewards/scoring.py `reward_input`);
the term `env` is reported like a reward function's.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from asyncgrpo.config import EnvConfig, GenerationConfig
from asyncgrpo.environments.conversation import Codec, Conversation, as_row
from asyncgrpo.environments.hosts import open_host
from asyncgrpo.environments.protocol import EnvironmentHost, TransientEnvironmentError
from asyncgrpo.errors import EpisodeError
from asyncgrpo.rewards.scoring import ScoredCompletion
from asyncgrpo.rollout.retry import delay_before_deadline
from asyncgrpo.types import Completion, Episode, EpisodeStop, GenerationRequest, Prompt

log = logging.getLogger("asyncgrpo")

T = TypeVar("T")
ENV_TERM = "env"
# A turn's generation: (request, the oldest version of the episode's model tokens so far, or None).
Generate = Callable[[GenerationRequest, int | None], Awaitable[Completion]]


class EpisodeRunner:
    """Plays episodes for one collector; `counters` are the collector's (env/* totals)."""

    def __init__(
        self,
        env: EnvConfig,
        generation: GenerationConfig,
        codec: Codec,
        counters: MutableMapping[str, int],
        *,
        prompt_key: str,
        jitter: random.Random,
        host_factory: Callable[[EnvConfig], EnvironmentHost] = open_host,
    ) -> None:
        self.env = env
        self.generation = generation
        self.codec = codec
        self.counters = counters
        self.prompt_key = prompt_key
        self._jitter = jitter
        self._open_host = host_factory

    async def run(
        self,
        prompt: Prompt,
        request: GenerationRequest,
        generate: Generate,
        *,
        on_retry: Callable[[EpisodeError], None],
        between_attempts: Callable[[float], Awaitable[None]],
    ) -> Completion:
        """One episode under the failure policy of the module docstring."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.generation.rollout_deadline_s
        attempt = 0
        while True:
            try:
                return await self._attempt(prompt, request, generate)
            except EpisodeError as error:
                if not error.transient:
                    raise
                attempt += 1
                delay = delay_before_deadline(self.generation, attempt, self._jitter, deadline)
                if delay is None:
                    raise EpisodeError(
                        f"the episode of prompt {prompt.id} still failed after {attempt} attempts when its "
                        f"generation.rollout_deadline_s = {self.generation.rollout_deadline_s:g} ran out; last error: {error}",
                        backend=error.backend,
                    ) from error
                on_retry(error)
                await between_attempts(delay)

    async def _attempt(self, prompt: Prompt, request: GenerationRequest, generate: Generate) -> Completion:
        host = self._open_host(self.env)
        try:
            completion = await self._play(host, prompt, request, generate)
        except asyncio.CancelledError:
            await self._cancel(host, prompt)
            raise
        except BaseException:
            await self._close(host, prompt)
            raise
        await self._close(host, prompt)
        return completion

    async def _play(self, host: EnvironmentHost, prompt: Prompt, request: GenerationRequest, generate: Generate) -> Completion:
        env = self.env
        conv = Conversation(self.codec, prompt)
        conv.start(await self._env_call(host.reset(as_row(prompt, self.prompt_key)), "reset", prompt))
        env_reward: float | None = None
        infos = []
        turn = 0
        dispatch: int | None = None
        while True:
            remaining = env.max_tokens - conv.generated
            turn_request = replace(
                request,
                request_id=f"{request.request_id}-t{turn}",
                prompt_token_ids=conv.context,
                sampling=replace(request.sampling, max_new_tokens=min(request.sampling.max_new_tokens, remaining)),
                seed=request.seed + turn,
            )
            versions = conv.model_versions()
            completion = await generate(turn_request, min(versions) if versions else None)
            if dispatch is None:
                dispatch = completion.dispatch_version
            conv.add_model(completion)
            turn += 1
            result = await self._env_call(host.step(completion.text), "step", prompt)
            if result.reward is not None:
                env_reward = (env_reward or 0.0) + result.reward
            infos.append(result.info)
            stop: EpisodeStop | None = None
            if result.done:
                stop = "done"
            elif turn >= env.max_turns:
                stop = "max_turns"
            elif conv.generated >= env.max_tokens:
                stop = "max_tokens"
            if stop is not None:
                conv.check_final_drift()
                conv.record(result.messages)
                break
            ids = conv.delta(result.messages)
            if conv.generated + len(ids) >= env.max_tokens:  # no room left for a model token after them
                stop = "max_tokens"
                conv.record(result.messages)
                break
            conv.observe(result.messages, ids)
        versions = conv.model_versions()
        assert dispatch is not None  # max_turns >= 1 and max_tokens >= 1: the first turn always generates
        episode = Episode(
            messages=tuple(conv.episode_messages()),
            turns=turn,
            stop_reason=stop,
            env_reward=env_reward,
            version_span=(min(versions, default=dispatch), max(versions, default=dispatch)),
            drift_turns=conv.drift_turns,
            info=tuple(infos),
        )
        return Completion(
            token_ids=tuple(conv.ids),
            logprobs=tuple(conv.logprobs),
            versions=tuple(conv.versions),
            finish_reason="length" if stop == "max_tokens" else "stop",
            dispatch_version=dispatch,
            text=transcript(episode.messages),
            loss_mask=tuple(conv.mask),
            episode=episode,
            prompt_token_ids=conv.prompt_ids if conv.prompt_changed else None,
        )

    async def _env_call(self, call: Awaitable[T], what: str, prompt: Prompt) -> T:
        """An environment call; what it raises becomes a counted `EpisodeError` (cancellation stays cancellation)."""
        try:
            return await call
        except Exception as exc:
            self.counters["env/errors_total"] += 1
            transient = isinstance(exc, TransientEnvironmentError)
            raise EpisodeError(
                f"environment {self.env.factory!r}: {what} raised {type(exc).__name__}: {exc} (prompt {prompt.id}). "
                + ("It is marked transient: the episode is tried again while the rollout deadline allows. " if transient else "")
                + "Fix: the environment's traceback is chained to this error (asyncgrpo --debug shows it); raise "
                "TransientEnvironmentError for failures worth retrying.",
                backend=self.env.factory,
                transient=transient,
            ) from exc

    async def _cancel(self, host: EnvironmentHost, prompt: Prompt) -> None:
        grace = self.env.cancel_grace_s
        try:
            stopped = await host.cancel(grace)
        except asyncio.CancelledError:
            self._abandoned(prompt, "was cancelled again while it was being stopped")
            raise
        except Exception as exc:  # noqa: BLE001 - a host that cannot stop its work: the work is abandoned, and said so
            self._abandoned(prompt, f"could not be stopped: its host raised {type(exc).__name__}: {exc}")
            return
        if not stopped:
            self._abandoned(prompt, f"was still running {grace:g} s (env.cancel_grace_s) after its cancellation")

    async def _close(self, host: EnvironmentHost, prompt: Prompt) -> None:
        try:
            async with asyncio.timeout(self.env.cancel_grace_s):
                await host.close()
        except asyncio.CancelledError:  # cancelled while closing: the close may still run, so stop it as a cancel does
            await self._cancel(host, prompt)
            raise
        except TimeoutError:
            if not await host.cancel(0.0):
                self._abandoned(prompt, f"close() did not return within {self.env.cancel_grace_s:g} s (env.cancel_grace_s)")
        except Exception as exc:  # noqa: BLE001 - counted and logged; the episode itself is over
            self.counters["env/errors_total"] += 1
            log.warning("environment %r: close() raised %s: %s (prompt %d); counted in env/errors_total",
                        self.env.factory, type(exc).__name__, exc, prompt.id)

    def _abandoned(self, prompt: Prompt, what: str) -> None:
        self.counters["env/abandoned_total"] += 1
        log.warning(
            "environment %r: the episode of prompt %d %s; it is abandoned (counted in env/abandoned_total). Fix: poll "
            "token.cancelled in long steps and make close() interrupt them, or use env.isolation: process.",
            self.env.factory, prompt.id, what,
        )


def transcript(messages: Sequence[Any]) -> str:
    """The episode after the prompt as "role: content" lines (samples and logs; reward functions get the messages)."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def add_env_reward(scored: Sequence[ScoredCompletion], completions: Sequence[Completion], weight: float) -> list[ScoredCompletion]:
    """Each completion's reward with its episode's environment reward x `weight` added (term `env`; None: no reward from it)."""
    out = []
    for s, completion in zip(scored, completions, strict=True):
        env_reward = completion.episode.env_reward if completion.episode is not None else None
        parts = [x for x in (s.reward, None if env_reward is None else weight * env_reward) if x is not None]
        out.append(ScoredCompletion(reward=math.fsum(parts) if parts else None, terms={**s.terms, ENV_TERM: env_reward},
                                   extra=s.extra))
    return out


def term_names(reward_names: Sequence[str], env: EnvConfig | None) -> list[str]:
    """The reward terms reported per step: the functions', and `env` with an environment."""
    return [*reward_names, ENV_TERM] if env is not None else list(reward_names)


def count_episode(counters: MutableMapping[str, int], completion: Completion) -> None:
    """A finished rollout's episode totals (re-tokenization drift)."""
    if completion.episode is not None and completion.episode.drift_turns:
        counters["env/retokenization_drift_total"] += 1
