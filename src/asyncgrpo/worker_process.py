"""A Python worker process linked to this one by a socket pair: start it, always be able to end it, frame what is said.

Job: `start_worker(module)` runs `python -c "<import module>; main()" <fd>` in a session of its
own (so a kill of its process group stops whatever it started), with stdin closed and the child's
end of a socket pair as its one extra file descriptor, and returns a `WorkerProcess`: the
parent's stream pair, the pid, the exit status and a bounded `stop`. Both sides share the link's
framing (an 8-byte big-endian length and a pickle: `encode`, `receive`) and the child ties its life
to its parent's (`die_with_parent`). Used by the reward worker pool (rewards/pool.py, rewards/worker.py)
and the environment's worker process (environments/process_host.py, environments/worker.py); what
the frames mean is theirs.

Invariants:
- The child's end is closed in this process whatever happens; if the link cannot be opened the
  process is killed before the error goes on (it is never left running unseen).
- When the loop sees the worker exit, its process group is sent SIGKILL at once (what it started
  dies with it); no signal goes to that pid afterwards (it may be reused).
- `stop` ends the worker even when it is cancelled part-way: the SIGKILL to the process group, the
  bounded wait for its exit and the close of the loop's subprocess transport run in `finally`
  blocks (so `asyncio.run` ending mid-stop leaves no process and no transport the loop never saw end).
- A `WorkerProcess` dropped without `stop` (its owner never closed, or the interpreter exits) is
  ended the same way by a finalizer; and by the kernel when this process dies (each worker calls
  `die_with_parent` first thing: PR_SET_PDEATHSIG on Linux, and an exit if the parent is already gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import pickle
import signal
import socket
import struct
import sys
import weakref
from pathlib import Path
from typing import Any

_SRC = str(Path(__file__).resolve().parents[1])  # the directory holding the asyncgrpo package
REAP_TIMEOUT_S = 5.0
HEADER = struct.Struct("!Q")  # a frame: this length, then that many bytes of pickle
PR_SET_PDEATHSIG = 1


def encode(obj: Any) -> bytes:
    """`obj` as one frame of the link."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


async def receive(reader: asyncio.StreamReader) -> Any:
    """The next frame's object; `asyncio.IncompleteReadError` at end of file."""
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return pickle.loads(await reader.readexactly(size))


def die_with_parent(parent_pid: int) -> None:
    """In a worker: have the kernel SIGKILL this process when its parent dies (Linux), even while it is stuck in C code
    holding the GIL; exit at once if the parent (`parent_pid`) went before that took effect."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(0)


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker, as text; chained below the exception."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0])


def describe_exit(returncode: int | None) -> str:
    """How a worker ended, for an error message; `returncode` as asyncio reports it (None: unknown, it was killed)."""
    if returncode is None:
        return "closed its connection and was killed"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name} (exit code {returncode})"
    return f"exited with exit code {returncode}"


class _ExitWatch(asyncio.SubprocessProtocol):
    """When the worker exits: SIGKILL what is left of its process group (what it started dies with it; the pid cannot
    have been reused while the group has a member), close the transport, and let `WorkerProcess` know."""

    def __init__(self) -> None:
        self.exited = asyncio.Event()  # set once, never cleared
        self.transport: asyncio.SubprocessTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.SubprocessTransport)
        self.transport = transport

    def process_exited(self) -> None:
        assert self.transport is not None
        _kill_group(self.transport.get_pid())
        self.transport.close()
        self.exited.set()


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _end(transport: asyncio.SubprocessTransport) -> None:
    """SIGKILL the worker's process group unless its exit was seen (its pid may be reused since), and close its transport."""
    if transport.get_returncode() is None:
        _kill_group(transport.get_pid())
    transport.close()


class WorkerProcess:
    """One started worker: `reader`/`writer` are the link, `pid` leads the worker's own process group."""

    def __init__(self, transport: asyncio.SubprocessTransport, watch: _ExitWatch, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self._transport = transport
        self._watch = watch
        self.reader = reader
        self.writer = writer
        self.pid = transport.get_pid()
        self._finalizer = weakref.finalize(self, _end, transport)

    @property
    def returncode(self) -> int | None:
        """The exit code once the loop has seen the exit (negative: killed by that signal), else None."""
        return self._transport.get_returncode()

    async def exit_within(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the worker to exit; whether it has."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._watch.exited.wait()
        return self._watch.exited.is_set()

    def kill(self) -> None:
        """SIGKILL the worker's process group now: the worker and everything it started (no wait). Once the exit has
        been seen this does nothing: the group was killed then, and the pid may since belong to another process."""
        if not self._watch.exited.is_set():
            _kill_group(self.pid)

    async def stop(self, grace_s: float) -> None:
        """Hang up, give the worker `grace_s` to exit, SIGKILL its process group, and reap it (bounded).

        Cancelled part-way, it still kills the group, waits (bounded) for the exit and closes the transport before the
        cancellation goes on: a loop that closes right after still saw the exit."""
        self.writer.close()  # end of file: the worker ends its work and exits
        try:
            try:
                if grace_s > 0:
                    await self.exit_within(grace_s)
            finally:
                self.kill()
                await self.exit_within(REAP_TIMEOUT_S)  # also when cancelled (bounded): a killed worker exits at once
        finally:
            self._finalizer()  # closes the transport (and kills again if no exit was seen)


async def start_worker(module: str) -> WorkerProcess:
    """Start `module.main()` in a fresh interpreter, given the socket's fd as its first argument."""
    boot = f"import sys; sys.path.insert(0, {_SRC!r}); from {module} import main; main()"
    parent, child = socket.socketpair()
    try:
        transport, watch = await asyncio.get_running_loop().subprocess_exec(
            _ExitWatch, sys.executable, "-c", boot, str(child.fileno()),
            stdin=asyncio.subprocess.DEVNULL, stdout=None, stderr=None, pass_fds=(child.fileno(),), start_new_session=True,
        )
    except BaseException:
        parent.close()
        raise
    finally:
        child.close()
    try:
        reader, writer = await asyncio.open_connection(sock=parent)
    except BaseException:
        parent.close()
        _end(transport)
        raise
    return WorkerProcess(transport, watch, reader, writer)
