"""The simulator's environments: `SimulatedHosts` makes one `SimulatedHost` per episode, on virtual time.

Job: stand in for `env.factory` under `asyncgrpo simulate` and the chaos suite, as the scripted
backend stands in for a generation server (simulate.env holds the model). A host
implements `EnvironmentHost` directly and runs no threads: each reset or step takes sampled virtual
time and may raise (an error, or a `TransientEnvironmentError`); a step ends the episode with
its step index's probability (`done_probs`, the last repeating; `done_prob` when that is null; a reset starts the count
again), and observes `observation_chars` characters. Cancelled, a cooperative episode stops after a sampled `stop_s` (abandoned if that
outlives the grace); one drawn to ignore cancellation always outlives the grace and is abandoned.

Invariants: deterministic for a seed (host n of a run draws from its own stream, in the order the
episodes start, which the virtual loop makes deterministic); `abandoned` counts the cancels that
returned False, so a test can hold `env/abandoned_total` to it, and `stopped` those that returned True.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Mapping
from typing import Any

from asyncgrpo.config import EnvConfig, ScriptedEnvConfig
from asyncgrpo.distributions import sample
from asyncgrpo.environments.protocol import EnvironmentHost, Message, StepResult, TransientEnvironmentError


class SimulatedHost:
    def __init__(self, model: ScriptedEnvConfig, rng: random.Random, role: str, hosts: SimulatedHosts) -> None:
        self._model = model
        self._rng = rng
        self._role = role
        self._hosts = hosts
        self.ignores_cancel = rng.random() < model.ignore_cancel_prob
        self._steps = 0  # since the last reset
        self.close_error: BaseException | None = None  # a simulated close never raises

    async def _call(self, what: str) -> None:
        await asyncio.sleep(sample(self._model.call_s, self._rng))
        draw = self._rng.random()
        if draw < self._model.error_prob:
            raise RuntimeError(f"simulated environment error in {what}")
        if draw < self._model.error_prob + self._model.transient_prob:
            raise TransientEnvironmentError(f"simulated transient environment error in {what}")

    async def reset(self, row: Mapping[str, Any]) -> tuple[Message, ...]:
        await self._call("reset")
        self._steps = 0
        return ({"role": self._role, "content": "start"},)

    async def step(self, action_text: str) -> StepResult:
        await self._call("step")
        reward = 1.0 if self._rng.random() < self._model.reward_prob else 0.0
        done = self._rng.random() < done_prob(self._model, self._steps)
        self._steps += 1
        return StepResult(({"role": self._role, "content": observation(self._model.observation_chars)},), reward, done, {})

    async def close(self) -> None:
        return None

    async def cancel(self, grace_s: float) -> bool:
        stop_s = float("inf") if self.ignores_cancel else sample(self._model.stop_s, self._rng)
        await asyncio.sleep(min(stop_s, grace_s))
        stopped = stop_s <= grace_s
        self._hosts.abandoned += not stopped
        self._hosts.stopped += stopped
        return stopped


def done_prob(model: ScriptedEnvConfig, index: int) -> float:
    """The probability that an episode's step `index` (0: its first) ends it: done_probs' entry, the last repeating, or done_prob."""
    if model.done_probs is None:
        return model.done_prob
    return model.done_probs[min(index, len(model.done_probs) - 1)]


def observation(chars: int) -> str:
    """A step's observation of `chars` characters ("next" at the default 4)."""
    return ("next" * (chars // 4 + 1))[:chars]


class SimulatedHosts:
    """`host_factory` for the episode runner: a new seeded `SimulatedHost` per episode."""

    def __init__(self, model: ScriptedEnvConfig, seed: int) -> None:
        self._model = model
        self._seed = seed
        self._made = 0
        self.abandoned = 0
        self.stopped = 0

    def __call__(self, env: EnvConfig) -> EnvironmentHost:
        self._made += 1
        digest = hashlib.blake2b(f"{self._seed}:env:{self._made}".encode(), digest_size=8).digest()
        return SimulatedHost(self._model, random.Random(int.from_bytes(digest, "little")), env.observation_role, self)
