"""Worker processes for ``reward.isolation: process``: the parent side (the child is rewards/worker.py).

A sync reward function stuck in C code that holds the GIL (a catastrophic regex: `re` never
releases it) cannot be interrupted in a thread, and starves the event loop with it. In a worker
process it can be killed. The pool owns up to `size` workers, each serving one call at a time.

Workers are fresh interpreters (``python -c`` importing rewards/worker.py), started with the
loop's subprocess support: no fork of a process whose torch and asyncio threads are running,
no re-import of the parent's ``__main__`` (multiprocessing's spawn would do that), and replies
read by the event loop itself, with no thread per call.

Invariants:
- At most `size` workers exist. A call takes an idle worker, or starts one while fewer than
  `size` exist, or waits (`StateSignal.wait_for`) until one is released; the wait is bounded
  by the calls ahead of it, each bounded by the caller's deadline. Starting a worker is bounded
  by `WORKER_START_TIMEOUT_S` and is not part of the caller's deadline.
- A worker is reused only after a call that ended with a complete reply. One whose call was
  cancelled or timed out, or that died, is killed with SIGKILL and reaped (bounded by
  `REAP_TIMEOUT_S`) before the call's error reaches the caller; a new one is started when next
  needed.
- `aclose` ends every worker: it closes each socket (an idle worker then exits 0), waits up
  to `CLOSE_GRACE_S`, then kills what is left and reaps it; every wait is bounded. Workers that
  outlive the pool (never closed, or the parent killed) are killed by their finalizer at garbage
  collection or interpreter exit (worker_process.py), and by the kernel when the parent dies (worker.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any

from asyncgrpo.errors import RewardError
from asyncgrpo.sync import StateSignal
from asyncgrpo.worker_process import REAP_TIMEOUT_S, RemoteTraceback, WorkerProcess, describe_exit, encode, receive, start_worker

WORKER_START_TIMEOUT_S = 120.0
CLOSE_GRACE_S = 2.0


class WorkerCrashed(Exception):
    """The worker process running a call ended without replying; `returncode` as asyncio reports it
    (negative: killed by that signal; None: it hung up, was killed, and its code is unknown)."""

    def __init__(self, returncode: int | None) -> None:
        super().__init__(describe_exit(returncode))
        self.returncode = returncode


class WorkerStartError(RewardError):
    """No worker could be had for a call: one did not start, could not load the functions, or the pool is closed."""


class _Worker:
    def __init__(self, process: WorkerProcess) -> None:
        self.process = process
        self.reusable = True  # false from a call's start until its complete reply

    async def call(self, index: int, kwargs: dict[str, Any], callbacks: tuple[str, ...] = ()) -> tuple[Any, Any]:
        """Function `index` on `kwargs`, given the TRL `callbacks` (log_metric, log_extra) the worker makes for it: its
        result and the call's log records (rewards/trl_args.py), or what it raised (its traceback chained below)."""
        self.reusable = False
        try:
            self.process.writer.write(encode((index, kwargs, callbacks)))
            await self.process.writer.drain()
            reply = await receive(self.process.reader)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise WorkerCrashed(await self.exit_code()) from exc
        self.reusable = True
        if reply[0] == "ok":
            return reply[1], reply[2]
        _, error, remote_traceback = reply
        if remote_traceback:
            error.__cause__ = RemoteTraceback(remote_traceback)
        raise error

    async def exit_code(self) -> int | None:
        """The exit code of a worker that hung up, given `REAP_TIMEOUT_S` to exit by itself; None if it had to be killed."""
        exited = await self.process.exit_within(REAP_TIMEOUT_S)
        await self.process.stop(0.0)
        return self.process.returncode if exited else None


class RewardWorkerPool:
    """Up to `size` worker processes that call the sync functions of ``reward.functions`` = `specs`."""

    def __init__(self, specs: Sequence[str], size: int) -> None:
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        self.specs = list(specs)
        self.size = size
        self._idle: list[_Worker] = []
        self._count = 0  # workers that exist or are starting
        self._signal = StateSignal()
        self._closed = False
        self._procs: set[WorkerProcess] = set()  # every worker process not known to have exited

    @property
    def pids(self) -> list[int]:
        """Process ids of the worker processes not known to have exited (for tests and diagnostics)."""
        return sorted(p.pid for p in self._procs if p.returncode is None)

    @contextlib.asynccontextmanager
    async def worker(self) -> AsyncIterator[_Worker]:
        """A worker for one call; on exit it goes back to the pool, or is killed if its call did not complete."""
        worker = await self._acquire()
        try:
            yield worker
        finally:
            if worker.reusable and not self._closed:
                self._idle.append(worker)
                self._signal.notify()
            else:
                await self._retire(worker)

    async def _acquire(self) -> _Worker:
        while True:
            await self._signal.wait_for(lambda: self._closed or bool(self._idle) or self._count < self.size)
            if self._closed:
                raise WorkerStartError("reward.isolation: process: the reward worker pool is closed (the run is ending).")
            if not self._idle:
                break
            worker = self._idle.pop()
            if worker.process.returncode is None:
                return worker
            await self._retire(worker)  # died while idle (killed from outside): never hand it out
        self._count += 1
        try:
            return await self._start()
        except BaseException:
            self._count -= 1
            self._signal.notify()
            raise

    async def _retire(self, worker: _Worker) -> None:
        """Kill a worker that may not serve again, and reap it (bounded), so it is gone when the call's error is seen."""
        self._count -= 1
        self._signal.notify()
        await worker.process.stop(0.0)
        self._procs.difference_update([p for p in self._procs if p.returncode is not None])

    async def _start(self) -> _Worker:
        proc = await start_worker("asyncgrpo.rewards.worker")
        self._procs.add(proc)
        worker = _Worker(proc)
        try:
            if self._closed:  # closed while this one was being started
                raise WorkerStartError("reward.isolation: process: the reward worker pool is closed (the run is ending).")
            async with asyncio.timeout(WORKER_START_TIMEOUT_S):
                proc.writer.write(encode({"specs": self.specs, "sys_path": list(sys.path), "parent_pid": os.getpid()}))
                await proc.writer.drain()
                reply = await receive(proc.reader)
        except BaseException as exc:
            await proc.stop(0.0)
            if isinstance(exc, TimeoutError):
                raise WorkerStartError(
                    f"reward.isolation: process: a reward worker process did not start within {WORKER_START_TIMEOUT_S:g} s "
                    f"(importing reward.functions = {self.specs}). Fix: make the reward module import faster, or set "
                    f"reward.isolation: thread."
                ) from exc
            if isinstance(exc, (asyncio.IncompleteReadError, ConnectionError)):
                raise WorkerStartError(
                    f"reward.isolation: process: a reward worker process {describe_exit(proc.returncode)} while starting; "
                    f"its stderr above says why. Fix: make reward.functions = {self.specs} importable in a fresh "
                    f"interpreter, or set reward.isolation: thread."
                ) from exc
            raise
        if reply[0] != "ready":
            await proc.stop(0.0)
            raise WorkerStartError(
                f"reward.isolation: process: a reward worker process could not load the reward functions: {reply[1]} "
                f"The worker runs with the parent's sys.path and working directory; if the function exists only in the "
                f"parent (defined in __main__ or created at run time), set reward.isolation: thread."
            )
        return worker

    async def aclose(self) -> None:
        """End every worker (bounded: `CLOSE_GRACE_S` to exit, then SIGKILL, then reaped); later calls raise WorkerStartError."""
        self._closed = True
        self._signal.notify()
        idle, self._idle = self._idle, []
        await asyncio.gather(*(w.process.stop(CLOSE_GRACE_S) for w in idle))
        # any still busy in a call that outlives the pool (stopping an ended one again does nothing)
        await asyncio.gather(*(p.stop(0.0) for p in self._procs))
