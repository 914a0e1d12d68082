"""What one episode pays for env.isolation: process against thread: a worker process started, the environment
created in it, reset, one step, close (the worker exits) — sequentially, and 8 episodes at once.

The environment is the built-in calculator (its module imports nothing heavy); an environment whose module is
slow to import (OpenEnv's: about 2.5 s) pays that import in every worker, i.e. once per episode.

    .venv/bin/python bench/env_isolation.py [episodes]
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

from asyncgrpo.environments.process_host import ProcessHost
from asyncgrpo.environments.thread_host import ThreadHost

SPEC = "asyncgrpo.environments.calculator:CalculatorEnv"
ROW = {"prompt": [{"role": "user", "content": "what is 37*8?"}], "answer": "296"}


async def episode(host_class: type) -> float:
    began = time.perf_counter()
    host = host_class(SPEC, "tool")
    await host.reset(ROW)
    await host.step("calc: 37*8")
    await host.close()
    return time.perf_counter() - began


async def measure(host_class: type, episodes: int) -> tuple[float, float, float]:
    latencies = [await episode(host_class) for _ in range(episodes)]
    began = time.perf_counter()
    for _ in range(episodes // 8):
        await asyncio.gather(*(episode(host_class) for _ in range(8)))
    per_episode_concurrent = (time.perf_counter() - began) / max(1, episodes // 8 * 8)
    return statistics.median(latencies), max(latencies), per_episode_concurrent


def main() -> None:
    episodes = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    print("| isolation | median episode (s) | max (s) | 8 at once, per episode (s) |")
    print("|---|---|---|---|")
    for name, host_class in (("thread", ThreadHost), ("process", ProcessHost)):
        median, worst, concurrent = asyncio.run(measure(host_class, episodes))
        print(f"| {name} | {median:.4f} | {worst:.4f} | {concurrent:.4f} |")


if __name__ == "__main__":
    main()
