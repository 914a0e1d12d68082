"""The teacher of `asyncgrpo simulate`: a scoring stage with seeded latency and faults, on virtual time.

It stands where the real teacher (distill/teacher.py) stands, behind the same `score(prompt, completions)`,
and fails the same ways: each call waits `simulate.teacher_latency_s` of loop time under `distill.timeout_s`
(past it: `TeacherTimeoutError`), and fails with probability `simulate.teacher_error_rate` (`TeacherError`).
Its log-probs are the sampled ones minus a seeded positive gap per token, so the KL estimate is positive.

Invariants: reads time only through the event loop, starts no thread or task, and is deterministic for a
seed: each call draws from a stream seeded by the run seed and the sample (its text names the request), so
its outcome does not depend on what else is in flight.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Sequence

from asyncgrpo.config import DistillConfig, SimulateConfig
from asyncgrpo.errors import TeacherError, TeacherTimeoutError
from asyncgrpo.generation.scripted import sample
from asyncgrpo.types import Completion, Prompt


class SimulatedTeacher:
    name = "simulated-teacher"

    def __init__(self, cfg: DistillConfig, model: SimulateConfig, *, seed: int) -> None:
        self.cfg = cfg
        self.model = model
        self.seed = seed
        self.scoring = 0  # calls in progress
        self.calls = 0

    def state(self) -> str:
        return f"teacher {self.name}: {self.scoring} calls being scored, {self.calls} started"

    async def score(self, prompt: Prompt, completions: Sequence[Completion]) -> list[list[float]]:
        key = f"{self.seed}:{prompt.id}:{prompt.epoch}:{prompt.requeues}:" + "|".join(c.text for c in completions)
        rng = random.Random(int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little"))
        self.calls += 1
        self.scoring += 1
        try:
            async with asyncio.timeout(self.cfg.timeout_s) as deadline:
                await asyncio.sleep(sample(self.model.teacher_latency_s, rng))
        except TimeoutError:
            if not deadline.expired():
                raise
            raise TeacherTimeoutError(
                f"teacher {self.name!r} did not score prompt {prompt.id} within distill.timeout_s = {self.cfg.timeout_s:g} s"
            ) from None
        finally:
            self.scoring -= 1
        if rng.random() < self.model.teacher_error_rate:
            raise TeacherError(f"teacher {self.name!r}: injected fault for prompt {prompt.id} (simulate.teacher_error_rate)")
        return [[lp - rng.expovariate(2.0) for lp in c.logprobs] for c in completions]
