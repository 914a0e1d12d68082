"""env.isolation: process in the collector: stopping a group whose environments ignore their tokens and loop
forever stops their side effects within the grace (the workers are killed) and leaves no process; the work is
stopped, so nothing is abandoned, and cancellation is not a failure. An episode whose environment raises in its
worker is counted and the survivors are scored."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from tests.component.test_process_host import Stubborn, alive, group_members
from tests.sim.fakes import Fate, ProgrammedGenerator, make_collector, recipe

pytestmark = pytest.mark.timeout(120)
FAST = Fate(after_s=0.001, tokens=3)


class Ticking(Stubborn):
    """test_process_host's Stubborn (ignores its token and close(), ticks forever) with its tick file at
    $TICKS_DIR/<worker pid>: the collector's rows carry no path."""

    def reset(self, row):
        self.path = Path(os.environ["TICKS_DIR"]) / str(os.getpid())
        return None


class FailsInOneWorker:
    """The second episode of every four (numbered across worker processes by files in $TICKS_DIR) raises in step."""

    def reset(self, row):
        index = 0
        while True:
            try:
                os.close(os.open(Path(os.environ["TICKS_DIR"]) / f"episode-{index}", os.O_CREAT | os.O_EXCL))
                break
            except FileExistsError:
                index += 1
        self.fail = index % 4 == 1
        return None

    def step(self, action_text):
        if self.fail:
            raise ValueError("broken tool")
        return "fine", 1.0, True, {}

    def close(self):
        pass


def process_recipe(factory: str, *, grace_s: float = 0.2, group_size: int = 2):
    return recipe(
        env={"factory": f"tests.component.test_process_episodes:{factory}", "cancel_grace_s": grace_s, "max_turns": 2, "isolation": "process"},
        reward={"functions": []},
        generation={"max_inflight": group_size},
        rollout={"group_size": group_size, "groups_per_step": 1, "min_group_survivors": 2},
    )


def ticks(directory: Path) -> dict[int, int]:
    return {int(p.name): p.read_text().count("\n") for p in directory.iterdir() if p.name.isdigit()}


def test_stopping_the_collector_kills_workers_that_ignore_their_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("TICKS_DIR", str(tmp_path))

    async def main():
        collector = make_collector(process_recipe("Ticking"), ProgrammedGenerator(lambda request, attempt: FAST))
        async with asyncio.timeout(90):
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(collector.run())
                while len(ticks(tmp_path)) < 2 or min(ticks(tmp_path).values()) < 3:  # both episodes are in step
                    await asyncio.sleep(0.01)
                collector.stop()
        return collector, ticks(tmp_path)

    collector, at_stop = asyncio.run(main())
    assert len(at_stop) == 2
    for pid in at_stop:
        assert not alive(pid) and group_members(pid) == []
    time.sleep(0.1)
    assert ticks(tmp_path) == at_stop  # the side effects stopped moving by the time run() returned
    assert collector.counters["env/abandoned_total"] == 0  # killed, not abandoned
    assert collector.counters["rollout/failed_total"] == 0 and collector.counters["env/errors_total"] == 0


def test_an_error_in_a_worker_fails_its_rollout_and_the_survivors_are_scored(tmp_path, monkeypatch):
    monkeypatch.setenv("TICKS_DIR", str(tmp_path))

    async def main():
        generator = ProgrammedGenerator(lambda request, attempt: FAST)
        collector = make_collector(process_recipe("FailsInOneWorker", group_size=4), generator)
        async with asyncio.timeout(90):
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(collector.run())
                batch = await collector.next_batch(0, 60.0)
                collector.stop()
        return collector, batch

    collector, batch = asyncio.run(main())
    (group,) = batch
    assert group.failed_rollouts == 1 and [r.reward for r in group.rollouts] == [1.0, 1.0, 1.0]
    assert collector.counters["env/errors_total"] == collector.counters["rollout/failed_total"] >= 1
