"""The HTTP pool's index of its servers: the least-loaded usable one, the lowest usable version, the counts.

Job: answer, in O(1), the questions the pool asks on every request and every change — which usable
server has the fewest open requests, the lowest version among usable servers, how many servers are
usable and healthy, how many requests are open in all — so that no request and no health change
scans the servers. `refresh(server)` brings a server's entries up to date in O(log n) (n servers);
`PooledServer` calls it on every change of its health, exclusion, hung mark, version or open requests.

Invariants:
- After every `refresh`, the answers equal those of a scan over the servers' current fields
  (``usable`` = healthy, not excluded, not hung).
- Fairness: `least_loaded` is the usable server with the fewest open requests; among equals, the one
  listed first in ``generation.http.base_urls`` (as ``min`` over the list picks), so dispatching one
  request at a time keeps the open requests of usable servers within one of each other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

_NONE = math.inf  # the key of a position that is not usable: above every real key


class IndexedServer(Protocol):
    position: int
    healthy: bool
    excluded: str | None
    hung: str | None
    version: int
    outstanding: int


S = TypeVar("S", bound=IndexedServer)


class MinTree:
    """The minimum of `size` keys (positions 0..size-1, all `_NONE` at first): `set` O(log size), `min` O(1)."""

    def __init__(self, size: int) -> None:
        self._leaves = 1 << max(size - 1, 0).bit_length()
        self._nodes: list[float] = [_NONE] * (2 * self._leaves)

    def set(self, position: int, key: float) -> None:
        nodes = self._nodes
        i = position + self._leaves
        if nodes[i] == key:
            return
        nodes[i] = key
        while i > 1:
            sibling = nodes[i ^ 1]
            low = key if key <= sibling else sibling
            i >>= 1
            if nodes[i] == low:
                return  # the minimum above is unchanged
            nodes[i] = key = low

    def min(self) -> float:
        return self._nodes[1]


class ServerIndex(Generic[S]):
    """The index of `servers` (it sets each one's `position`); see the module docstring."""

    def __init__(self, servers: Sequence[S]) -> None:
        self._servers = servers
        n = len(servers)
        self._load = MinTree(n)  # usable: outstanding * n + position (fewest open requests, then first listed)
        self._versions = MinTree(n)  # usable: version
        self._usable = [False] * n
        self._healthy = [False] * n
        self._open = [0] * n
        self.usable_count = 0
        self.healthy_count = 0
        self.outstanding = 0  # open requests over all servers
        for position, server in enumerate(servers):
            server.position = position
            self.refresh(server)

    def refresh(self, server: IndexedServer) -> None:
        """Bring `server`'s entries up to date with its fields (O(log n))."""
        position = server.position
        healthy = server.healthy
        usable = healthy and server.excluded is None and server.hung is None
        self.usable_count += usable - self._usable[position]
        self.healthy_count += healthy - self._healthy[position]
        self.outstanding += server.outstanding - self._open[position]
        self._usable[position], self._healthy[position], self._open[position] = usable, healthy, server.outstanding
        if usable:
            self._load.set(position, server.outstanding * len(self._servers) + position)
            self._versions.set(position, server.version)
        else:
            self._load.set(position, _NONE)
            self._versions.set(position, _NONE)

    def least_loaded(self) -> S | None:
        """The usable server with the fewest open requests (first listed among equals); None if none is usable."""
        key = self._load.min()
        return None if key == _NONE else self._servers[int(key) % len(self._servers)]

    def lowest_version(self) -> int | None:
        """The lowest version among usable servers; None if none is usable."""
        version = self._versions.min()
        return None if version == _NONE else int(version)
