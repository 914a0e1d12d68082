"""``env.isolation: process``: one episode's environment in a worker process that can always be stopped.

A Python thread cannot be stopped from outside; a process can. `ProcessHost` starts one worker
(environments/worker.py) per episode, at `reset`, creates the environment there from
`env.factory`, and forwards each call over a socket. `cancel(grace_s)` asks the worker to
stop (the token is set, `close()` is called there), waits up to `grace_s`, then kills the
worker's process group with SIGKILL and reaps the worker: the work has stopped, always.

Why a fresh interpreter started with the loop's subprocess support, and not multiprocessing:
the parent runs torch's threads and an event loop (a fork could inherit a lock held by a
thread that does not exist in the child), `spawn` would re-import the parent's `__main__`,
and replies are read by the event loop itself with no thread per call (as rewards/pool.py).
Why one process per episode and not a pool: start-up is one interpreter plus the import of
the environment's module (docs/environments.md, "Process isolation", has the measured cost),
small next to an episode of model turns; an episode's environment then never shares a
process with another episode's, and a killed worker needs no replacement.

Invariants:
- Every wait has a bound: the worker's start (`START_TIMEOUT_S`), `close` (`CLOSE_TIMEOUT_S`),
  the worker's exit (`EXIT_GRACE_S`, or `grace_s` on cancel) and the reap (`REAP_TIMEOUT_S`).
  A reset or step waits for the worker's reply, its death (end of file: an error for that
  rollout, never a hang) or `cancel`, whichever comes first.
- After `close` or `cancel` returns, the worker has exited and its process group has been
  sent SIGKILL (what the environment started dies with it). A host never closed is killed the
  same way by its worker's finalizer (worker_process.py) at garbage collection or interpreter exit, and by the kernel when
  the parent dies (the worker's PR_SET_PDEATHSIG).
- What the environment raised comes back classified: `TransientEnvironmentError` stays
  transient, `EpisodeCancelled` stays cancelled, anything else is a `RemoteEnvironmentError`
  with the type's name and message; the traceback text is chained below (`RemoteTraceback`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Mapping
from typing import Any

from asyncgrpo.environments.protocol import (
    EpisodeCancelled,
    Message,
    StepResult,
    TransientEnvironmentError,
    as_messages,
    as_step_result,
)
from asyncgrpo.worker_process import REAP_TIMEOUT_S, RemoteTraceback, WorkerProcess, describe_exit, encode, receive, start_worker

START_TIMEOUT_S = 120.0
CLOSE_TIMEOUT_S = 30.0
EXIT_GRACE_S = 2.0


class RemoteEnvironmentError(Exception):
    """An environment in a worker process raised `remote_type`: `message` (the traceback is its `__cause__`)."""

    def __init__(self, source: str, remote_type: str, message: str) -> None:
        super().__init__(f"{source} raised {remote_type}: {message}")
        self.source = source
        self.remote_type = remote_type
        self.message = message


class EnvironmentProcessDied(Exception):
    """The worker process holding an environment ended without answering a call."""


class ProcessHost:
    """One episode of the environment `factory_spec` names, in its own worker process (see the module docstring)."""

    def __init__(self, factory_spec: str, observation_role: str) -> None:
        self.factory_spec = factory_spec
        self.observation_role = observation_role
        self._proc: WorkerProcess | None = None
        self._busy = False
        self._cancelled = False
        self.close_error: BaseException | None = None  # a cancel's close() runs in the worker, which is then killed
        self._ended = False  # closed or cancelled: the worker is gone or going

    @property
    def pid(self) -> int | None:
        """The worker's process id (also its process group's), once `reset` started it."""
        return None if self._proc is None else self._proc.pid

    async def reset(self, row: Mapping[str, Any]) -> tuple[Message, ...]:
        if self._proc is None and not self._ended:
            await self._start()
        return as_messages(await self._call("reset", dict(row)), self.observation_role, source=f"{self.factory_spec} reset")

    async def step(self, action_text: str) -> StepResult:
        return as_step_result(await self._call("step", action_text), self.observation_role, source=f"{self.factory_spec} step")

    async def close(self) -> None:
        """Call the environment's `close()` (bounded by `CLOSE_TIMEOUT_S`), then end the worker. Idempotent."""
        if self._ended:
            return
        try:
            if self._proc is not None:
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await self._call("close", None)
        except TimeoutError as exc:
            raise TimeoutError(
                f"env.factory = {self.factory_spec!r}: close() did not return within {CLOSE_TIMEOUT_S:g} s; the worker "
                f"process was killed. Fix: make close() return promptly (it may not wait for work it can interrupt)."
            ) from exc
        finally:
            self._ended = True
            await self._stop(EXIT_GRACE_S)

    async def cancel(self, grace_s: float) -> bool:
        """Stop the episode: the worker sets the token and calls close(); after `grace_s` its process group is killed."""
        self._cancelled = True
        if self._ended:
            return True
        self._ended = True
        if self._proc is not None:
            with contextlib.suppress(ConnectionError):
                self._proc.writer.write(encode(("cancel", None)))
        await self._stop(grace_s)
        return True

    async def _start(self) -> None:
        self._proc = proc = await start_worker("asyncgrpo.environments.worker")
        if self._ended:  # cancelled or closed while the worker was starting: nothing else will stop it
            await proc.stop(0.0)
            raise EpisodeCancelled(f"{self.factory_spec} reset: the episode was cancelled") if self._cancelled else RuntimeError(
                f"{self.factory_spec} reset: the episode's environment was closed while its worker started")
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                proc.writer.write(encode({"factory": self.factory_spec, "sys_path": list(sys.path), "parent_pid": os.getpid()}))
                await proc.writer.drain()
                await self._answer("create")
        except BaseException as exc:
            self._ended = True
            await self._stop(0.0)
            if isinstance(exc, TimeoutError):
                raise TimeoutError(
                    f"env.factory = {self.factory_spec!r}: the environment's worker process did not create the environment "
                    f"within {START_TIMEOUT_S:g} s. Fix: make the module import and the constructor faster, or use "
                    f"env.isolation: thread."
                ) from exc
            raise

    async def _call(self, op: str, arg: Any) -> Any:
        if self._cancelled:
            raise EpisodeCancelled(f"{self.factory_spec} {op}: the episode was cancelled")
        if self._ended or self._proc is None:
            raise RuntimeError(f"{self.factory_spec} {op}: the episode's environment is closed (or was never reset)")
        if self._busy:
            raise RuntimeError(f"{self.factory_spec} {op}: another call of this episode is still running; calls are one at a time")
        self._busy = True
        try:
            self._proc.writer.write(encode((op, arg)))
            await self._proc.writer.drain()
            return await self._answer(op)
        except ConnectionError as exc:
            raise await self._died(op) from exc
        finally:
            self._busy = False

    async def _answer(self, op: str) -> Any:
        """The worker's reply to `op`: its value, or what the environment raised, classified."""
        assert self._proc is not None
        try:
            reply = await receive(self._proc.reader)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise await self._died(op) from exc
        if reply[0] == "ok":
            return reply[1]
        _, kind, type_name, message, remote_traceback = reply
        source = f"env.factory = {self.factory_spec!r}" if op == "create" else f"{self.factory_spec} {op}"
        error: Exception
        if kind == "transient":
            error = TransientEnvironmentError(f"{source} raised {type_name}: {message}")
        elif kind == "cancelled":
            error = EpisodeCancelled(f"{source}: {message}")
        else:
            error = RemoteEnvironmentError(source, type_name, message)
        error.__cause__ = RemoteTraceback(remote_traceback)
        raise error

    async def _died(self, op: str) -> Exception:
        """The error for a call whose worker hung up: cancelled if `cancel` ended it, else the worker died."""
        if self._cancelled:
            return EpisodeCancelled(f"{self.factory_spec} {op}: the episode was cancelled")
        proc = self._proc
        assert proc is not None
        self._ended = True
        await self._stop(REAP_TIMEOUT_S)
        return EnvironmentProcessDied(
            f"env.isolation: process: the worker process (pid {proc.pid}) holding the environment {self.factory_spec!r} "
            f"{describe_exit(proc.returncode)} during {op}; its stderr above may say why. The rollout fails (it is not "
            f"retried: raise TransientEnvironmentError for failures worth retrying)."
        )

    async def _stop(self, grace_s: float) -> None:
        """Hang up, give the worker `grace_s` to exit, then SIGKILL its process group, and reap it (bounded)."""
        if self._proc is not None:
            await self._proc.stop(grace_s)
