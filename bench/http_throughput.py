"""Throughput of the HTTP generation path when the server fails some requests: samples/s clean and with
20 % injected HTTP 500s, through the real client (`HttpGenerator`) and the collector's retry/backoff.

The server is a fake OpenAI-compatible server (aiohttp, in a child process so its CPU does not
compete with the client's event loop): ``POST /v1/completions`` sleeps a uniform 0-50 ms, then answers
HTTP 500 with probability ``--failure-rate`` or a canned 8-token completion. The client side is the
whole pipeline of a run: `run_pipeline` with a `Collector` over `HttpGenerator` and the stub trainer
(steps take ~0, publish no weights), `generation.max_inflight` = 16 open requests, groups of 8,
8 groups per step, `rollout.max_staleness` 1. A measurement trains `--steps` steps; throughput is the
samples trained per second after the first step (steady state).

Every row runs the same requests with one `generation.retry_backoff_s` (default: the config's default,
0.02 s; `retry_backoff_max_s` stays at its default 10 s). The first table is the default; the second
sweeps the backoff to show where the loss under failures comes from.

    .venv/bin/python bench/http_throughput.py [--steps 24] [--failure-rate 0.2] [--backoffs 0.1,0.05,0.02]
        [--max-staleness 1] [--max-latency-ms 50] [--repeats 1]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import random
import time
from dataclasses import dataclass

CONCURRENCY = 16
GROUP_SIZE = 8
GROUPS_PER_STEP = 8
LATENCY_S = (0.0, 0.05)
COMPLETION = {"text": "abcdefgh", "token_ids": [10, 11, 12, 13, 14, 15, 16, 17],
              "logprobs": {"token_logprobs": [-1.0] * 8, "tokens": list("abcdefgh")}, "finish_reason": "length"}


# ----------------------------------------------------------------------------- the fake server (child process)


def serve(port_out, control, seed: int, latency_s: tuple[float, float] = LATENCY_S) -> None:
    """Run the fake server until `control` receives anything; report its port through `port_out`."""
    from aiohttp import web

    rng = random.Random(seed)
    state = {"failure_rate": 0.0, "requests": 0, "failed": 0}

    async def completions(request: web.Request) -> web.Response:
        await request.read()
        state["requests"] += 1
        await asyncio.sleep(rng.uniform(*latency_s))
        if rng.random() < state["failure_rate"]:
            state["failed"] += 1
            return web.json_response({"error": {"message": "injected failure", "code": 500}}, status=500)
        return web.json_response({"id": "cmpl", "object": "text_completion", "model": "fake",
                                  "choices": [{"index": 0, **COMPLETION}]})

    async def configure(request: web.Request) -> web.Response:
        body = await request.json()
        state.update(failure_rate=float(body["failure_rate"]), requests=0, failed=0)
        return web.json_response(state)

    async def stats(_: web.Request) -> web.Response:
        return web.json_response(state)

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/health", lambda _: web.Response(text="ok"))
        app.router.add_get("/v1/models", lambda _: web.json_response(
            {"object": "list", "data": [{"id": "fake", "max_model_len": 512}]}))
        app.router.add_post("/v1/completions", completions)
        app.router.add_post("/configure", configure)
        app.router.add_get("/stats", stats)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        port_out.send(runner.addresses[0][1])
        await asyncio.get_running_loop().run_in_executor(None, control.recv)  # until the parent says stop
        await runner.cleanup()

    asyncio.run(main())


class FakeServerProcess:
    def __init__(self, seed: int = 0, latency_s: tuple[float, float] = LATENCY_S) -> None:
        ctx = multiprocessing.get_context("spawn")
        port_recv, port_send = ctx.Pipe(duplex=False)
        self._control_recv, self._control_send = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=serve, args=(port_send, self._control_recv, seed, latency_s),
                                   name="fake-completion-server")
        self.process.start()
        if not port_recv.poll(60):
            self.stop()
            raise RuntimeError("the fake server did not start within 60 s")
        self.url = f"http://127.0.0.1:{port_recv.recv()}"

    def stop(self) -> None:
        if self.process.is_alive():
            self._control_send.send("stop")
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)


# ----------------------------------------------------------------------------- the client side (this process)


@dataclass
class Measurement:
    failure_rate: float
    backoff_s: float
    samples_per_s: float
    requests_per_s: float
    retries: int
    failed_rollouts: int
    stale_groups: int
    server_requests: int
    server_500s: int
    seconds: float


async def _post(session, url: str, body=None):
    if body is None:
        async with session.get(url) as resp:
            return await resp.json()
    async with session.post(url, json=body) as resp:
        return await resp.json()


async def measure(url: str, *, failure_rate: float, backoff_s: float | None, steps: int, seed: int,
                  max_staleness: int = 1) -> Measurement:
    import aiohttp

    from asyncgrpo.config import validate_config
    from asyncgrpo.data.source import PromptSource
    from asyncgrpo.generation.http import HttpGenerator
    from asyncgrpo.pipeline import run_pipeline
    from asyncgrpo.rewards.scoring import RewardScorer
    from asyncgrpo.rollout.collector import Collector
    from asyncgrpo.training.stub import StubTrainer
    from asyncgrpo.types import Prompt, SamplingParams

    generation = {"backend": "http", "max_new_tokens": 8, "max_inflight": CONCURRENCY, "http": {"base_urls": [url]}}
    if backoff_s is not None:
        generation["retry_backoff_s"] = backoff_s
    cfg = validate_config({
        "run": {"name": "bench-http", "seed": seed},
        "generation": generation,
        "rollout": {"group_size": GROUP_SIZE, "groups_per_step": GROUPS_PER_STEP, "max_staleness": max_staleness},
        "train": {"backend": "stub", "max_steps": steps, "step_time_s": 0.001},
    })
    prompts = [Prompt(id=i, text=f"p{i}", token_ids=(5, 6, 7, 8)) for i in range((steps + 4) * GROUPS_PER_STEP)]
    source = PromptSource(prompts, num_epochs=1, shuffle=False, seed=seed)

    def length_reward(completions, **_):
        return [float(len(c)) for c in completions]

    scorer = RewardScorer([("length", length_reward)], None, 30.0, isolation="inline")
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=(2,))
    generator = HttpGenerator(cfg.generation)
    collector = Collector(cfg, source=source, generator=generator, scorer=scorer, sampling=sampling)
    ends: list[tuple[float, int]] = []  # (time a step ended, samples trained in it)

    async def on_step(record) -> None:
        ends.append((time.perf_counter(), sum(len(g.rollouts) for g in record.batch)))

    async with aiohttp.ClientSession() as control:
        await _post(control, f"{url}/configure", {"failure_rate": failure_rate})
        await generator.start()
        started = time.perf_counter()
        try:
            result = await run_pipeline(cfg, collector=collector, backend=StubTrainer(0.001), generator=generator,
                                        on_step=on_step)
        finally:
            await generator.aclose()
        server = await _post(control, f"{url}/stats")
    if result.outcome != "completed" or result.steps != steps:
        raise RuntimeError(f"the pipeline did not complete {steps} steps: {result.outcome} {result.diagnostic}")
    seconds = ends[-1][0] - ends[0][0]
    samples = sum(n for _, n in ends[1:])
    return Measurement(
        failure_rate=failure_rate,
        backoff_s=cfg.generation.retry_backoff_s,
        samples_per_s=samples / seconds,
        requests_per_s=server["requests"] / (ends[-1][0] - started),
        retries=collector.counters["rollout/retries_total"],
        failed_rollouts=collector.counters["rollout/failed_total"],
        stale_groups=collector.counters["rollout/stale_groups_total"],
        server_requests=server["requests"],
        server_500s=server["failed"],
        seconds=seconds,
    )


def pair(url: str, backoff_s: float | None, args) -> tuple[Measurement, Measurement]:
    """Clean and with failures, best of `--repeats` each (the machine's load only ever slows a run down)."""
    def best(rate: float) -> Measurement:
        runs = [asyncio.run(measure(url, failure_rate=rate, backoff_s=backoff_s, steps=args.steps, seed=args.seed + i,
                                    max_staleness=args.max_staleness))
                for i in range(args.repeats)]
        return max(runs, key=lambda m: m.samples_per_s)

    return best(0.0), best(args.failure_rate)


def table(rows: list[tuple[Measurement, Measurement]], failure_rate: float) -> str:
    pct = f"{failure_rate:.0%}"
    lines = [
        f"| retry_backoff_s | samples/s clean | samples/s with {pct} HTTP 500 | ratio | retries | 500s seen | "
        f"failed rollouts | stale groups | server req/s clean / with 500s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for clean, faulty in rows:
        lines.append(
            f"| {clean.backoff_s:g} | {clean.samples_per_s:.0f} | {faulty.samples_per_s:.0f} | "
            f"{faulty.samples_per_s / clean.samples_per_s:.2f} | {faulty.retries} | {faulty.server_500s} of "
            f"{faulty.server_requests} | {faulty.failed_rollouts} | {faulty.stale_groups} | {clean.requests_per_s:.0f} / {faulty.requests_per_s:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24, help=f"steps per measurement ({GROUPS_PER_STEP * GROUP_SIZE} samples each)")
    parser.add_argument("--failure-rate", type=float, default=0.2)
    parser.add_argument("--backoffs", default="0.1,0.05,0.02", help="extra retry_backoff_s values to sweep after the default")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-staleness", type=int, default=1, help="rollout.max_staleness (admission: (K + 1) x 8 groups)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-latency-ms", type=float, default=LATENCY_S[1] * 1000,
                        help="server latency is uniform between 0 and this")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    from asyncgrpo.config import GenerationConfig

    default = GenerationConfig().retry_backoff_s
    latency_s = (0.0, args.max_latency_ms / 1000)
    server = FakeServerProcess(args.seed, latency_s)
    try:
        print(f"{CONCURRENCY} concurrent requests (generation.max_inflight), server latency uniform "
              f"{latency_s[0] * 1000:.0f}-{latency_s[1] * 1000:.0f} ms, groups of {GROUP_SIZE}, {GROUPS_PER_STEP} groups/step, "
              f"max_staleness {args.max_staleness}, {args.steps} steps per measurement; ideal with "
              f"{args.failure_rate:.0%} failures: ratio {1 - args.failure_rate:.2f}")
        rows = [pair(server.url, None, args)]
        print(f"\nDefault config (generation.retry_backoff_s = {default:g} s, retry_backoff_max_s = "
              f"{GenerationConfig().retry_backoff_max_s:g} s):\n")
        print(table(rows, args.failure_rate))
        sweep = [float(b) for b in args.backoffs.split(",") if b.strip()]
        if sweep:
            rows += [pair(server.url, b, args) for b in sweep]
            print("\nSweep of generation.retry_backoff_s:\n")
            print(table(rows, args.failure_rate))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
