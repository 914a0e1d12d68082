"""Orchestration scaling: rollouts per CPU-second and memory per rollout as the rollouts in flight grow.

Issue 15's workload (bench/orchestration_overhead.py: lognormal latency median 0.2 s, sigma 1, training capacity =
generation capacity, K = 1, instant reward, no faults) widened: G groups per step and G groups' worth of request
slots, so `generation.max_inflight` = G x group size rollouts are in flight. On virtual time the CPU is the
orchestration's own, so a flat "rollouts / CPU-s" column means the cost per rollout does not grow with the width.

Columns:
- rollouts / CPU-s: completed rollouts over the process CPU time of the whole simulation (at least `--rollouts`
  rollouts and 8 steps).
- KiB / rollout in flight: the peak of Python's traced allocations (tracemalloc) during a 3-step run, less the
  allocations before it, divided by the rollouts in flight (what one in-flight rollout costs, with its share of the
  group, task, timers and books).
- trained digest: a hash of every trained group's (step order, prompt id, epoch, rollout token counts); the simulator
  is deterministic, so a change to the orchestration that keeps the behaviour prints the same digest.

    PYTHONPATH=src .venv/bin/python bench/orchestration_scaling.py [--widths 64,512,4096,16384] [--group-sizes 2,8] [--rollouts N]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import logging
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from orchestration_overhead import workload  # noqa: E402  (a sibling benchmark's workload)

from asyncgrpo.commands.simulate import Simulation, simulate  # noqa: E402

MEASURED_STEPS = 8
MEMORY_STEPS = 3


def trained_digest(sim: Simulation) -> str:
    """Twelve hex digits that change when any trained group, its order or its rollouts' lengths change."""
    h = hashlib.sha256()
    for group in sim.trainer.trained_groups:
        lengths = ",".join(str(len(r.completion.token_ids)) for r in group.rollouts)
        h.update(f"{group.prompt.id}/{group.prompt.epoch}:{lengths};".encode())
    return h.hexdigest()[:12]


def throughput(group_size: int, width: int, rollouts: int) -> dict[str, float | str]:
    groups_per_step = width // group_size
    cfg = workload(group_size, max(rollouts, MEASURED_STEPS * width), groups_per_step)
    gc.collect()
    cpu = time.process_time()
    sim = simulate(cfg)
    cpu = time.process_time() - cpu
    done = sim.generator.completed  # type: ignore[attr-defined]
    return {"rollouts": done, "cpu_s": cpu, "per_cpu_s": done / cpu, "digest": trained_digest(sim)}


def memory_per_rollout(group_size: int, width: int) -> float:
    """Bytes per rollout in flight: peak traced allocations of a short run over the width."""
    cfg = workload(group_size, MEMORY_STEPS * width, width // group_size)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        simulate(cfg)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return (peak - before) / width


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", default="64,512,4096,16384", help="rollouts in flight, comma-separated")
    parser.add_argument("--group-sizes", default="2,8", help="group sizes, comma-separated")
    parser.add_argument("--rollouts", type=int, default=48_000, help="least rollouts per measurement (default 48000)")
    parser.add_argument("--no-memory", action="store_true", help="skip the tracemalloc runs (they take as long again)")
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    group_sizes = [int(g) for g in args.group_sizes.split(",")]
    logging.basicConfig(level=logging.ERROR)  # the coin reward's zero-variance warning is expected here
    print("| group size | rollouts in flight | groups per step | rollouts | CPU s | rollouts / CPU-s | vs narrowest | "
          "KiB / rollout in flight | trained digest |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for group_size in group_sizes:
        first: float | None = None
        for width in widths:
            if width % group_size:
                raise SystemExit(f"--widths: {width} is not a multiple of group size {group_size}")
            r = throughput(group_size, width, args.rollouts)
            first = first or float(r["per_cpu_s"])
            kib = "-" if args.no_memory else f"{memory_per_rollout(group_size, width) / 1024:.1f}"
            print(f"| {group_size} | {width:,} | {width // group_size:,} | {r['rollouts']:,.0f} | {r['cpu_s']:.2f} | "
                  f"{r['per_cpu_s']:,.0f} | {float(r['per_cpu_s']) / first:.2f} | {kib} | {r['digest']} |", flush=True)


if __name__ == "__main__":
    main()
