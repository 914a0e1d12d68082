"""Which server each agent session's calls go to: the session's own while it takes work (generation/http.py's
servers, generation/ray_pool.py's actors).

Job: remember, per session (`Affinity`, types.py), the server its first call went to, so every later call can prefer
it (each turn's prompt is the whole conversation so far, which meets its own prefix in that server's cache); when
the backend had to choose another server (the pinned one cannot take work), the session moves there for good,
counted in `counters["session_moves"]` and logged naming the session, the new server and the old one's state.

Invariants: entries are held weakly (a session's pin goes with its `Affinity`); a request without a session is never
pinned and never counted.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import MutableMapping
from typing import Generic, Protocol, TypeVar

from asyncgrpo.types import Affinity

log = logging.getLogger("asyncgrpo")


class Server(Protocol):
    def describe(self) -> str: ...


S = TypeVar("S", bound=Server)


class SessionPins(Generic[S]):
    """Each session's server; see the module docstring. `label`: what the backend calls a server in the log line."""

    def __init__(self, backend: str, counters: MutableMapping[str, int], label: str) -> None:
        self.backend, self.counters, self.label = backend, counters, label
        self.counters["session_moves"] = 0
        self._pins: weakref.WeakKeyDictionary[Affinity, S] = weakref.WeakKeyDictionary()

    def preferred(self, session: Affinity | None) -> S | None:
        """The server `session`'s calls went to so far (None: no session, or its first call)."""
        return None if session is None else self._pins.get(session)

    def chosen(self, session: Affinity | None, server: S, name: str) -> None:
        """`session`'s call goes to `server` (named `name`): its server from now on; a move when it had another."""
        if session is None:
            return
        pinned = self._pins.get(session)
        if server is pinned:
            return
        if pinned is not None:
            self.counters["session_moves"] += 1
            log.info("%s: session %s moved to %s: its %s cannot take work (%s).", self.backend, session.name, name,
                     self.label, pinned.describe())
        self._pins[session] = server
