"""CPU per request of the HTTP generator as the servers grow: 1, 16, 256 servers, this tree against a baseline.

The server: one fake OpenAI-compatible server (aiohttp, a child process, so its CPU is not the
client's) listening on 256 ports; it answers every ``POST /v1/completions`` at once with a canned
8-token completion. The client: `HttpGenerator` over the first N of those ports (N servers), in a
process of its own, with `--concurrency` workers that each read `serving_version` (as the collector
does per rollout) and await `generate` until `--requests` requests are answered. Its process CPU time
over the requests is what a request costs the client (aiohttp's request path, the pool's choice of a
server and its bookkeeping, and the health probes' share at the default interval of 5 s). The "pool
only" columns replace each request's HTTP exchange by one turn of the event loop (10 x the requests):
what is left is `generate`'s own cost, where a scan over the servers would show.

Each configuration runs once with this tree's sources and once with `--baseline` (a git ref; its
`src/` is extracted with ``git archive``), in alternation, `--repeats` times; the table shows the
lowest CPU per request of each and their ratio (baseline / this tree: > 1 is faster now), and the
load average, since CPU time on a loaded machine is noisy.

    PYTHONPATH=src .venv/bin/python bench/http_many_servers.py [--servers 1,16,256] [--requests 4000]
        [--concurrency 256] [--repeats 3] [--baseline main]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

from http_throughput import canned_completion

ROOT = Path(__file__).resolve().parent.parent
TOKENS = 8
POOL_ONLY_FACTOR = 10  # the pool-only runs send this many times --requests (they are that much cheaper)


def serve(ports: int, port_out, control) -> None:
    """Listen on `ports` ports until `control` receives anything; send the ports through `port_out`."""
    from aiohttp import web

    completion = {"id": "cmpl", "object": "text_completion", "model": "fake",
                  "choices": [{"index": 0, **canned_completion(TOKENS)}]}

    async def completions(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(completion)

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/health", lambda _: web.Response(text="ok"))
        app.router.add_get("/v1/models", lambda _: web.json_response(
            {"object": "list", "data": [{"id": "fake", "max_model_len": 512}]}))
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        for _ in range(ports):
            await web.TCPSite(runner, "127.0.0.1", 0, backlog=1024).start()
        port_out.send([address[1] for address in runner.addresses])
        await asyncio.get_running_loop().run_in_executor(None, control.recv)
        await runner.cleanup()

    asyncio.run(main())


async def client(ports: list[int], requests: int, concurrency: int, pool_only: bool) -> dict:
    """Send `requests` requests over the servers on `ports`; the client's CPU and wall time. `pool_only`: each
    request's HTTP exchange is replaced by one turn of the event loop (its server's open requests counted as
    `generate` counts them), which leaves the pool's own cost per request."""
    from asyncgrpo.config import validate_config
    from asyncgrpo.generation.http import HttpGenerator
    from asyncgrpo.types import GenerationRequest, SamplingParams

    cfg = validate_config({
        "data": {"source": "builtin:repeat_letter"}, "reward": {"functions": ["builtin:repeat_letter"]},
        "generation": {"backend": "http", "max_new_tokens": TOKENS,
                       "http": {"base_urls": [f"http://127.0.0.1:{port}" for port in ports]}},
        "train": {"backend": "stub"}})
    gen = HttpGenerator(cfg.generation)
    await gen.start()
    sampling = SamplingParams(max_new_tokens=TOKENS)
    sent = 0

    async def worker() -> None:
        nonlocal sent
        while sent < requests:
            sent += 1
            _ = gen.serving_version
            await gen.generate(GenerationRequest(f"r{sent}", sent, (5, 6, 7), sampling, seed=sent))

    if pool_only:
        async def one_turn(server, request):
            server.outstanding += 1
            try:
                await asyncio.sleep(0)
            finally:
                server.outstanding -= 1

        gen._attempt = one_turn  # type: ignore[method-assign]
    try:
        # Warm-up: the connections of `concurrency` requests opened.
        await asyncio.gather(*(gen.generate(GenerationRequest(f"w{i}", i, (5, 6, 7), sampling, seed=i))
                               for i in range(concurrency)))
        await asyncio.sleep(1.0)  # the first round of health probes (every server at once, at start) is over
        cpu, wall = time.process_time(), time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for _ in range(concurrency):
                group.create_task(worker())
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    finally:
        await gen.aclose()
    return {"cpu_s": cpu, "wall_s": wall, "requests": sent}


def measure(src: Path, ports: list[int], args, pool_only: bool) -> dict:
    """One client run in a process of its own, importing asyncgrpo from `src`."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    requests = args.requests * (POOL_ONLY_FACTOR if pool_only else 1)
    out = subprocess.run([sys.executable, __file__, "--client", ",".join(map(str, ports)), *(["--pool-only"] * pool_only),
                          "--requests", str(requests), "--concurrency", str(args.concurrency)],
                         env=env, capture_output=True, text=True, check=False, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"the client with {src} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def extract(ref: str, into: Path) -> Path:
    """The `src/` of git ref `ref`, extracted under `into`."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "src"], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", default="1,16,256")
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", default="main", help="git ref to compare with ('' for none)")
    parser.add_argument("--client", help=argparse.SUPPRESS)  # internal: run one client over these ports
    parser.add_argument("--pool-only", action="store_true", help=argparse.SUPPRESS)  # internal: with --client
    args = parser.parse_args(argv)
    if args.client:
        print(json.dumps(asyncio.run(client([int(p) for p in args.client.split(",")], args.requests, args.concurrency,
                                                args.pool_only))))
        return
    widths = [int(n) for n in args.servers.split(",")]
    ctx = multiprocessing.get_context("spawn")
    port_recv, port_send = ctx.Pipe(duplex=False)
    control_recv, control_send = ctx.Pipe(duplex=False)
    server = ctx.Process(target=serve, args=(max(widths), port_send, control_recv), name="fake-servers")
    server.start()
    try:
        if not port_recv.poll(60):
            raise RuntimeError("the fake server did not start within 60 s")
        ports = port_recv.recv()
        with tempfile.TemporaryDirectory() as tmp:
            sources = {"this tree": ROOT / "src"}
            if args.baseline:
                sources[args.baseline] = extract(args.baseline, Path(tmp))
            print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs; "
                  f"{args.requests} requests, {args.concurrency} open, best of {args.repeats}")
            names = list(sources)
            columns = [(pool_only, name) for pool_only in (False, True) for name in names]
            header = "| servers | " + " | ".join(
                f"µs CPU / request{', pool only' if pool_only else ''} ({name})" for pool_only, name in columns)
            header += " | ratio | ratio, pool only |" if args.baseline else " |"
            print(header)
            print("|" + " --- |" * (header.count("|") - 1))
            for width in widths:
                best = {column: float("inf") for column in columns}
                for _ in range(args.repeats):
                    for column in columns:
                        result = measure(sources[column[1]], ports[:width], args, column[0])
                        best[column] = min(best[column], 1e6 * result["cpu_s"] / result["requests"])
                cells = [f"{best[column]:.1f}" for column in columns]
                if args.baseline:
                    cells += [f"{best[(pool_only, args.baseline)] / best[(pool_only, 'this tree')]:.2f}x"
                              for pool_only in (False, True)]
                print(f"| {width} | " + " | ".join(cells) + " |", flush=True)
            print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        control_send.send("stop")
        server.join(30)
        if server.is_alive():
            server.kill()


if __name__ == "__main__":
    main()
