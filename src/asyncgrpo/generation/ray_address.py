"""Checking `ray.address` before `ray.init` joins it: is anything listening there?

Job: `probe(address)` opens (and closes) one TCP connection to the host and port that
`ray.address` names (``host:port``, ``[v6]:port`` or ``ray://host:port``), on the event loop, and
returns a line saying what it reached; it raises `GenerationError` at once when nothing can be
listening (connection refused, unknown host, no route), naming ray.address, its value, what was
tried and the fix. ``auto`` (and an address without a port) names no socket of its own: Ray finds
the cluster, and `probe` returns a line saying so.

Why: `ray.init(address=...)` where nothing listens never returns (Ray 2.60 retries the GCS
forever, logging every 5 s), and a thread inside it cannot be stopped. The probe turns the common
mistake (no cluster there) into an error within milliseconds; the caller's deadline
(`ray.startup_timeout_s`, ray_cluster.py) bounds the rest, the probe included (a host that drops
packets never refuses).

Invariants: the probe has no deadline of its own (the caller's bounds it) and leaves no socket open.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

from asyncgrpo.errors import GenerationError


def host_and_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a ``[ray://]host:port`` address; None for ``auto`` or an address without a port."""
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.removeprefix("[").removesuffix("]"), int(port)


async def probe(address: str) -> str:
    """One TCP connection to `address`'s host and port; returns what it reached, raises GenerationError if refused."""
    target = host_and_port(address)
    if target is None:
        return f"ray.address = {address!r} names no host:port to check: Ray looks the cluster up itself"
    host, port = target
    try:
        _, writer = await asyncio.open_connection(host, port)
    except OSError as exc:
        raise GenerationError(
            f"ray.address = {address!r}: nothing accepts connections at {host}:{port} (a TCP connection was refused or "
            f"could not be routed: {os.strerror(exc.errno) if exc.errno else exc}), so there is no Ray cluster to join there. Fix: start the "
            f"cluster first (`ray start --head --port={port}` on that machine), point ray.address at a running "
            f"cluster's address (`ray status` on its head node prints it), or set ray.address: null to start a local "
            f"cluster for this run.", backend="ray") from None
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return f"a TCP connection to {host}:{port} was accepted"
