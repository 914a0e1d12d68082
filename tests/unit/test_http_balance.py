"""`ServerIndex`: after any sequence of changes, its answers are those of a scan over the servers."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from asyncgrpo.generation.http_balance import ServerIndex
from asyncgrpo.generation.http_servers import PooledServer


@dataclass(eq=False)
class Server:
    position: int = -1
    healthy: bool = True
    excluded: str | None = None
    hung: str | None = None
    version: int = 0
    outstanding: int = 0


def scan(servers):
    usable = [s for s in servers if s.healthy and s.excluded is None and s.hung is None]
    return (min(usable, key=lambda s: s.outstanding) if usable else None,
            min((s.version for s in usable), default=None), len(usable),
            sum(s.healthy for s in servers), sum(s.outstanding for s in servers))


def answers(index):
    return index.least_loaded(), index.lowest_version(), index.usable_count, index.healthy_count, index.outstanding


@pytest.mark.parametrize("n", [1, 2, 3, 17, 256])
def test_the_index_answers_what_a_scan_over_the_servers_answers_after_every_change(n):
    rng = random.Random(n)
    servers = [Server() for _ in range(n)]
    index = ServerIndex(servers)
    assert [s.position for s in servers] == list(range(n))
    for _ in range(3000):
        server = rng.choice(servers)
        field = rng.choice(["healthy", "excluded", "hung", "version", "outstanding", "outstanding", "outstanding"])
        if field == "healthy":
            server.healthy = not server.healthy
        elif field in ("excluded", "hung"):
            setattr(server, field, None if getattr(server, field) else "why")
        elif field == "version":
            server.version += rng.choice([0, 1, 1, 2])
        else:
            server.outstanding = max(0, server.outstanding + rng.choice([-1, 1]))
        index.refresh(server)
        assert answers(index) == scan(servers)


def test_a_pooled_server_keeps_its_entry_up_to_date_on_every_change_of_what_the_index_reads():
    servers = [PooledServer(url=f"http://s{i}", version=3) for i in range(4)]
    index = ServerIndex(servers)
    for server in servers:
        server.index = index
    servers[0].outstanding += 2
    servers[1].hung = "hangs"
    servers[2].version = 1
    servers[3].healthy = False
    assert answers(index) == scan(servers) == (servers[2], 1, 2, 3, 2)
    servers[2].excluded = "failed install"
    assert answers(index) == scan(servers) == (servers[0], 3, 1, 3, 2)
