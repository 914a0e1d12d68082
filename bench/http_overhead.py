"""The HTTP path against the server's own bound, measured in the same run: what share of the samples/s the server
allows does asyncgrpo's HTTP generator (with the whole pipeline behind it) reach?

The server is the fake vLLM-dialect server of bench/http_throughput.py (a child process, aiohttp): it answers
``POST /v1/completions`` after a uniform 0-50 ms with a canned completion of `--tokens` tokens. Two clients take
turns against it, each with 16 requests open:

- the bound: a bare aiohttp loop (16 workers, each POSTing the same body, reading the answer and parsing its JSON,
  then POSTing again). What the server, loopback and a minimal client allow; 16 slots over a 25 ms mean latency
  allow 640/s in theory.
- asyncgrpo: `run_pipeline` with the collector over `HttpGenerator` and a stub trainer (steps take ~0), groups of
  `--group-size`, 8 groups per step, `rollout.max_staleness` 1, an inline length reward. Two rates: requests the
  server answered per second (the HTTP path's own share of the bound, whatever training then does with them), and
  samples trained per second after the first step (less the groups the staleness policy threw away); and the
  client process's CPU per trained sample.

Runs alternate (bound, asyncgrpo, bound, asyncgrpo, ...) so load on the machine hits both alike; each asyncgrpo
run's ratio is over the mean of the bound runs beside it.

    PYTHONPATH=src .venv/bin/python bench/http_overhead.py [--rounds 3] [--steps 40] [--profile]

`--profile` adds one cProfile of an asyncgrpo run and prints its top functions by own time.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import logging
import pstats
import statistics
import time

from http_throughput import CONCURRENCY, FakeServerProcess, measure

GROUPS_PER_STEP = 8


async def bound(url: str, requests: int, tokens: int) -> tuple[float, float]:
    """(requests/s, client CPU ms per request) of a bare aiohttp client keeping CONCURRENCY requests open."""
    import aiohttp

    body = {"model": "fake", "prompt": [5, 6, 7, 8], "max_tokens": tokens, "temperature": 1.0, "top_p": 1.0, "n": 1,
            "logprobs": 0, "return_token_ids": True, "stop_token_ids": [2]}
    left = requests

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                json.loads(await resp.text())["choices"][0]["token_ids"]

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async with asyncio.TaskGroup() as warm:  # connections open before timing
            for _ in range(CONCURRENCY):
                warm.create_task(session.get(f"{url}/health"))
        wall, cpu = time.perf_counter(), time.process_time()
        async with asyncio.TaskGroup() as group:
            for _ in range(CONCURRENCY):
                group.create_task(worker(session))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return requests / wall, 1000 * cpu / requests


def asyncgrpo_run(url: str, args, profiler: cProfile.Profile | None = None):
    if profiler is not None:
        profiler.enable()
    try:
        return asyncio.run(measure(url, failure_rate=0.0, backoff_s=None, steps=args.steps, seed=0,
                                   group_size=args.group_size, groups_per_step=GROUPS_PER_STEP, tokens=args.tokens,
                                   max_staleness=args.max_staleness))
    finally:
        if profiler is not None:
            profiler.disable()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="asyncgrpo runs, each between two bound runs")
    parser.add_argument("--steps", type=int, default=40, help="steps per asyncgrpo run")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=24, help="completion tokens per answer")
    parser.add_argument("--max-staleness", type=int, default=1, help="rollout.max_staleness")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    samples = args.steps * GROUPS_PER_STEP * args.group_size
    server = FakeServerProcess(0, (0.0, 0.05), tokens=args.tokens)
    try:
        bounds = [asyncio.run(bound(server.url, samples, args.tokens))]
        rows = []
        for _ in range(args.rounds):
            run = asyncgrpo_run(server.url, args)
            bounds.append(asyncio.run(bound(server.url, samples, args.tokens)))
            rows.append((run, statistics.fmean(b[0] for b in bounds[-2:])))
        print(f"{CONCURRENCY} requests open, server latency uniform 0-50 ms, {args.tokens}-token completions, groups of "
              f"{args.group_size}, {GROUPS_PER_STEP} groups/step, max_staleness {args.max_staleness}, {args.steps} steps "
              f"({samples} samples) per asyncgrpo run; bound runs of {samples} requests before and after each:\n")
        print("| run | bound req/s (mean of the two beside it) | asyncgrpo requests answered/s | ratio | asyncgrpo samples "
              "trained/s | ratio | stale groups | asyncgrpo client CPU ms/sample |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for i, (run, beside) in enumerate(rows, 1):
            print(f"| {i} | {beside:.0f} | {run.requests_per_s:.0f} | {run.requests_per_s / beside:.3f} | "
                  f"{run.samples_per_s:.0f} | {run.samples_per_s / beside:.3f} | {run.stale_groups} | "
                  f"{run.cpu_ms_per_sample:.3f} |")
        ratios = [run.samples_per_s / beside for run, beside in rows]
        print(f"\nmedian ratio of samples trained {statistics.median(ratios):.3f}; bound client CPU ms/request: "
              f"{statistics.fmean(b[1] for b in bounds):.3f}")
        if args.profile:
            profiler = cProfile.Profile(time.thread_time)  # CPU time: a busy machine's preemptions charge nothing
            asyncgrpo_run(server.url, args, profiler)
            print("\ncProfile of one asyncgrpo run (own time; profiling slows the client):")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
