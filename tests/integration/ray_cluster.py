"""Helpers of the Ray tests: a local cluster in its own temp dir, and the processes that belong to it.

A test's cluster lives under its own `RAY_TMPDIR`, which every process of that cluster inherits
(workers rename themselves `ray::...`, so their command line does not say it, their environment
does): a test finds the cluster's processes by it, and checks that none is left after teardown
without touching any other Ray cluster on the machine. A process whose environment no longer
shows it (Ray's agents rename themselves with a setproctitle that can wipe /proc/PID/environ,
unless SPT_NOENV is set) is found by its open log files under that directory.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncgrpo.generation.ray_cluster import ray_environment_defaults

ray_environment_defaults()  # before Ray is first imported, as asyncgrpo does: a local cluster listens on loopback only
ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'asyncgrpo[ray]' (make test installs it)")


def short_temp_dir() -> str:
    """A short absolute directory for a Ray cluster (its unix socket paths must stay under 108 bytes)."""
    return tempfile.mkdtemp(prefix="agr-ray-")


def processes_of(temp_dir: str) -> dict[int, str]:
    """pid -> command line of every live process started with RAY_TMPDIR=`temp_dir`, or holding a file under it open."""
    marker = f"RAY_TMPDIR={temp_dir}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            status = (entry / "status").read_text()
        except OSError:
            continue
        if (marker in environ or _holds_a_file_under(entry, temp_dir)) and "\nState:\tZ" not in status:
            found[int(entry.name)] = cmdline.strip()
    return found


def _holds_a_file_under(proc_dir: Path, temp_dir: str) -> bool:
    with contextlib.suppress(OSError):  # exited, or another user's
        for fd in (proc_dir / "fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd).startswith(temp_dir + "/"):
                    return True
    return False


def left_after(temp_dir: str, grace_s: float = 15.0) -> dict[int, str]:
    """The processes of the cluster under `temp_dir` still alive `grace_s` after this call (workers exit
    a moment after their raylet): each is awaited through a pidfd, which becomes readable when it exits."""
    found = processes_of(temp_dir)
    _await_exit(found, grace_s)
    alive = processes_of(temp_dir)
    return {pid: cmd for pid, cmd in found.items() if pid in alive}


def still_running(pids, grace_s: float = 15.0) -> list[int]:
    """Those of `pids` still alive `grace_s` after this call."""
    _await_exit(pids, grace_s)
    return [pid for pid in pids if _alive(pid)]


def _alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def _await_exit(pids, grace_s: float) -> None:
    """Return once every one of `pids` has exited, or after `grace_s`: each is awaited through a pidfd, readable at its exit."""
    fds = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            continue
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + grace_s
    try:
        while fds and (left_ms := (deadline - time.monotonic()) * 1000) > 0:
            for fd, _ in poller.poll(left_ms):
                poller.unregister(fd)
                os.close(fd)
                del fds[fd]
    finally:
        for fd in fds:
            os.close(fd)


def kill_processes(pids) -> None:
    """SIGKILL these pids (ours: found by our cluster's temp dir), each by its id."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@contextlib.contextmanager
def local_cluster(num_cpus: int = 2) -> Iterator[str]:
    """A local Ray cluster of `num_cpus` CPUs under its own RAY_TMPDIR (yielded), connected in this process; afterwards no
    process of it may be left (any found is killed, then reported)."""
    temp_dir = short_temp_dir()
    os.environ["RAY_TMPDIR"] = temp_dir  # inherited by the cluster's processes: how they are found
    try:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
        yield temp_dir
    finally:
        ray.shutdown()
        del os.environ["RAY_TMPDIR"]
        left = left_after(temp_dir)
        kill_processes(left)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"Ray processes left after ray.shutdown(): {left}"
