"""Running a collector of agent episodes in the tests: a fake generator that answers with scripted text, and the drivers.

`TextGenerator` answers every request at once (or never), one id per character (`CODEC`, the simulator's codec), so a
sample's ids can be checked against its text. `first_batch` runs a collector until its first batch, `run_until` until a
condition, `train_until_stale` takes a batch a step until a group has gone stale; each stops the collector, within 60 s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from asyncgrpo.environments.conversation import CharCodec
from asyncgrpo.types import Completion, GenerationRequest
from tests.sim.fakes import make_collector

CODEC = CharCodec()


class TextGenerator:
    """Answers every request at once with `answer(request)`, encoded one id per character; one that `hang(request)` never."""

    name = "text"

    def __init__(self, answer=lambda request: "ok", hang=lambda request: False, hangs_awaited: int = 0) -> None:
        self.answer = answer
        self.hang = hang
        self.hanging = 0
        self.hangs_awaited = hangs_awaited
        self.all_hanging = asyncio.Event()  # set once `hangs_awaited` requests hang at once
        self.version = 0
        self.requests: list[GenerationRequest] = []
        self.aborted = 0

    @property
    def serving_version(self) -> int:
        return self.version

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def load_weights(self, state, version: int) -> None:
        self.version = version

    async def generate(self, request: GenerationRequest) -> Completion:
        self.requests.append(request)
        if self.hang(request):
            self.hanging += 1
            if self.hanging == self.hangs_awaited:
                self.all_hanging.set()
            try:
                await asyncio.get_running_loop().create_future()
            except asyncio.CancelledError:
                self.aborted += 1
                raise
            finally:
                self.hanging -= 1
        text = self.answer(request)
        ids = CODEC.encode(text)
        return Completion(token_ids=ids, logprobs=(-0.5,) * len(ids), versions=(self.version,) * len(ids), finish_reason="stop",
                          dispatch_version=self.version, text=text)


async def first_batch(cfg, generator):
    """A collector of `cfg` over `generator`, and its first batch."""
    collector = make_collector(cfg, generator)
    async with asyncio.timeout(60):
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(collector.run())
            batch = await collector.next_batch(0, 60.0)
            collector.stop()
    return collector, batch


async def run_until(collector, done: Callable[[], bool]) -> None:
    """Run `collector` until `done()` holds (checked on each change of its state), then stop it."""
    async with asyncio.timeout(60):
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(collector.run())
            await collector._signal.wait_for(done)
            collector.stop()


async def train_until_stale(collector, generator: TextGenerator) -> None:
    """Run `collector`, taking a batch a step (the step trained and its weights served at once), until a group has gone
    stale; then stop it."""
    async with asyncio.timeout(60):
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(collector.run())
            step = 0
            while collector.counters["rollout/stale_groups_total"] == 0:
                await collector.next_batch(step, 60.0)
                step += 1
                generator.version = step
                collector.step_trained()
                collector.weights_published()
            collector.stop()
