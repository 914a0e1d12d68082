"""Hand-written fakes for pipeline tests on virtual time.

`ProgrammedGenerator` decides each request attempt's fate with a function the test writes:
`fate(request, attempt) -> Fate`. It records every attempt, abort and completion so tests
can assert what the pipeline did to the backend, and when (`started_at`: a request's first
attempt; `finished_at`: its last attempt's end).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from asyncgrpo.config import validate_config
from asyncgrpo.types import Completion, GenerationRequest


@dataclass(frozen=True)
class Fate:
    """After `after_s` of virtual time: return a completion (error None), raise `error`, or never answer (hang)."""

    after_s: float = 1.0
    error: BaseException | None = None
    hang: bool = False
    tokens: int = 4


OK = Fate()


def member(request: GenerationRequest) -> int:
    return int(request.request_id.rsplit("-", 1)[1])


class ProgrammedGenerator:
    name = "programmed"

    def __init__(self, fate: Callable[[GenerationRequest, int], Fate] = lambda request, attempt: OK, weight_sync_s: float = 0.0) -> None:
        self.fate = fate
        self.weight_sync_s = weight_sync_s
        self.version = 0
        self.attempts: Counter[str] = Counter()
        self.aborted: list[str] = []
        self.completed: list[str] = []
        self.in_progress = 0
        self.started_at: dict[str, float] = {}
        self.finished_at: dict[str, float] = {}

    @property
    def serving_version(self) -> int:
        return self.version

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def load_weights(self, state: Mapping[str, Any] | None, version: int) -> None:
        await asyncio.sleep(self.weight_sync_s)
        self.version = version

    async def generate(self, request: GenerationRequest) -> Completion:
        self.attempts[request.request_id] += 1
        fate = self.fate(request, self.attempts[request.request_id])
        dispatch_version = self.version
        loop = asyncio.get_running_loop()
        self.started_at.setdefault(request.request_id, loop.time())
        self.in_progress += 1
        try:
            if fate.hang:
                await loop.create_future()
            await asyncio.sleep(fate.after_s)
        except asyncio.CancelledError:
            self.aborted.append(request.request_id)
            raise
        finally:
            self.in_progress -= 1
            self.finished_at[request.request_id] = loop.time()
        if fate.error is not None:
            raise fate.error
        self.completed.append(request.request_id)
        n = fate.tokens
        return Completion(
            token_ids=tuple(range(4, 4 + n)),
            logprobs=(-1.0,) * n,
            versions=(dispatch_version,) * n,
            finish_reason="stop",
            dispatch_version=dispatch_version,
            text=f"{request.request_id}",
        )


def recipe(**sections: dict[str, Any]):
    """A small simulate recipe with deterministic prompt order (0, 1, 2, ...); sections override the defaults.
    A `distill` section makes it `algorithm: distill`."""
    base: dict[str, Any] = {
        "run": {"name": "test", "seed": 0},
        "data": {"source": "builtin:repeat_letter", "builtin_size": 40, "shuffle": False},
        "reward": {"functions": ["builtin:coin"]},
        "generation": {"backend": "scripted", "max_inflight": 64, "request_timeout_s": 10.0, "rollout_deadline_s": 30.0,
                       "retry_backoff_s": 0.5, "retry_backoff_max_s": 2.0},
        "rollout": {"group_size": 2, "groups_per_step": 1, "max_staleness": 1, "stall_timeout_s": 600.0},
        "train": {"backend": "stub", "max_steps": 5},
        "simulate": {"step_time_s": 1.0},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    if "distill" in sections:
        base["algorithm"] = "distill"
    return validate_config(base)


def make_collector(cfg, generator):
    """A collector over the recipe's built-in data, in order, scored on the event loop (no threads)."""
    from asyncgrpo.data.loading import build_prompts, read_rows
    from asyncgrpo.wiring.collector import build_collector

    rows = read_rows(cfg.data.source, builtin_size=cfg.data.builtin_size, seed=0)
    prompts, _ = build_prompts(rows, prompt_key="prompt", tokenizer=None, max_prompt_tokens=256)
    return build_collector(cfg, prompts, generator, isolation="inline")
