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
After the reset and after each step it calls `on_progress` (the collector's stall clock). Each
environment call and each turn's generation is reported, with its start and end, to the rollout's
episode observer (rollout/episode_events.py: the run's timeline). Under `rollout.on_stale: resume`
each turn's `generate` is the resume loop (rollout/resumption.py): an interruption only ever lands
in a turn's request, which continues from its tokens; this loop, its finished turns and its
environment never see it.

Observations are sized before they are tokenized (environments/conversation.py): a step's
observation of more characters than the tokens left could hold ends the episode at
`max_tokens` unencoded (kept for the reward functions); a reset observation of more characters
than `data.max_prompt_tokens` tokens could hold fails the rollout. Encoding runs off the event
loop when the codec asks for it.

Failures and cancellation:
- What reset/step/factory raise (any exception, SystemExit and KeyboardInterrupt included: user
  code never ends the process) is an `EpisodeError` (counted in `env/errors_total`) that fails
  the rollout; one marked `TransientEnvironmentError` is retried as a fresh episode after the
  retry policy's backoff, while the rollout's `generation.rollout_deadline_s` allows. A generation
  error propagates as it is (the collector classifies it).
- Each reset and step has `env.step_timeout_s`; one that outlives it is stopped as a cancelled
  episode is (below) and fails the rollout (`EnvironmentTimeout`, counted in `env/errors_total`).
- Cancelled (the group is stale, shut down, or the run ends), the host's `cancel(env.cancel_grace_s)`
  runs before the cancellation goes on: the token is set, `close()` is called, the work is awaited
  up to the grace. Work that outlives it is counted in `env/abandoned_total` (the first logged with
  the environment's name); never counted as a failure.
- Every other ending closes the environment, bounded by the same grace (a close that will not
  return is abandoned and counted). A close that raises, on any ending, is counted in
  `env/errors_total`, the sample kept. Of the abandoned episodes and of the failed closes of an
  environment, the first is logged in full, later ones only counted (they tend to come alike).

Rewards (`add_env_reward`): the episode's reward is env reward x `env.reward_weight` plus the
weighted reward functions, which get the episode's messages as the completion (rewards/scoring.py `reward_input`);
the term `env` is reported like a reward function's. An environment reward that is not a finite
number (a step's NaN or inf, steps or terms whose sum overflows) is an `EnvironmentRewardError`,
a `RewardError` under `reward.on_error`, naming the environment, the steps and the prompt.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import random
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import replace
from typing import TypeVar

from asyncgrpo.agents.episode import AgentEpisodes
from asyncgrpo.config import Config, EnvConfig, GenerationConfig
from asyncgrpo.environments.conversation import Codec, Conversation, as_row, content_chars, transcript
from asyncgrpo.environments.hosts import open_host
from asyncgrpo.environments.protocol import EnvironmentHost, Message, TransientEnvironmentError
from asyncgrpo.errors import EpisodeError, RewardError
from asyncgrpo.rewards.scoring import ScoredCompletion, finite_sum
from asyncgrpo.rollout.episode_events import episode_observer
from asyncgrpo.rollout.retry import delay_before_deadline
from asyncgrpo.threads import run_in_daemon_thread
from asyncgrpo.types import Completion, Episode, EpisodeStop, GenerationRequest, Prompt

log = logging.getLogger("asyncgrpo")

T = TypeVar("T")
ENV_TERM = "env"
# A turn's generation: (request, the oldest version of the episode's model tokens so far, or None).
Generate = Callable[[GenerationRequest, int | None], Awaitable[Completion]]


class EnvironmentTimeout(EpisodeError):
    """An environment call outlived `env.step_timeout_s`; the episode's environment is stopped as a cancelled one is."""


class EnvironmentRewardError(RewardError):
    """An episode's environment reward, or its total with the reward functions', is not a finite number."""


def _no_progress() -> None:
    return None


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
        max_prompt_tokens: int,
        jitter: random.Random,
        host_factory: Callable[[EnvConfig], EnvironmentHost] = open_host,
    ) -> None:
        self.env = env
        self.generation = generation
        self.codec = codec
        self.counters = counters
        self.prompt_key = prompt_key
        self.max_prompt_tokens = max_prompt_tokens
        self._jitter = jitter
        self._open_host = host_factory
        self._logged: set[str] = set()  # the counters whose first ending was logged (`_count_and_log_first`)
        # `env.factory: agent:module:function` is played through the gateway (agents/); a simulator's own hosts model it instead.
        self._agents: AgentEpisodes | None = None
        if env.is_agent and host_factory is open_host:
            self._agents = AgentEpisodes(env, generation, codec, counters, prompt_key=prompt_key, max_prompt_tokens=max_prompt_tokens,
                                         report=self._count_and_log_first)

    @classmethod
    def of_run(cls, cfg: Config, codec: Codec | None, counters: MutableMapping[str, int], jitter: random.Random,
               host_factory: Callable[[EnvConfig], EnvironmentHost]) -> EpisodeRunner | None:
        """The runner of a recipe's `env:` section (None without one); `codec` tokenizes its episodes."""
        if cfg.env is None:
            return None
        if codec is None:
            raise ValueError("a Collector with an env: section needs the codec that tokenizes its episodes")
        return cls(cfg.env, cfg.generation, codec, counters, prompt_key=cfg.data.prompt_key, max_prompt_tokens=cfg.data.max_prompt_tokens,
                   jitter=jitter, host_factory=host_factory)

    async def run(
        self,
        prompt: Prompt,
        request: GenerationRequest,
        generate: Generate,
        *,
        on_retry: Callable[[EpisodeError], None],
        between_attempts: Callable[[float], Awaitable[None]],
        on_progress: Callable[[], None] = _no_progress,
    ) -> Completion:
        """One episode under the failure policy of the module docstring."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.generation.rollout_deadline_s
        attempt = 0
        while True:
            try:
                return await self._attempt(prompt, request, generate, on_progress)
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

    async def _attempt(self, prompt: Prompt, request: GenerationRequest, generate: Generate, on_progress: Callable[[], None]) -> Completion:
        if self._agents is not None:
            return await self._agents.play(prompt, request, generate, on_progress)
        host = self._open_host(self.env)
        try:
            completion = await self._play(host, prompt, request, generate, on_progress)
        except (asyncio.CancelledError, EnvironmentTimeout):  # a call may still run: stop it
            await self._cancel(host, prompt)
            raise
        except BaseException:
            await self._close(host, prompt)
            raise
        await self._close(host, prompt)
        return completion

    async def _play(
        self, host: EnvironmentHost, prompt: Prompt, request: GenerationRequest, generate: Generate, on_progress: Callable[[], None]
    ) -> Completion:
        env = self.env
        report, now = episode_observer(), asyncio.get_running_loop().time  # the run's timeline (rollout/episode_events.py)
        conv = await self._encoding(functools.partial(Conversation, self.codec, prompt))
        started = now()
        observation = await self._env_call(host.reset(as_row(prompt, self.prompt_key)), "reset", prompt)
        report.env_call("reset", started, now())
        on_progress()
        self._check_reset_size(observation, prompt)
        await self._encoding(lambda: conv.start(observation))
        env_reward: float | None = None
        step_rewards: list[float | None] = []
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
            started = now()
            completion = await generate(turn_request, min(versions) if versions else None)
            report.turn(started, now(), len(completion.token_ids), remaining if remaining < request.sampling.max_new_tokens else None)
            if dispatch is None:
                dispatch = completion.dispatch_version
            conv.add_model(completion)
            turn += 1
            started = now()
            result = await self._env_call(host.step(completion.text), f"step of turn {turn}", prompt)
            report.env_call("step", started, now(), done=result.done, reward=result.reward)
            on_progress()
            if result.reward is not None:
                env_reward = (env_reward or 0.0) + result.reward
            step_rewards.append(result.reward)
            infos.append(result.info)
            stop: EpisodeStop | None = None
            if result.done:
                stop = "done"
            elif turn >= env.max_turns:
                stop = "max_turns"
            elif conv.generated >= env.max_tokens:
                stop = "max_tokens"
            if stop is not None:
                await self._encoding(conv.check_final_drift)
                conv.record(result.messages)
                break
            left = env.max_tokens - conv.generated
            # More characters than `left` tokens can hold cannot fit: never encoded (that alone could take minutes).
            fits = content_chars(result.messages) <= left * self.codec.max_token_chars
            ids = await self._encoding(functools.partial(conv.delta, result.messages)) if fits else None
            if ids is None or len(ids) >= left:  # no room left for a model token after them
                stop = "max_tokens"
                conv.record(result.messages)
                break
            conv.observe(result.messages, ids)
            report.observed(len(ids))
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
            step_rewards=tuple(step_rewards),
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
        """An environment call under `env.step_timeout_s`; what it raises (any BaseException: SystemExit too) or a
        timeout becomes a counted `EpisodeError`. Our own cancellation stays cancellation."""
        deadline = asyncio.timeout(self.env.step_timeout_s)
        try:
            async with deadline:
                return await call
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            error: BaseException = exc  # the environment cancelled itself
        except BaseException as exc:  # noqa: BLE001 - user code: whatever it raises fails the rollout, never the process
            error = exc
        self.counters["env/errors_total"] += 1
        if deadline.expired():
            raise EnvironmentTimeout(
                f"environment {self.env.factory!r}: {what} did not return within env.step_timeout_s = "
                f"{self.env.step_timeout_s:g} s (prompt {prompt.id}); it was stopped (token set, close() called, up to "
                f"env.cancel_grace_s = {self.env.cancel_grace_s:g} s) and the rollout failed. Fix: make the call end sooner "
                "(poll token.cancelled in long steps), or raise env.step_timeout_s.",
                backend=self.env.factory,
            ) from error
        transient = isinstance(error, TransientEnvironmentError)
        raise EpisodeError(
            f"environment {self.env.factory!r}: {what} raised {type(error).__name__}: {error} (prompt {prompt.id}). "
            + ("It is marked transient: the episode is tried again while the rollout deadline allows. " if transient else "")
            + "Fix: the environment's traceback is chained to this error (asyncgrpo --debug shows it); raise "
            "TransientEnvironmentError for failures worth retrying.",
            backend=self.env.factory,
            transient=transient,
        ) from error

    def _check_reset_size(self, observation: tuple[Message, ...], prompt: Prompt) -> None:
        """A reset observation too long for any prompt fails the rollout before it is encoded."""
        limit = self.max_prompt_tokens * self.codec.max_token_chars
        chars = content_chars(observation)
        if chars > limit:
            self.counters["env/errors_total"] += 1
            raise EpisodeError(
                f"environment {self.env.factory!r}: reset returned an observation of {chars} characters (prompt {prompt.id}), "
                f"more than data.max_prompt_tokens = {self.max_prompt_tokens} tokens can hold ({limit} characters at most "
                f"{self.codec.max_token_chars} per token); the observation joins the prompt, so the rollout failed without "
                "encoding it. Fix: return a shorter first observation, or raise data.max_prompt_tokens.",
                backend=self.env.factory,
            )

    async def _encoding(self, work: Callable[[], T]) -> T:
        """Tokenizer work of the episode: on a thread of its own when the codec asks (the loop never waits for it)."""
        return await run_in_daemon_thread(work, name="asyncgrpo-env-encode") if self.codec.offload else work()

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
        finally:
            if host.close_error is not None:
                self._close_failed(host.close_error, prompt)
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
        except BaseException as exc:  # noqa: BLE001 - user code (SystemExit too): counted and logged; the episode itself is over
            self._close_failed(exc, prompt)

    def _close_failed(self, error: BaseException, prompt: Prompt) -> None:
        """A close() that raised: counted, the sample kept."""
        self._count_and_log_first(
            "env/errors_total", f"close() raised {type(error).__name__}: {error} (prompt {prompt.id})",
            "The episode's sample is kept. Fix: make close() idempotent and safe to call while step runs, from another thread.",
        )

    def _abandoned(self, prompt: Prompt, what: str) -> None:
        self._count_and_log_first(
            "env/abandoned_total", f"the episode of prompt {prompt.id} {what}; it is abandoned",
            "Fix: poll token.cancelled in long steps and make close() interrupt them, or use env.isolation: process.",
        )

    def _count_and_log_first(self, counter: str, what: str, fix: str) -> None:
        """Count an ending under `counter`; log the first of each counter in full (every episode of an environment tends
        to fail alike: a line each would flood the log), saying that later ones are only counted."""
        self.counters[counter] += 1
        if counter not in self._logged:
            self._logged.add(counter)
            log.warning("environment %r: %s (counted in %s; later ones of this environment are counted there without a "
                        "log line each). %s", self.env.factory, what, counter, fix)


def add_env_reward(scored: Sequence[ScoredCompletion], completions: Sequence[Completion], env: EnvConfig, prompt: Prompt) -> list[ScoredCompletion]:
    """Each completion's reward with its episode's environment reward x `env.reward_weight` added (term `env`; None: no
    reward from it). Raises `EnvironmentRewardError` when an environment reward or a total is not a finite number."""
    out = []
    for s, completion in zip(scored, completions, strict=True):
        episode = completion.episode
        env_reward = episode.env_reward if episode is not None else None
        if episode is not None and env_reward is not None and not math.isfinite(env_reward):
            raise _env_reward_error(env, prompt, f"its steps' rewards {_rewards(episode.step_rewards)} sum to {env_reward!r}",
                                    "return a finite number (or None) from every step")
        weighted = None if env_reward is None else env.reward_weight * env_reward
        parts = [x for x in (s.reward, weighted) if x is not None]
        total = finite_sum(parts)
        if total is None or (weighted is not None and not math.isfinite(weighted)):
            raise _env_reward_error(
                env, prompt, f"its reward {env_reward!r} x env.reward_weight = {env.reward_weight:g} plus the reward functions' "
                f"{s.reward!r} (terms {dict(s.terms)}) is not a finite number", "keep the rewards and weights within float range")
        out.append(ScoredCompletion(reward=total if parts else None, terms={**s.terms, ENV_TERM: env_reward}, extra=s.extra))
    return out


def _rewards(values: Sequence[float | None]) -> str:
    """The steps' rewards by turn: the ones that are not finite when there are any, else every one (8 at most)."""
    turns = [(t, v) for t, v in enumerate(values, start=1) if v is not None]
    shown = [(t, v) for t, v in turns if not math.isfinite(v)] or turns
    return "(" + ", ".join(f"turn {t}: {v!r}" for t, v in shown[:8]) + (", ..." if len(shown) > 8 else "") + ")"


def _env_reward_error(env: EnvConfig, prompt: Prompt, what: str, fix: str) -> EnvironmentRewardError:
    return EnvironmentRewardError(
        f"environment {env.factory!r} gave an episode of prompt {prompt.id} a reward that is not a finite number: "
        f"{what}. Fix: {fix}; None leaves an episode unscored by the environment."
    )


def term_names(reward_names: Sequence[str], env: EnvConfig | None) -> list[str]:
    """The reward terms reported per step: the functions', and `env` with an environment."""
    return [*reward_names, ENV_TERM] if env is not None else list(reward_names)


def count_episode(counters: MutableMapping[str, int], completion: Completion) -> None:
    """A finished rollout's episode totals (re-tokenization drift)."""
    if completion.episode is not None and completion.episode.drift_turns:
        counters["env/retokenization_drift_total"] += 1
