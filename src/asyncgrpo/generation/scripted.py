"""The scripted backend: a seeded stand-in for a generation server, for `asyncgrpo simulate` and the tests.

It reads time only through the event loop (so it runs on virtual time), uses no threads,
and is deterministic for a seed: every attempt of every request draws from its own
random stream, seeded by (run seed, request id, attempt number), so the outcome of a
request does not depend on what else is in flight.

Per attempt it first applies the configured faults, in order (each with its probability,
inside its time window, for its prompts), then waits the sampled latency and returns a
completion of the sampled length, stamped with the serving version at dispatch (as an
HTTP server would). Its token ids and logprobs are a slice, at a random offset, of a pool
drawn once per generator: drawing them per token took three quarters of a simulation's time.

Two ways to draw latency and length:
- `latency_s` mode (the default): latency and length are drawn apart, per attempt.
- `token_model` mode: a completion costs its tokens. A prompt's length is drawn from `tokens` once
  per (run seed, prompt id), so a group's members share it and a requeued prompt keeps it (a hard
  prompt stays hard); each attempt multiplies it by a lognormal factor of median 1
  (`rollout_sigma`) and clamps it to [1, max_new_tokens]. The attempt then takes
  `prefill_s + tokens * decode_s_per_token * max(1, n / batch_knee)`, n being the requests open at
  its dispatch (itself included): a batch-throughput curve where a server decodes up to
  `batch_knee` sequences at full speed and shares a fixed token throughput among more.

`drawn_lengths` keeps, per prompt id, the length of every attempt the policy asked for (token
mode: drawn at dispatch, whether it finished or was cancelled; latency mode: the finished ones,
whose length does not depend on their latency) - the population a length bias is measured against.

Fault kinds and the error class each raises:

    http_500, http_429, connection_refused  -> TransientGenerationError (retried)
    http_400                                -> GenerationError (not retried)
    prompt_too_long                         -> PromptRejectedError (invalid prompt)
    http_404                                -> MisconfiguredBackendError (fatal at once)
    exception                               -> RuntimeError (not retried)
    hang                                    -> never answers; the request deadline ends it

A weight publication (`load_weights`) draws from its own stream, seeded by (run seed, version):
it applies `weight_sync_faults` (`fail` raises WeightSyncError, fatal like an HTTP backend none
of whose servers took the weights; `hang` never returns, so the pipeline's
`generation.weight_sync_timeout_s` ends it), then takes `weight_sync_s` of virtual time, serving
the old version meanwhile, and only then serves the new one.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
from collections import Counter
from collections.abc import Mapping
from typing import Any

from asyncgrpo.config import Distribution, FaultConfig, SimulateConfig, WeightSyncFaultConfig
from asyncgrpo.errors import GenerationError, MisconfiguredBackendError, PromptRejectedError, TransientGenerationError
from asyncgrpo.generation.weight_sync import WeightSyncError
from asyncgrpo.types import Completion, GenerationRequest

TOKEN_POOL_SLACK = 4096  # pool positions beyond max_new_tokens: the offsets a completion can start at


def sample(dist: Distribution, rng: random.Random) -> float:
    if dist.dist == "const":
        value = float(dist.value)  # type: ignore[arg-type]
    elif dist.dist == "uniform":
        value = rng.uniform(dist.low, dist.high)  # type: ignore[arg-type]
    else:
        value = float(dist.median) * math.exp(float(dist.sigma) * rng.gauss(0.0, 1.0))  # type: ignore[arg-type]
    return min(value, dist.max) if dist.max is not None else value


def mean_of(dist: Distribution) -> float:
    """Expected value (before the `max` clamp) - used for the simulator's capacity bound."""
    if dist.dist == "const":
        return float(dist.value)  # type: ignore[arg-type]
    if dist.dist == "uniform":
        return (float(dist.low) + float(dist.high)) / 2  # type: ignore[arg-type]
    return float(dist.median) * math.exp(float(dist.sigma) ** 2 / 2)  # type: ignore[arg-type]


class ScriptedGenerator:
    def __init__(self, cfg: SimulateConfig, *, seed: int, max_new_tokens: int, name: str = "scripted") -> None:
        self.name = name
        self.cfg = cfg
        self.seed = seed
        self.max_new_tokens = max_new_tokens
        self._version = 0
        self._attempts: Counter[str] = Counter()
        self.aborted = 0  # requests cancelled while in progress (the server stopped generating them)
        self.completed = 0
        self.in_progress = 0
        self.drawn_lengths: dict[int, list[int]] = {}
        self._prompt_lengths: dict[int, float] = {}
        pool_rng = random.Random(_stream_seed(seed, "token-pool", 0))
        pool_size = max_new_tokens + TOKEN_POOL_SLACK
        self._token_pool = tuple(pool_rng.randrange(4, 64) for _ in range(pool_size))
        self._logprob_pool = tuple(-pool_rng.expovariate(1.0) for _ in range(pool_size))

    @property
    def serving_version(self) -> int:
        return self._version

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def load_weights(self, state: Mapping[str, Any] | None, version: int) -> None:
        loop = asyncio.get_running_loop()
        rng = random.Random(_stream_seed(self.seed, "weights", version))
        now = loop.time()
        for fault in self.cfg.weight_sync_faults:
            if _in_window(fault, now) and rng.random() < fault.rate:
                if fault.error == "fail":
                    raise WeightSyncError(f"scripted fault: no server loaded weights v{version}", backend=self.name)
                await loop.create_future()  # hang: the pipeline's weight_sync_timeout_s cancels it
        await asyncio.sleep(sample(self.cfg.weight_sync_s, rng))
        self._version = version

    async def generate(self, request: GenerationRequest) -> Completion:
        self._attempts[request.request_id] += 1
        rng = random.Random(_stream_seed(self.seed, request.request_id, self._attempts[request.request_id]))
        dispatch_version = self._version
        now = asyncio.get_running_loop().time()
        model = self.cfg.token_model
        length = None
        if model is not None:
            length = self._draw(request, self._prompt_length(request.prompt_id) * math.exp(model.rollout_sigma * rng.gauss(0.0, 1.0)))
        self.in_progress += 1
        try:
            for fault in self.cfg.faults:
                if _applies(fault, request.prompt_id, now) and rng.random() < fault.rate:
                    await self._inject(fault, request)
            if model is None:
                await asyncio.sleep(sample(self.cfg.latency_s, rng))
            else:
                assert length is not None
                slowdown = max(1.0, self.in_progress / model.batch_knee)
                await asyncio.sleep(model.prefill_s + length * model.decode_s_per_token * slowdown)
        except asyncio.CancelledError:
            self.aborted += 1
            raise
        finally:
            self.in_progress -= 1
        if length is None:
            length = self._draw(request, sample(self.cfg.tokens, rng))
        self.completed += 1
        start = rng.randrange(len(self._token_pool) - length + 1)
        return Completion(
            token_ids=self._token_pool[start : start + length],
            logprobs=self._logprob_pool[start : start + length],
            versions=(dispatch_version,) * length,
            finish_reason="length" if length >= request.sampling.max_new_tokens else "stop",
            dispatch_version=dispatch_version,
            text=f"{request.request_id}:{rng.getrandbits(32)}",
        )

    def _prompt_length(self, prompt_id: int) -> float:
        """The prompt's own length (token mode): drawn once per (run seed, prompt id)."""
        if prompt_id not in self._prompt_lengths:
            self._prompt_lengths[prompt_id] = sample(self.cfg.tokens, random.Random(_stream_seed(self.seed, "prompt-length", prompt_id)))
        return self._prompt_lengths[prompt_id]

    def _draw(self, request: GenerationRequest, tokens: float) -> int:
        """A drawn length clamped to [1, max_new_tokens], recorded in `drawn_lengths`."""
        length = max(1, min(self.max_new_tokens, request.sampling.max_new_tokens, round(tokens)))
        self.drawn_lengths.setdefault(request.prompt_id, []).append(length)
        return length

    async def _inject(self, fault: FaultConfig, request: GenerationRequest) -> None:
        where = f"scripted fault for request {request.request_id}"
        kind = fault.error
        if kind in ("http_500", "http_429", "connection_refused"):
            raise TransientGenerationError(f"{kind} ({where})", backend=self.name)
        if kind == "http_400":
            raise GenerationError(f"HTTP 400 Bad Request ({where})", backend=self.name)
        if kind == "prompt_too_long":
            raise PromptRejectedError(f"prompt too long ({where})", backend=self.name)
        if kind == "http_404":
            raise MisconfiguredBackendError(f"HTTP 404: model not found ({where})", backend=self.name)
        if kind == "exception":
            raise RuntimeError(f"exception ({where})")
        # hang: wait on a future nobody completes; the caller's request deadline cancels it.
        await asyncio.get_running_loop().create_future()


def _applies(fault: FaultConfig, prompt_id: int, now: float) -> bool:
    if fault.prompts is not None and prompt_id not in fault.prompts:
        return False
    return _in_window(fault, now)


def _in_window(fault: FaultConfig | WeightSyncFaultConfig, now: float) -> bool:
    return now >= fault.from_s and (fault.until_s is None or now < fault.until_s)


def _stream_seed(seed: int, stream: str, index: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{stream}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")
