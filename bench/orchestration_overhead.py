"""Orchestration overhead: rollouts the collector handles per CPU-second, on the simulator (virtual time).

The scripted backend and the stub trainer cost next to nothing, so the CPU time of a simulation
is the collector's, the pipeline's and the event loop's own: admission, slots, group and rollout
tasks, retries, scoring (an inline reward), the buffer and the accounting. The workload is the
NeMo-RL-comparable one of issue 15: 8 groups per step, 8 groups' worth of request slots, lognormal
latency (median 0.2 s, sigma 1), training capacity = generation capacity, no faults; groups of 2
and of 8. Also reports the garbage collector's pauses during the run (`gc.callbacks`), which land
on the event loop.

    PYTHONPATH=src .venv/bin/python bench/orchestration_overhead.py [--rollouts N] [--profile]

`--profile` prints the top functions of a cProfile run (by own time) after the table.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import logging
import math
import pstats
import time

from asyncgrpo.commands.simulate import simulate
from asyncgrpo.config import Config, load_config

GROUPS_PER_STEP = 8
MEDIAN_S, SIGMA = 0.2, 1.0


def workload(group_size: int, rollouts: int, groups_per_step: int = GROUPS_PER_STEP) -> Config:
    """Issue 15's workload with `groups_per_step` groups per step and as many groups' worth of request slots."""
    slots = groups_per_step * group_size
    mean_latency = MEDIAN_S * math.exp(SIGMA**2 / 2)
    # Training capacity (a step of `slots` rollouts per step_time) = generation capacity (`slots` per mean latency).
    step_time = mean_latency
    steps = rollouts // slots
    prompts = max(512, 4 * groups_per_step)  # 512 at the default width, as issue 15 measured
    return load_config("recipes/simulate.yaml", [
        "data.source=builtin:repeat_letter", f"data.builtin_size={prompts}", f"data.num_epochs={steps * groups_per_step // prompts + 8}",
        "reward.functions=[builtin:coin]", "simulate.faults=[]",
        f"simulate.latency_s={{dist: lognormal, median: {MEDIAN_S}, sigma: {SIGMA}}}",
        "simulate.tokens={dist: const, value: 24}", "generation.max_new_tokens=24",
        f"generation.max_inflight={slots}", "generation.request_timeout_s=30", "generation.rollout_deadline_s=90",
        f"rollout.group_size={group_size}", f"rollout.groups_per_step={groups_per_step}", "rollout.max_staleness=1",
        "rollout.max_drop_fraction=1.0", f"simulate.step_time_s={step_time:.6f}", f"train.max_steps={steps}",
    ])


class GcPauses:
    """CPU and wall time of every collection during a run, from gc.callbacks' start/stop pairs. The CPU time is
    what a collection costs; the wall time is what the loop felt, and on a busy machine includes being descheduled."""

    def __init__(self) -> None:
        self.pauses: list[float] = []  # CPU seconds
        self.wall: list[float] = []
        self._started = (0.0, 0.0)

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = (time.thread_time(), time.perf_counter())
        else:
            self.pauses.append(time.thread_time() - self._started[0])
            self.wall.append(time.perf_counter() - self._started[1])

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        gc.callbacks.remove(self)


def measure(group_size: int, rollouts: int, profiler: cProfile.Profile | None = None) -> dict[str, float]:
    cfg = workload(group_size, rollouts)
    gc.collect()
    with GcPauses() as pauses:
        cpu, wall = time.process_time(), time.perf_counter()
        if profiler is not None:
            profiler.enable()
        sim = simulate(cfg)
        if profiler is not None:
            profiler.disable()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    done = sim.generator.completed  # type: ignore[attr-defined]
    report = sim.report()
    return {
        "rollouts": done, "cpu_s": cpu, "wall_s": wall, "per_cpu_s": done / cpu, "efficiency": report["efficiency"],
        "gc_count": len(pauses.pauses), "gc_total_ms": 1000 * sum(pauses.pauses),
        "gc_max_ms": 1000 * max(pauses.pauses, default=0.0), "gc_max_wall_ms": 1000 * max(pauses.wall, default=0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=48_000, help="rollouts per measurement (default 48000)")
    parser.add_argument("--profile", action="store_true", help="also print a cProfile of each group size")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the coin reward's zero-variance warning is expected here
    print("| group size | rollouts | CPU s | rollouts / CPU-s | efficiency | gc collections | gc CPU ms, total | "
          "gc CPU ms, longest | gc wall ms, longest |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    profiles = {}
    for group_size in (2, 8):
        profiler = cProfile.Profile(time.thread_time) if args.profile else None  # CPU time, not wall time
        r = measure(group_size, args.rollouts, profiler)
        print(f"| {group_size} | {r['rollouts']:.0f} | {r['cpu_s']:.2f} | {r['per_cpu_s']:,.0f} | {r['efficiency']:.2f} | "
              f"{r['gc_count']:.0f} | {r['gc_total_ms']:.0f} | {r['gc_max_ms']:.1f} | {r['gc_max_wall_ms']:.1f} |")
        if profiler is not None:
            profiles[group_size] = profiler
    for group_size, profiler in profiles.items():
        print(f"\ncProfile, groups of {group_size} (own time; profiling slows everything about 2x):")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
