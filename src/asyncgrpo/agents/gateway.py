"""The gateway: an OpenAI-compatible HTTP endpoint on 127.0.0.1 whose sessions are the run's agent episodes.

Job: serve `POST /s/<key>/v1/chat/completions`, `POST /s/<key>/v1/completions` and
`GET /s/<key>/v1/models` for the sessions it holds. A request is handed, as a `Call`, to its
session's `Inbox`; the session's episode (episode.py) answers it (generating on the run's
generator in the episode's own task, so cancelling the episode aborts the request in flight).

- `open()` makes a session (a fresh random key, its base URL `http://127.0.0.1:<port>/s/<key>/v1`)
  and starts the server if none runs; `release()` forgets it and stops the server when no session
  is left, so a gateway holds a port only while episodes run and leaves nothing behind. The stop
  (the wait for the lock included) has a deadline: one that outlives it is cancelled, its server
  forgotten, and `release` says so (False): an episode's ending never waits on it unbounded.
- An unknown key is refused (404). A closed session answers every call, the queued and the one in
  flight included, with HTTP 410 (the openai client raises `APIStatusError`), counted in
  `Inbox.after_close` until the session is released; after that its key is unknown.

Invariants: binds 127.0.0.1 only; a handler never waits for anything but its call's answer, which
the session's episode always gives (an answer, a refusal or the close); no work of a session runs
in a handler.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from asyncgrpo.agents.wire import Refused

HOST = "127.0.0.1"
NOT_JSON = object()  # the body of a request that is not JSON (the episode refuses it as malformed and counts it)


@dataclass(eq=False)
class Call:
    """One request of a session: its endpoint ("chat" or "text"), its JSON body, and the answer the handler awaits."""

    kind: str
    body: Any
    answer: asyncio.Future[dict[str, Any]] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def refuse(self, refusal: Refused) -> None:
        if not self.answer.done():
            self.answer.set_exception(refusal)
            self.answer.exception()  # marked retrieved: its handler may be gone (the client disconnected), or it is the "done" mark


class Inbox:
    """One session's calls, in arrival order, until it closes."""

    def __init__(self, key: str, base_url: str) -> None:
        self.key = key
        self.base_url = base_url
        self.calls: asyncio.Queue[Call] = asyncio.Queue()
        self.closed = False
        self.after_close = 0

    def submit(self, call: Call) -> None:
        if self.closed:
            self.after_close += 1
            raise Refused("after_close", f"session {self.key} is closed: its episode ended (the agent returned, failed, hit a limit or its "
                          "group went stale). Fix: return from the agent when a call raises; a closed session answers nothing.")
        self.calls.put_nowait(call)

    def close(self) -> None:
        """Refuse the calls waiting and every later one (the call in flight is refused by its episode)."""
        self.closed = True
        while not self.calls.empty():
            self.calls.get_nowait().refuse(Refused("after_close", f"session {self.key} closed before this call was served."))


class Gateway:
    """The run's gateway (see the module docstring); `model` is the id /v1/models lists."""

    def __init__(self, model: str = "policy") -> None:
        self.model = model
        self._inboxes: dict[str, Inbox] = {}
        self._runner: web.AppRunner | None = None
        self._port = 0
        self._lock = asyncio.Lock()

    async def open(self) -> Inbox:
        async with self._lock:
            if self._runner is None:
                await self._start()
            key = secrets.token_urlsafe(16)
            inbox = self._inboxes[key] = Inbox(key, f"http://{HOST}:{self._port}/s/{key}/v1")
            return inbox

    async def release(self, inbox: Inbox, deadline_s: float) -> bool:
        """Close and forget the session; stop the server if it was the last. Whether that ended within `deadline_s` (if not,
        the stop is cancelled and its server forgotten: the next `open` starts a fresh one)."""
        inbox.close()
        self._inboxes.pop(inbox.key, None)
        try:
            async with asyncio.timeout(deadline_s):
                async with self._lock:
                    if not self._inboxes and self._runner is not None:
                        runner, self._runner = self._runner, None
                        await runner.cleanup()
        except TimeoutError:
            return False
        return True

    async def _start(self) -> None:
        app = web.Application()
        app.add_routes([
            web.post("/s/{key}/v1/chat/completions", self._chat),
            web.post("/s/{key}/v1/completions", self._text),
            web.get("/s/{key}/v1/models", self._models),
        ])
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.0)
        await runner.setup()
        site = web.TCPSite(runner, HOST, 0)
        await site.start()
        self._port = runner.addresses[0][1]
        self._runner = runner

    async def _chat(self, request: web.Request) -> web.Response:
        return await self._call(request, "chat")

    async def _text(self, request: web.Request) -> web.Response:
        return await self._call(request, "text")

    async def _models(self, request: web.Request) -> web.Response:
        if self._inbox(request) is None:
            return _refused(_unknown(request))
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "asyncgrpo"}]})

    async def _call(self, request: web.Request, kind: str) -> web.Response:
        inbox = self._inbox(request)
        if inbox is None:
            return _refused(_unknown(request))
        try:
            body = json.loads(await request.read())
        except ValueError:
            body = NOT_JSON
        call = Call(kind, body)
        try:
            inbox.submit(call)
            return web.json_response(await call.answer)
        except Refused as refusal:
            return _refused(refusal)

    def _inbox(self, request: web.Request) -> Inbox | None:
        return self._inboxes.get(request.match_info["key"])


def _unknown(request: web.Request) -> Refused:
    return Refused("unknown_session", f"no session {request.match_info['key']!r} in this run's gateway (it serves the run's open episodes "
                   "only; an ended episode's key is forgotten). Fix: use the base URL the agent was given, during its episode.")


def _refused(refusal: Refused) -> web.Response:
    return web.json_response(refusal.body(), status=refusal.status)
