"""Overhead of reward.isolation: process against thread, on a cheap sync reward (builtin:repeat_letter).

Groups of 8 completions of 64 and of 4,096 characters. "sequential": one group scored at a time (the latency a
group pays); "concurrent": 8 groups scored at once, as when several groups finish together
(throughput; reward.workers = 4). "loop CPU" is the CPU time of the event loop's thread per
sequential group (the cost of handing a call over and back; the function itself runs elsewhere). Workers are started before timing (the
first call of a run pays the start, reported separately).

    .venv/bin/python bench/reward_isolation.py [groups]
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

from asyncgrpo.rewards.resolve import resolve_rewards
from asyncgrpo.rewards.scoring import RewardScorer
from asyncgrpo.types import Prompt

SPECS = ["builtin:repeat_letter"]
PROMPT = Prompt(id=0, text="say a: ", token_ids=(1,), columns={"letter": "a"})
GROUP_SIZE = 8


async def measure(isolation: str, groups: int, chars: int) -> dict[str, float]:
    group = ["a" * (chars // 2) + "b" * (chars // 2)] * GROUP_SIZE
    async with RewardScorer(resolve_rewards(SPECS), timeout_s=30, isolation=isolation, specs=SPECS, workers=4) as scorer:
        began = time.perf_counter()
        await scorer.score(PROMPT, group)
        first = time.perf_counter() - began
        await asyncio.gather(*(scorer.score(PROMPT, group) for _ in range(8)))  # every worker started
        latencies = []
        loop_cpu = time.thread_time()  # CPU of the event loop's thread only: what a call costs the loop
        for _ in range(groups):
            began = time.perf_counter()
            await scorer.score(PROMPT, group)
            latencies.append(time.perf_counter() - began)
        loop_cpu = time.thread_time() - loop_cpu
        began = time.perf_counter()
        for _ in range(groups // 8):
            await asyncio.gather(*(scorer.score(PROMPT, group) for _ in range(8)))
        concurrent = (groups // 8) * 8 / (time.perf_counter() - began)
    return {
        "first_ms": first * 1e3,
        "median_ms": statistics.median(latencies) * 1e3,
        "p90_ms": statistics.quantiles(latencies, n=10)[-1] * 1e3,
        "sequential_per_s": len(latencies) / sum(latencies),
        "concurrent_per_s": concurrent,
        "loop_cpu_us": loop_cpu / groups * 1e6,
    }


def main() -> None:
    groups = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    print("| completion chars | isolation | first call ms | latency per group, median ms | p90 ms | loop CPU µs per group | "
          "groups/s sequential | groups/s 8 at once |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for chars in (64, 4096):
        rows = {isolation: asyncio.run(measure(isolation, groups, chars)) for isolation in ("thread", "process")}
        for isolation, r in rows.items():
            print(
                f"| {chars} | {isolation} | {r['first_ms']:.1f} | {r['median_ms']:.3f} | {r['p90_ms']:.3f} | {r['loop_cpu_us']:.0f} | "
                f"{r['sequential_per_s']:.0f} | {r['concurrent_per_s']:.0f} |"
            )


if __name__ == "__main__":
    main()
