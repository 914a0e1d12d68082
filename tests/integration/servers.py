"""`asyncgrpo serve` as a real process on loopback, for the HTTP tests.

A server is started with `subprocess` on a free (or given) port; `wait_healthy` polls
GET /health until it answers 200, the process exits (the error then shows its log), or the
deadline passes. The server is an external process, so polling its endpoint is the only way to
observe it; every poll loop here has a deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncgrpo.sync import StateSignal

STARTUP_DEADLINE_S = 90.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http(method: str, url: str, body: Any = None, timeout_s: float = 30.0) -> tuple[int, Any]:
    """One JSON request; returns (status, parsed body or text). Never raises for an HTTP status."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")


def wait_until(predicate: Callable[[], Any], deadline_s: float, what: str, poll_s: float = 0.02) -> Any:
    """Return predicate()'s first truthy value; fail naming `what` after `deadline_s` (polls an external process)."""
    end = time.monotonic() + deadline_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline_s:g} s waiting for {what}")
        time.sleep(poll_s)


async def until(predicate, deadline_s: float, what: str, poll_s: float = 0.02):
    """Await predicate() (sync, may call a server) becoming truthy; fail naming `what` at the deadline."""
    end = time.monotonic() + deadline_s
    while not (value := await asyncio.to_thread(predicate)):
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline_s:g} s waiting for {what}")
        await asyncio.sleep(poll_s)
    return value


class ServeProcess:
    def __init__(self, model: str | Path, log_dir: Path, *, port: int | None = None, extra: tuple[str, ...] = ()) -> None:
        self.model = str(model)
        self.port = port or free_port()
        self.extra = extra
        self.log_dir = log_dir
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"serve-{self.port}-{self.starts}.log"

    def start(self) -> ServeProcess:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.starts += 1
        log = open(self.log_path, "wb")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncgrpo.commands.cli", "serve", self.model, "--port", str(self.port), *self.extra],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
        log.close()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        if not self.alive():
            raise AssertionError(f"asyncgrpo serve exited with {self.proc.returncode if self.proc else None}:\n{self.log()}")
        try:
            return http("GET", f"{self.url}/health", timeout_s=2.0)[0] == 200
        except OSError:
            return False

    def wait_healthy(self, deadline_s: float = STARTUP_DEADLINE_S) -> ServeProcess:
        wait_until(self.healthy, deadline_s, f"asyncgrpo serve on {self.url} to answer /health", poll_s=0.05)
        return self

    def stats(self) -> dict[str, Any]:
        status, body = http("GET", f"{self.url}/stats")
        assert status == 200, body
        return body

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: the crash a generation server can have at any moment."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM and wait; returns the exit code (None if it had to be killed)."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return None


class FakeServer:
    """An in-process OpenAI-compatible server whose behaviour the test sets, on the test's own event loop.

    `completion` is "ok" (a canned 3-token completion), "hang" (never answers), or
    (status, body) to answer with; the completion requests whose 1-based arrival numbers are in
    `hang_requests` never answer (the others are answered as `completion` says); "reset" resets the
    connection of every completion request (TCP RST; /health still answers). Counters record what the server saw: completion
    requests started, cancelled handlers (the client closed the connection), pauses, reloads.
    `reload_status`/`health_status` make /collective_rpc and /health answer with that status
    (`reload_status = "hang"`: /collective_rpc never answers); `reload_delay_s` makes a reload take
    that long; `delay_s` makes every completion take that long; `pause_hangs` makes /pause never answer. `fault(number, body)` may answer a completion
    request with a fault instead: "drop" (close the connection), "malformed" (a truncated JSON body)
    or "reset" (a TCP reset), or an HTTP status such as "500". Between /pause and /resume, completion
    requests are held (as vLLM's mode=keep does). `freeze()` makes it answer nothing at all until `thaw()` (a SIGSTOPped process: requests
    wait, then are served).

    With `ports` > 1 (and `port` 0) it listens on that many free ports, one server behind all of them
    (`urls`, in order); `close_port(url)` stops listening on one (new connections are refused, as of a
    server that is down) and `open_port(url)` listens there again.
    """

    def __init__(self, model: str = "fake", port: int = 0, ports: int = 1) -> None:
        self.model = model
        self.port = port
        self.ports = ports
        self.sites: dict[str, Any] = {}
        self.completion: Any = "ok"
        self.finish_reason = "length"
        self.reload_status = 200
        self.reload_delay_s = 0.0
        self.delay_s = 0.0  # how long a completion takes (a loaded server)
        self.pause_hangs = False
        self.health_status = 200
        self.hang_requests: set[int] = set()
        self.fault: Callable[[int, dict], str | None] = lambda number, body: None
        self.paused = False
        self.frozen = False
        self._changed = StateSignal()
        self.started = 0
        self.cancelled = 0
        self.answered = 0
        self.requests: list[dict] = []
        self.by_url: dict[str, int] = {}  # completion requests started, per URL it listens on
        self.control: list[str] = []
        self._runner = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def freeze(self) -> None:
        self.frozen = True

    def thaw(self) -> None:
        self.frozen = False
        self._changed.notify()

    async def start(self) -> FakeServer:
        from aiohttp import web

        @web.middleware
        async def stopped(request, handler):
            await self._changed.wait_for(lambda: not self.frozen)  # a frozen server answers nothing, until thawed
            return await handler(request)

        async def health(_):
            return web.Response(status=self.health_status)

        async def models(_):
            return web.json_response({"object": "list", "data": [{"id": self.model, "max_model_len": 512}]})

        async def completions(request):
            import asyncio

            body = await request.json()
            self.requests.append(body)
            self.started += 1
            url = f"http://127.0.0.1:{request.transport.get_extra_info('sockname')[1]}"
            self.by_url[url] = self.by_url.get(url, 0) + 1
            number = self.started  # this request's arrival number (others arrive while it waits)
            try:
                await self._changed.wait_for(lambda: not self.paused)
                if self.completion == "hang" or number in self.hang_requests:
                    await asyncio.get_running_loop().create_future()  # never resolved: only cancellation ends it
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                fault = "reset" if self.completion == "reset" else self.fault(number, body)
                if fault == "reset":  # SO_LINGER 0: closing sends RST, as a crashing proxy or server does
                    request.transport.get_extra_info("socket").setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    request.transport.abort()
                    return web.Response()
                if fault == "drop":
                    request.transport.close()
                    return web.Response()
                if fault == "malformed":
                    return web.Response(text='{"choices": [{"text": ', content_type="application/json")
                if fault is not None:
                    return web.json_response({"error": {"message": f"injected {fault}"}}, status=int(fault))
                if self.completion != "ok":
                    status, answer = self.completion
                    return web.json_response(answer, status=status)
                self.answered += 1
                return web.json_response({"id": "cmpl-1", "object": "text_completion", "model": self.model, "choices": [{
                    "index": 0, "text": "abc", "token_ids": [7, 8, 9], "finish_reason": self.finish_reason,
                    "logprobs": {"token_logprobs": [-1.0, -2.0, -0.5], "tokens": ["a", "b", "c"]}}]})
            except asyncio.CancelledError:
                self.cancelled += 1
                raise

        def control(name):
            async def handler(request):
                import asyncio

                self.control.append(name if name != "/collective_rpc" else f"reload {(await request.json())['kwargs']['weights_path']}")
                if name in ("/pause", "/resume"):
                    self.paused = name == "/pause"
                    self._changed.notify()
                if (name == "/collective_rpc" and self.reload_status == "hang") or (name == "/pause" and self.pause_hangs):
                    await asyncio.get_running_loop().create_future()
                if name == "/collective_rpc":
                    await asyncio.sleep(self.reload_delay_s)
                if name == "/collective_rpc" and self.reload_status != 200:
                    return web.json_response({"error": {"message": "reload failed"}}, status=self.reload_status)
                return web.json_response({"status": "ok"})
            return handler

        app = web.Application(middlewares=[stopped])
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", completions)
        for name in ("/pause", "/resume", "/collective_rpc"):
            app.router.add_post(name, control(name))
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        for _ in range(self.ports):
            site = web.TCPSite(self._runner, "127.0.0.1", self.port)
            await site.start()
            self.sites[f"http://127.0.0.1:{self._runner.addresses[-1][1]}"] = site
        self.port = self._runner.addresses[0][1]
        return self

    @property
    def urls(self) -> list[str]:
        return list(self.sites)

    async def close_port(self, url: str) -> None:
        await self.sites[url].stop()

    async def open_port(self, url: str) -> None:
        from aiohttp import web

        assert self._runner is not None
        self.sites[url] = web.TCPSite(self._runner, "127.0.0.1", int(url.rsplit(":", 1)[1]))
        await self.sites[url].start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
