"""The child side of ``env.isolation: process``: one worker process holding one episode's environment.

Started by `asyncgrpo.environments.process_host.ProcessHost` as a fresh interpreter in its own
session (so its process group holds it and everything it starts). It talks to its parent over
one socket (file descriptor in argv[1]) in frames of an 8-byte big-endian length and a pickle
(worker_process.py):

    parent -> worker  {"factory": spec, "sys_path": [...], "parent_pid": int}     once
    worker -> parent  ("ok", None) | ("raised", kind, type_name, message, traceback)   once: the environment exists, or why not
    parent -> worker  ("reset", row) | ("step", action_text) | ("close", None)     one at a time
    worker -> parent  ("ok", value) | ("raised", kind, type_name, message, traceback)
    parent -> worker  ("cancel", None)                                              at any time

`kind` classifies what the environment raised: "transient" (`TransientEnvironmentError`),
"cancelled" (`EpisodeCancelled`) or "error" (anything else, SystemExit included). Exceptions
travel as text, never pickled, so the parent needs none of the environment's modules.

Invariants:
- The environment's plain methods run on one thread of the worker (always the same one);
  `async def` ones run on the worker's event loop, which keeps reading the socket meanwhile.
- On "cancel" (or end of file: the parent closed or died) the worker sets the episode's
  token, cancels the call in flight (an `async` one is interrupted; a plain one keeps running
  on its thread), calls `close()` (once per episode, on another thread) and exits, ending
  whatever still runs on its threads. A `close()` that does not return, or anything the
  environment started, is killed by the parent with the worker's whole process group after
  the grace.
- It dies with its parent (PR_SET_PDEATHSIG: worker_process.die_with_parent) and ignores SIGINT: the
  parent alone decides when it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import os
import pickle
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asyncgrpo.environments.protocol import CancelToken, EpisodeCancelled, TransientEnvironmentError
from asyncgrpo.worker_process import HEADER, die_with_parent, encode, receive

Reply = tuple[Any, ...]


def raised(exc: BaseException) -> Reply:
    """What the environment raised, as the reply that carries it: classified, as text."""
    if isinstance(exc, TransientEnvironmentError):
        kind = "transient"
    elif isinstance(exc, EpisodeCancelled | asyncio.CancelledError):
        kind = "cancelled"
    else:
        kind = "error"
    return ("raised", kind, type(exc).__name__, str(exc), "".join(traceback.format_exception(exc)))


def takes_token(method: Callable[..., Any]) -> bool:
    """Whether `method` declares a keyword parameter named `token` (the protocol's opt-in)."""
    try:
        parameter = inspect.signature(method).parameters.get("token")
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)


class _Episode:
    """The worker's one environment instance, its token, and the call in flight."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.token = CancelToken()
        self.env: Any = None
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncgrpo-env")
        self.in_flight: asyncio.Task[None] | None = None
        self.close_called = False  # close() runs once per episode: the parent's "close", or stop()

    async def invoke(self, method: Callable[..., Any], *args: Any, token: bool = True) -> Any:
        """`method(*args)` (and `token=` if it declares it and `token`): async on the loop, sync on the environment's thread."""
        kwargs = {"token": self.token} if token and takes_token(method) else {}
        if inspect.iscoroutinefunction(method):
            return await method(*args, **kwargs)
        result = await asyncio.get_running_loop().run_in_executor(self.thread, functools.partial(method, *args, **kwargs))
        return await result if inspect.isawaitable(result) else result

    async def answer(self, op: str, arg: Any) -> None:
        try:
            if op == "create":
                self.env = await self.invoke(arg, token=False)  # the factory is called with no arguments
                value = None
            elif op == "close":
                self.close_called = True
                await self.invoke(self.env.close, token=False)
                value = None
            else:
                value = await self.invoke(getattr(self.env, op), arg)
            frame = encode(("ok", value))
        except asyncio.CancelledError:
            raise  # only stop() cancels a call: the episode is cancelled and the parent expects no reply
        except BaseException as exc:  # noqa: BLE001 - every failure of the environment goes back to the parent
            frame = encode(raised(exc))
        with contextlib.suppress(ConnectionError):
            self.writer.write(frame)
            await self.writer.drain()

    async def stop(self) -> None:
        """Cancel: set the token, stop waiting for the call in flight, call close() on another thread."""
        self.token.cancel()
        call = self.in_flight
        if call is not None:
            call.cancel()
        if self.env is not None and not self.close_called:
            self.close_called = True
            close = self.env.close
            with contextlib.suppress(BaseException):  # the episode is cancelled; what close raises has no one to go to
                if inspect.iscoroutinefunction(close):
                    await close()
                else:
                    await asyncio.to_thread(close)
        if call is not None:
            await asyncio.gather(call, return_exceptions=True)  # an async call unwinds; a plain one is only awaited


async def serve(sock: socket.socket, factory: Callable[[], Any] | None, load_error: BaseException | None) -> None:
    reader, writer = await asyncio.open_connection(sock=sock)
    episode = _Episode(writer)
    if load_error is not None:
        writer.write(encode(raised(load_error)))
        await writer.drain()
        return
    episode.in_flight = asyncio.create_task(episode.answer("create", factory))
    while True:
        try:
            op, arg = await receive(reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            op, arg = "cancel", None  # the parent closed the socket or died
        if op == "cancel":
            await episode.stop()
            return
        episode.in_flight = asyncio.create_task(episode.answer(op, arg))


def _recv_exactly(sock: socket.socket, size: int) -> bytes | None:
    """`size` bytes from `sock` (unbuffered: the event loop reads the rest), or None at end of file."""
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[1]))
    header = _recv_exactly(sock, HEADER.size)  # the first frame, read blocking, before the event loop exists
    if header is None:
        return
    body = _recv_exactly(sock, HEADER.unpack(header)[0])
    if body is None:
        return
    init = pickle.loads(body)
    die_with_parent(init["parent_pid"])
    sys.path[:] = init["sys_path"]
    factory: Callable[[], Any] | None = None
    load_error: BaseException | None = None
    try:
        from asyncgrpo.environments.factories import load_factory

        factory = load_factory(init["factory"])
    except BaseException as exc:  # noqa: BLE001 - goes back to the parent as the reason the worker cannot serve
        load_error = exc
    asyncio.run(serve(sock, factory, load_error))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # not a normal exit: a thread the environment left running must not keep the worker alive


if __name__ == "__main__":
    main()
