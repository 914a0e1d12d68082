"""`ServerActor`: the body of one Ray actor that owns one generation server process (generation.http.launch).

Job: on its node, pick a free port, start the server (`asyncgrpo serve` or `vllm serve`, or the configured
command) in a process group of its own with its output in a log file, wait until it answers GET /health,
restart it on the same port when it exits while the run goes on (up to `max_restarts` times), report each
exit to whoever waits for one, and stop it (the whole process group) when asked or when the actor dies.

Invariants:
- Start-up is bounded by `start_timeout_s`: the wait for /health races the process's exit, so a server
  that dies while starting is reported at once, with its exit code and its log's last lines; one that
  does not answer in time is killed (its process group) and reported the same way. A program that does not
  exist on this node is reported before anything starts. Failures come back as a `LaunchFailure` value
  (`kind` "config" or "start"), never as a Ray error, so the driver raises the right class.
- The server is in a process group of its own (start_new_session), and the kernel sends it SIGKILL when
  the actor's process dies (PR_SET_PDEATHSIG), so `ray.kill` of the actor leaves no server; `stop()`
  sends SIGTERM to the group and SIGKILL to what is left after a grace period. Processes of a local
  cluster inherit its reaper's mark (ray_cluster.py), so a driver killed with SIGKILL leaves none either.
- The same port across restarts: the URL the driver's HTTP pool knows stays right; the pool marks the
  server unhealthy while it is down and installs the current weights before it takes work again
  (http_probes.py). The URL is never reused for a server of another run: the port is picked per actor.
- Exits are counted; `exited(seen)` waits (a predicate on the count, no polling) until more than `seen`
  exits happened or the actor stops, and describes the newest.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from asyncgrpo.sync import StateSignal

_HEALTH_RETRY_S = (0.05, 1.0)  # first and largest delay between /health attempts while the server starts
_STOP_GRACE_S = 10.0
_LOG_TAIL_LINES = 20
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class LaunchSpec:
    """What one server actor runs: `command` + `model_args` + --host/--port + `args`, with `env` added to the environment."""

    name: str
    command: tuple[str, ...]
    model_args: tuple[str, ...]  # (MODEL,) for asyncgrpo serve; (--model, MODEL) for vLLM (`vllm serve` and its api_server)
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    log_dir: str
    start_timeout_s: float
    max_restarts: int


@dataclass(frozen=True)
class LaunchFailure:
    """Why a server did not start: `kind` "config" (the program is missing) or "start"; `message` names all."""

    kind: str
    message: str


@dataclass(frozen=True)
class ServerExit:
    """The newest exit of the server: how many so far, its code, whether it was restarted, its log's last lines."""

    count: int
    code: int | None
    restarted: bool
    restarts_left: int
    log_tail: str


def default_command(engine: str) -> tuple[str, ...]:
    """The program an engine runs: asyncgrpo's own server under the actor's Python, or vLLM's CLI."""
    if engine == "serve":
        return (sys.executable, "-m", "asyncgrpo.commands.cli", "serve")
    return ("vllm", "serve")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a log file ("" when there is none)."""
    try:
        with path.open(errors="replace") as handle:
            return "".join(deque(handle, maxlen=lines)).rstrip()
    except OSError:
        return ""


class ServerActor:
    """One server process and its supervision; see the module docstring. Ray makes it an async actor."""

    def __init__(self, spec: LaunchSpec, host: str | None = None) -> None:
        """`host`: the address the server binds and the driver reaches (None: this node's, as Ray knows it)."""
        if host is None:
            import ray

            host = ray.util.get_node_ip_address()
        self.spec = spec
        self.host = host
        self.port = _free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.log_path = Path(spec.log_dir) / f"{spec.name}.log"
        self._proc: asyncio.subprocess.Process | None = None
        self._supervisor: asyncio.Task | None = None
        self._stopping = False
        self._exits: list[ServerExit] = []
        self._signal = StateSignal()

    def _argv(self) -> list[str]:
        return [*self.spec.command, *self.spec.model_args, "--host", self.host, "--port", str(self.port), *self.spec.args]

    async def start(self) -> str | LaunchFailure:
        """Start the server and wait until it answers /health; its URL, or why not."""
        program = self.spec.command[0]
        if shutil.which(program) is None:
            return LaunchFailure("config", (
                f"server {self.spec.name}: the program {program!r} of generation.http.launch (command "
                f"{list(self.spec.command)}) is not found on node {self.host} (PATH={os.environ.get('PATH', '')!r}). "
                f"Fix: install it there, or set generation.http.launch.command to its full path "
                f"(e.g. [/path/to/venv/bin/vllm, serve])."))
        failure = await self._spawn_healthy()
        if failure is not None:
            return failure
        self._supervisor = asyncio.create_task(self._supervise(), name=f"{self.spec.name}-supervisor")
        return self.url

    async def _spawn(self) -> asyncio.subprocess.Process:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            return await asyncio.create_subprocess_exec(
                *self._argv(), stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
                env={**os.environ, **dict(self.spec.env)}, start_new_session=True, preexec_fn=_die_with_parent)

    async def _spawn_healthy(self) -> LaunchFailure | None:
        """Start the process and race /health against its exit, within start_timeout_s; None once healthy."""
        proc = self._proc = await self._spawn()
        healthy = asyncio.ensure_future(self._answers_health())
        exited = asyncio.ensure_future(proc.wait())
        try:
            done, _ = await asyncio.wait({healthy, exited}, timeout=self.spec.start_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            healthy.cancel()
            await asyncio.wait({healthy})
        if healthy in done and exited not in done:
            exited.cancel()
            return None
        exited.cancel()
        if exited in done:
            why = f"exited with code {proc.returncode} while starting"
        else:
            why = f"did not answer GET /health within generation.http.launch.start_timeout_s = {self.spec.start_timeout_s:g} s"
        await self._kill_group(proc)  # the whole group: a dead leader may leave workers
        return LaunchFailure("start", (
            f"server {self.spec.name} ({' '.join(self._argv())}) on {self.url} {why}. Its log ({self.log_path}) ends "
            f"with: {' | '.join(log_tail(self.log_path).splitlines()) or '(empty)'}. Fix: see the log for why (a model it cannot load, too little "
            f"memory, an argument it refuses: generation.http.launch.args), or raise "
            f"generation.http.launch.start_timeout_s if it is merely slow to start."))

    async def _answers_health(self) -> None:
        """GET /health until it answers 200 (the caller bounds the wait and races the process's exit)."""
        delay = _HEALTH_RETRY_S[0]
        timeout = aiohttp.ClientTimeout(total=5.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(f"{self.url}/health") as resp:
                        if resp.status == 200:
                            return
                await asyncio.sleep(delay)  # the server is starting: nothing to wait on but time
                delay = min(delay * 2, _HEALTH_RETRY_S[1])

    async def _supervise(self) -> None:
        """Wait for the server's exit; restart it on the same port while restarts are left."""
        while self._proc is not None:
            code = await self._proc.wait()
            if self._stopping:
                return
            restarts_left = self.spec.max_restarts - len(self._exits)
            restart = restarts_left > 0
            self._exits.append(ServerExit(len(self._exits) + 1, code, restart, max(restarts_left - 1, 0),
                                          log_tail(self.log_path)))
            self._signal.notify()
            if not restart:
                self._proc = None
                return
            await self._kill_group(self._proc)  # what the dead server left of its group
            failure = await self._spawn_healthy()
            if failure is not None:  # counted as the next exit: the driver says why it stays down
                self._exits.append(ServerExit(len(self._exits) + 1, self._proc.returncode if self._proc else None, False,
                                              0, failure.message))
                self._proc = None
                self._signal.notify()
                return

    async def exited(self, seen: int) -> ServerExit | None:
        """Wait until the server exited more than `seen` times (the newest exit) or the actor stops (None)."""
        await self._signal.wait_for(lambda: len(self._exits) > seen or self._stopping)
        return self._exits[-1] if len(self._exits) > seen else None

    async def pids(self) -> list[int]:
        """The server's process id (empty while none runs), then the actor's own (tests check both are gone)."""
        alive = self._proc is not None and self._proc.returncode is None
        return ([self._proc.pid] if alive and self._proc is not None else []) + [os.getpid()]

    async def stop(self) -> None:
        """Stop the server: SIGTERM to its process group, SIGKILL to what is left after a grace period. Idempotent."""
        self._stopping = True
        self._signal.notify()
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.wait({self._supervisor})
        if self._proc is not None:
            await self._kill_group(self._proc)

    async def _kill_group(self, proc: asyncio.subprocess.Process) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            async with asyncio.timeout(_STOP_GRACE_S):
                await proc.wait()
        except TimeoutError:
            pass
        with contextlib.suppress(ProcessLookupError):  # the leader gone, members of its group may remain
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
