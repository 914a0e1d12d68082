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

With ``--hang-rate 0.05`` it measures hung requests instead: that fraction of requests is never
answered (until the client closes the connection), and one table compares hang-free and hung
throughput per setting of the adaptive attempt timeout (`generation.http.attempt_timeout_factor`,
and turned off), with ``--group-size`` and ``--groups-per-step`` setting the rollout shape. There the
trainer publishes weights after every step as a real one does (a small state dict staged on disk by
`DiskWeightPublisher`, installed with ``/pause?mode=keep``, ``/collective_rpc`` reload_weights (taking
``--reload-ms``) and ``/resume``; requests are held while the server is paused); ``--no-installs``
keeps the stub trainer's "same weights" versions. The hang-free column "timeouts per 1,000" is how
often the attempt timeout cut a request the server would have answered.
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
TOKENS = 8


def canned_completion(tokens: int) -> dict:
    """The completion every request gets: `tokens` tokens, finish_reason length."""
    text = "".join(chr(ord("a") + i % 26) for i in range(tokens))
    return {"text": text, "token_ids": [10 + i % 40 for i in range(tokens)],
            "logprobs": {"token_logprobs": [-1.0] * tokens, "tokens": list(text)}, "finish_reason": "length"}


# ----------------------------------------------------------------------------- the fake server (child process)


def serve(port_out, control, seed: int, latency_s: tuple[float, float] = LATENCY_S, tokens: int = TOKENS,
          reload_s: float = 0.0) -> None:
    """Run the fake server until `control` receives anything; report its port through `port_out`."""
    from aiohttp import web

    from asyncgrpo.sync import StateSignal

    completion = canned_completion(tokens)
    rng = random.Random(seed)
    state = {"failure_rate": 0.0, "hang_rate": 0.0, "requests": 0, "failed": 0, "hung": 0, "reloads": 0}
    paused = {"now": False}  # between /pause and /resume requests are held, not aborted (vLLM's mode=keep)
    changed = StateSignal()

    async def completions(request: web.Request) -> web.Response:
        await request.read()
        state["requests"] += 1
        if rng.random() < state["hang_rate"]:
            state["hung"] += 1
            await asyncio.get_running_loop().create_future()  # never answers; the client's disconnect cancels it
        await changed.wait_for(lambda: not paused["now"])
        await asyncio.sleep(rng.uniform(*latency_s))
        await changed.wait_for(lambda: not paused["now"])  # paused meanwhile: held until resumed
        if rng.random() < state["failure_rate"]:
            state["failed"] += 1
            return web.json_response({"error": {"message": "injected failure", "code": 500}}, status=500)
        return web.json_response({"id": "cmpl", "object": "text_completion", "model": "fake",
                                  "choices": [{"index": 0, **completion}]})

    async def configure(request: web.Request) -> web.Response:
        body = await request.json()
        state.update(failure_rate=float(body["failure_rate"]), hang_rate=float(body.get("hang_rate", 0.0)),
                     requests=0, failed=0, hung=0, reloads=0)
        return web.json_response(state)

    async def stats(_: web.Request) -> web.Response:
        return web.json_response(state)

    def pausing(pause: bool):
        async def handler(_: web.Request) -> web.Response:
            paused["now"] = pause
            changed.notify()
            return web.json_response({"status": "ok"})
        return handler

    async def reload(request: web.Request) -> web.Response:
        await request.read()
        state["reloads"] += 1
        await asyncio.sleep(reload_s)
        return web.json_response({"status": "ok"})

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/health", lambda _: web.Response(text="ok"))
        app.router.add_get("/v1/models", lambda _: web.json_response(
            {"object": "list", "data": [{"id": "fake", "max_model_len": 512}]}))
        app.router.add_post("/v1/completions", completions)
        app.router.add_post("/configure", configure)
        app.router.add_get("/stats", stats)
        app.router.add_post("/pause", pausing(True))
        app.router.add_post("/resume", pausing(False))
        app.router.add_post("/collective_rpc", reload)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        port_out.send(runner.addresses[0][1])
        await asyncio.get_running_loop().run_in_executor(None, control.recv)  # until the parent says stop
        await runner.cleanup()

    asyncio.run(main())


class FakeServerProcess:
    def __init__(self, seed: int = 0, latency_s: tuple[float, float] = LATENCY_S, tokens: int = TOKENS,
                 reload_s: float = 0.0) -> None:
        ctx = multiprocessing.get_context("spawn")
        port_recv, port_send = ctx.Pipe(duplex=False)
        self._control_recv, self._control_send = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=serve, args=(port_send, self._control_recv, seed, latency_s, tokens, reload_s),
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
    hang_rate: float
    backoff_s: float
    samples_per_s: float
    requests_per_s: float
    retries: int
    failed_rollouts: int
    stale_groups: int
    server_requests: int
    server_500s: int
    server_hangs: int
    attempt_timeouts: int
    installs: int  # weight versions the server reloaded
    seconds: float
    cpu_ms_per_sample: float  # this process's CPU (the client side: pipeline, collector, HTTP client) per trained sample


async def _post(session, url: str, body=None):
    if body is None:
        async with session.get(url) as resp:
            return await resp.json()
    async with session.post(url, json=body) as resp:
        return await resp.json()


async def measure(url: str, *, failure_rate: float, backoff_s: float | None, steps: int, seed: int,
                  max_staleness: int = 1, hang_rate: float = 0.0, group_size: int = GROUP_SIZE,
                  http_overrides: dict | None = None, groups_per_step: int = GROUPS_PER_STEP,
                  tokens: int = TOKENS, installs: bool = False, real_model: str | None = None) -> Measurement:
    """One pipeline run against the server at `url`: the fake server of this file, or (`real_model`: the model it
    serves, e.g. builtin:tiny) an `asyncgrpo serve` process, which gets that model's own weights at every install."""
    import tempfile

    import aiohttp
    import torch

    from asyncgrpo.config import validate_config
    from asyncgrpo.generation.http import HttpGenerator
    from asyncgrpo.pipeline import run_pipeline
    from asyncgrpo.rewards.scoring import RewardScorer
    from asyncgrpo.training.stub import StubTrainer
    from asyncgrpo.types import Prompt
    from asyncgrpo.wiring.collector import build_collector

    generation = {"backend": "http", "max_new_tokens": tokens, "max_inflight": CONCURRENCY,
                  "http": {"base_urls": [url], **(http_overrides or {})}}
    if backoff_s is not None:
        generation["retry_backoff_s"] = backoff_s
    cfg = validate_config({
        "run": {"name": "bench-http", "seed": seed},
        "data": {"shuffle": False},
        "generation": generation,
        "rollout": {"group_size": group_size, "groups_per_step": groups_per_step, "max_staleness": max_staleness},
        "train": {"backend": "stub", "max_steps": steps},
        "simulate": {"step_time_s": 0.001},
    })
    prompts = [Prompt(id=i, text=f"p{i}", token_ids=(5, 6, 7, 8)) for i in range((steps + 4) * groups_per_step)]

    def length_reward(completions, **_):
        return [float(len(c)) for c in completions]

    state: dict = {"w": torch.zeros(16)}  # what the fake server "reloads"
    model_config = None
    if real_model is not None:
        from asyncgrpo.models.loading import load_model_and_tokenizer

        model, _ = load_model_and_tokenizer(real_model)
        state, model_config = model.state_dict(), model.config.to_dict()

    class PublishingTrainer(StubTrainer):
        """The stub trainer, publishing weights after every step as a real trainer does."""

        def generation_weights(self):
            return state

    scorer = RewardScorer([("length", length_reward)], None, 30.0, isolation="inline")
    weights_dir = tempfile.TemporaryDirectory(prefix="bench-http-weights-")
    generator = HttpGenerator(cfg.generation, weights_dir=weights_dir.name if installs else None,
                              model_config=model_config)
    trainer = PublishingTrainer(0.001) if installs else StubTrainer(0.001)
    collector = build_collector(cfg, prompts, generator, scorer=scorer, stop_token_ids=(2,))
    ends: list[tuple[float, int, float]] = []  # (time a step ended, samples trained in it, process CPU time then)

    async def on_step(record) -> None:
        ends.append((time.perf_counter(), sum(len(g.rollouts) for g in record.batch), time.process_time()))

    async with aiohttp.ClientSession() as control:
        if real_model is None:
            await _post(control, f"{url}/configure", {"failure_rate": failure_rate, "hang_rate": hang_rate})
        await generator.start()
        started = time.perf_counter()
        try:
            result = await run_pipeline(cfg, collector=collector, trainer=trainer, generator=generator,
                                        on_step=on_step)
        finally:
            await generator.aclose()
            weights_dir.cleanup()
        if real_model is None:
            server = await _post(control, f"{url}/stats")
        else:  # a real server injects nothing: count what was sent
            server = {"requests": generator.stats()["servers"][0]["dispatched"], "failed": 0, "hung": 0,
                      "reloads": generator.stats()["published_version"] if installs else 0}
    if result.outcome != "completed" or result.steps != steps:
        raise RuntimeError(f"the pipeline did not complete {steps} steps: {result.outcome} {result.diagnostic}")
    seconds = ends[-1][0] - ends[0][0]
    samples = sum(n for _, n, _ in ends[1:])
    return Measurement(
        failure_rate=failure_rate,
        hang_rate=hang_rate,
        backoff_s=cfg.generation.retry_backoff_s,
        samples_per_s=samples / seconds,
        requests_per_s=server["requests"] / (ends[-1][0] - started),
        retries=collector.counters["rollout/retries_total"],
        failed_rollouts=collector.counters["rollout/failed_total"],
        stale_groups=collector.counters["rollout/stale_groups_total"],
        server_requests=server["requests"],
        server_500s=server["failed"],
        server_hangs=server["hung"],
        attempt_timeouts=generator.stats()["attempt_timeouts"],
        installs=server["reloads"],
        seconds=seconds,
        cpu_ms_per_sample=1000 * (ends[-1][2] - ends[0][2]) / samples,
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
            f"{faulty.server_requests} | {faulty.failed_rollouts} | {faulty.stale_groups} | "
            f"{clean.requests_per_s:.0f} / {faulty.requests_per_s:.0f} |"
        )
    return "\n".join(lines)


HANG_CONFIGS = (  # (label, generation.http overrides)
    ("default: attempt_timeout_factor 2, attempt_timeout_min_s 0.05", {}),
    ("attempt_timeout_factor 1.5", {"attempt_timeout_factor": 1.5}),
    ("attempt_timeout_factor 3", {"attempt_timeout_factor": 3.0}),
    ("no adaptive timeout (attempt_timeout_min_s = request_timeout_s = 60)", {"attempt_timeout_min_s": 60.0}),
)


def hang_tables(url: str, args) -> str:
    """Hang-free and with `--hang-rate` of requests never answered, per attempt-timeout setting."""
    lines = [
        f"| generation.http | samples/s hang-free | hang-free: timeouts per 1,000 requests | samples/s with "
        f"{args.hang_rate:.0%} hung | ratio | attempt timeouts | hung requests | failed rollouts | stale groups | "
        f"installs hang-free / hung |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, overrides in HANG_CONFIGS[:{"default": 1, "factors": 3}.get(args.configs, len(HANG_CONFIGS))]:
        def runs(rate: float, overrides: dict = overrides) -> list[Measurement]:
            return [asyncio.run(measure(url, failure_rate=0.0, backoff_s=None, steps=args.steps, seed=args.seed + i,
                                        max_staleness=args.max_staleness, hang_rate=rate, group_size=args.group_size,
                                        http_overrides=overrides, groups_per_step=args.groups_per_step,
                                        installs=not args.no_installs))
                    for i in range(args.repeats)]

        clean_runs = runs(0.0)
        clean = max(clean_runs, key=lambda m: m.samples_per_s)
        hung = max(runs(args.hang_rate), key=lambda m: m.samples_per_s)
        # Every hang-free run counts for the spurious timeouts (not only the fastest).
        per_1000 = 1000 * sum(m.attempt_timeouts for m in clean_runs) / sum(m.server_requests for m in clean_runs)
        lines.append(f"| {label} | {clean.samples_per_s:.0f} | {per_1000:.2f} | {hung.samples_per_s:.0f} | "
                     f"{hung.samples_per_s / clean.samples_per_s:.2f} | {hung.attempt_timeouts} | {hung.server_hangs} | "
                     f"{hung.failed_rollouts} | {hung.stale_groups} | {clean.installs} / {hung.installs} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def serve_table(args) -> str:
    """Hang-free runs against a real `asyncgrpo serve` of `--serve` (weights published every step): how often the
    attempt timeout cut a request that server would have answered."""
    import socket
    import subprocess
    import sys
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "asyncgrpo.commands.cli", "serve", args.serve, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:  # an external process: polling its /health, under a deadline, is the only way to see it up
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"asyncgrpo serve {args.serve} did not come up (exit code {proc.poll()})")
            time.sleep(0.2)
        runs = [asyncio.run(measure(url, failure_rate=0.0, backoff_s=None, steps=args.steps, seed=args.seed + i,
                                    max_staleness=args.max_staleness, group_size=args.group_size,
                                    groups_per_step=args.groups_per_step, tokens=args.tokens,
                                    installs=not args.no_installs, real_model=args.serve))
                for i in range(args.repeats)]
    finally:
        proc.terminate()
        proc.wait(30)
    lines = ["| run | samples/s | requests | attempt timeouts | timeouts per 1,000 requests | installs |",
             "| --- | --- | --- | --- | --- | --- |"]
    for i, m in enumerate(runs):
        lines.append(f"| {i + 1} | {m.samples_per_s:.0f} | {m.server_requests} | {m.attempt_timeouts} | "
                     f"{1000 * m.attempt_timeouts / m.server_requests:.2f} | {m.installs} |")
    total = sum(m.attempt_timeouts for m in runs), sum(m.server_requests for m in runs)
    lines.append(f"| all | | {total[1]} | {total[0]} | {1000 * total[0] / total[1]:.2f} | |")
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
    parser.add_argument("--hang-rate", type=float, default=0.0,
                        help="instead of the HTTP 500 tables: this fraction of requests is never answered; "
                             "hang-free vs hung per attempt-timeout setting")
    parser.add_argument("--no-installs", action="store_true",
                        help="with --hang-rate: the stub trainer publishes no weights (versions advance without installs)")
    parser.add_argument("--reload-ms", type=float, default=10.0, help="how long the fake server's weight reload takes")
    parser.add_argument("--configs", default="all", help="with --hang-rate: 'default' measures only the default row, 'factors' the "
                             "attempt_timeout_factor rows")
    parser.add_argument("--serve", default=None,
                        help="instead: hang-free runs against `asyncgrpo serve MODEL` (e.g. builtin:tiny), counting the "
                             "attempt timeouts of a healthy loaded server")
    parser.add_argument("--tokens", type=int, default=TOKENS, help="with --serve: generation.max_new_tokens")
    parser.add_argument("--group-size", type=int, default=GROUP_SIZE, help="rollout.group_size")
    parser.add_argument("--groups-per-step", type=int, default=GROUPS_PER_STEP, help="rollout.groups_per_step")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    from asyncgrpo.config import GenerationConfig

    default = GenerationConfig().retry_backoff_s
    if args.serve is not None:
        print(f"asyncgrpo serve {args.serve}, {CONCURRENCY} concurrent requests of {args.tokens} tokens, groups of "
              f"{args.group_size}, {args.groups_per_step} groups/step, {args.steps} steps per run, "
              f"{'no installs' if args.no_installs else 'weights published every step'}\n")
        print(serve_table(args))
        return
    latency_s = (0.0, args.max_latency_ms / 1000)
    server = FakeServerProcess(args.seed, latency_s, reload_s=args.reload_ms / 1000)
    try:
        if args.hang_rate > 0:
            print(f"{CONCURRENCY} concurrent requests (generation.max_inflight), server latency uniform "
                  f"{latency_s[0] * 1000:.0f}-{latency_s[1] * 1000:.0f} ms, {args.hang_rate:.0%} of requests never "
                  f"answered, groups of {args.group_size}, {args.groups_per_step} groups/step, max_staleness "
                  f"{args.max_staleness}, {args.steps} steps per measurement, "
                  f"{'no weight installs' if args.no_installs else f'weights published every step (reload {args.reload_ms:g} ms)'}\n")
            print("\n" + hang_tables(server.url, args))
            return
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
