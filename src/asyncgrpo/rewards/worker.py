"""The child side of ``reward.isolation: process``: one worker process calling sync reward functions.

Started by `asyncgrpo.rewards.pool` as a fresh interpreter (never a fork of the trainer: a
fork after torch's and asyncio's threads are up can inherit a lock held by a thread that does
not exist in the child). It talks to its parent over one socket (file descriptor in argv[1]),
in frames of an 8-byte big-endian length and a pickle (worker_process.py):

    parent -> worker  {"specs": [...], "sys_path": [...], "parent_pid": int}   once
    worker -> parent  ("ready",) | ("config_error", message)                    once
    parent -> worker  (index, kwargs, callbacks)                                 per call
    worker -> parent  ("ok", result, records) | ("raised", exception, traceback_text)   per call

`callbacks` names TRL's log_metric / log_extra the function takes: the worker makes them on a `CallLog` of its
own (rewards/trl_args.py) and sends its `records()` back with the result; callables never cross the boundary.

The worker re-resolves ``reward.functions`` by name (`resolve_reward`), so it needs nothing
pickled but the inputs. It serves one call at a time until the socket closes, then exits 0.

Invariants:
- It dies with its parent: on Linux the kernel sends it SIGKILL when the parent goes
  (PR_SET_PDEATHSIG), even while it is stuck in C code holding the GIL; and it exits when the
  socket reaches end of file. Terminal signals do not reach it (own session; SIGINT ignored):
  the parent alone decides when it stops.
- Anything a function raises, SystemExit and KeyboardInterrupt included, goes back to the
  parent as the exception (or `RemoteError` if it cannot be pickled); the worker keeps serving.
"""

from __future__ import annotations

import asyncio
import inspect
import pickle
import signal
import socket
import sys
import traceback
from io import BufferedIOBase
from typing import Any

from asyncgrpo.worker_process import HEADER, die_with_parent, encode


class RemoteError(Exception):
    """Stands for an exception raised in a worker that cannot be pickled: its type's name and message."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(type_name, message)
        self.remote_type = type_name
        self.message = message

    def __str__(self) -> str:
        return self.message


def _read_frame(stream: BufferedIOBase) -> Any | None:
    """The next message, or None at end of file."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    data = stream.read(size)
    return pickle.loads(data) if len(data) == size else None


def _send(stream: BufferedIOBase, obj: Any) -> None:
    stream.write(encode(obj))
    stream.flush()


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it survives a pickle round trip, else a `RemoteError` with its type's name and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RemoteError(type(exc).__name__, str(exc))


async def _settle(awaitable: Any) -> Any:
    return await awaitable


def _call(fn: Any, kwargs: dict[str, Any], callbacks: tuple[str, ...]) -> bytes:
    from asyncgrpo.rewards.trl_args import CallLog

    log = CallLog(len(kwargs.get("completions", ())))
    try:
        result = fn(**kwargs, **{name: getattr(log, name) for name in callbacks})
        if inspect.isawaitable(result):
            result = asyncio.run(_settle(result))
    except BaseException as exc:  # noqa: BLE001 - every failure of the function goes back to the parent
        return encode(("raised", _portable(exc), "".join(traceback.format_exception(exc))))
    try:
        return encode(("ok", result, log.records()))
    except Exception as exc:  # noqa: BLE001
        error = RemoteError(type(exc).__name__, f"its {type(result).__name__} result cannot be sent back from the worker process: {exc}")
        return encode(("raised", error, ""))


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with socket.socket(fileno=int(sys.argv[1])) as sock, sock.makefile("rwb") as stream:
        init = _read_frame(stream)
        if init is None:
            return
        die_with_parent(init["parent_pid"])
        sys.path[:] = init["sys_path"]
        from asyncgrpo.errors import ConfigError
        from asyncgrpo.rewards.resolve import resolve_reward

        try:
            functions = [resolve_reward(spec, i)[1] for i, spec in enumerate(init["specs"])]
        except ConfigError as exc:
            _send(stream, ("config_error", str(exc)))
            return
        _send(stream, ("ready",))
        while (message := _read_frame(stream)) is not None:
            index, kwargs, callbacks = message
            stream.write(_call(functions[index], kwargs, callbacks))
            stream.flush()


if __name__ == "__main__":
    main()
