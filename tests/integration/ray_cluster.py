"""Helpers of the Ray tests: a local cluster in its own temp dir, and the processes that belong to it.

Every Ray process of a cluster names its session directory (under the cluster's temp dir) on its
command line, so the processes of one cluster are found by that directory, and a test can check
that none is left after teardown without touching any other Ray cluster on the machine.
"""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'asyncgrpo[ray]' (make test installs it)")


def short_temp_dir() -> str:
    """A short absolute directory for a Ray cluster (its unix socket paths must stay under 108 bytes)."""
    return tempfile.mkdtemp(prefix="agr-ray-")


def processes_of(temp_dir: str) -> dict[int, str]:
    """pid -> command line of every live process whose command line mentions `temp_dir`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            status = (entry / "status").read_text()
        except OSError:
            continue
        if temp_dir in cmdline and "\nState:\tZ" not in status:
            found[int(entry.name)] = cmdline
    return found


def kill_processes(pids) -> None:
    """SIGKILL these pids (ours: found by our cluster's temp dir), each by its id."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
