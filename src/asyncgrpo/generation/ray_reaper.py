"""The reaper: a small process that stops a run's local Ray cluster when the driver dies without stopping it.

Job: a driver killed with SIGKILL (or by the OOM killer) runs no cleanup. Ray's head processes
die with it (they are spawned with PR_SET_PDEATHSIG), but not everything the raylet started: its
agents (`ray::DashboardAgent`, `ray::RuntimeEnvAgent`) and possibly workers outlive their raylet.
`Reaper.start` starts, right after `ray.init` started the local cluster, this module as a process
of its own that waits for the driver; when the driver is gone it stops that cluster's processes and
exits. `dismiss()` (the driver's clean `disconnect()`, after `ray.shutdown()`) makes it exit at once.

Invariants:
- Only that run's cluster is touched, never another (no `ray stop`): the driver sets
  `ASYNCGRPO_RAY_CLUSTER=<a token of its own>` in its environment while `ray.init` starts the
  cluster (`marked_environment`), so gcs_server and the raylet inherit it, and from the raylet every
  agent and worker and their children. The reaper stops exactly the live processes whose
  environment (/proc/PID/environ, as at their exec) holds that token. Each is held by a pidfd opened
  before its environment is read again, and signalled through it: a pid reused meanwhile is never
  signalled.
- The driver's death is seen even on SIGKILL, by either of two: the driver's pidfd (readable when
  it exits) and EOF on the reaper's stdin, a pipe whose write end only the driver holds
  (close-on-exec: no program the driver starts holds it; a fork that keeps it delays nothing, the
  pidfd still sees the driver go). A byte on that pipe is `dismiss()`.
- Stopping is bounded: SIGTERM to every marked process, SIGKILL to those alive `TERM_GRACE_S`
  later, then a fresh look for marked processes started meanwhile (at most `ROUNDS` rounds); then
  the reaper exits. Until the driver is gone it only waits (its one wait has no deadline of its
  own: it is bounded by the driver's life).
- It survives what stops the driver: it runs in a session (and process group) of its own, so a
  terminal's Ctrl-C (SIGINT to the foreground process group), SIGHUP, or a signal to the driver's
  group does not reach it; the driver handles those and dismisses it on its clean stop.
- It holds none of the driver's stdio (whoever reads the driver's stdout or stderr to EOF gets it
  when the driver ends): its stdout and stderr go to `asyncgrpo-reaper.log` in the Ray session's
  log directory, which says what it stopped.
- This file uses the standard library only: it runs as a script (`python -I ray_reaper.py ...`),
  without importing asyncgrpo or Ray.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

MARKER_VAR = "ASYNCGRPO_RAY_CLUSTER"
TERM_GRACE_S = 5.0  # SIGTERM -> SIGKILL
ROUNDS = 3
LOG_NAME = "asyncgrpo-reaper.log"
_DISMISS = b"x"


@contextlib.contextmanager
def marked_environment(token: str, extra: Mapping[str, str] | None = None) -> Iterator[None]:
    """`MARKER_VAR=token` and `SPT_NOENV=1` (and `extra`) in this process's environment for the block (processes
    started in it inherit them), then as before.

    SPT_NOENV keeps the mark readable: Ray's processes rename themselves (`ray::DashboardAgent`) with a vendored
    setproctitle, which otherwise reuses the memory behind /proc/PID/environ for the longer title, wiping some
    or all of the variables there (Ray sets SPT_NOENV for its workers, not for its agents).
    """
    marks = {MARKER_VAR: token, "SPT_NOENV": "1", **(extra or {})}
    before = {name: os.environ.get(name) for name in marks}
    os.environ.update(marks)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


class Reaper:
    """The driver's handle on its reaper process (the process runs `main` below)."""

    def __init__(self, process: subprocess.Popen[bytes], write_fd: int) -> None:
        self._process = process
        self._write_fd: int | None = write_fd

    @property
    def pid(self) -> int:
        return self._process.pid

    @classmethod
    def start(cls, token: str, session_dir: str) -> Reaper:
        """Start the reaper of the cluster whose processes carry `token` (session logs under `session_dir`)."""
        read_fd, write_fd = os.pipe()  # both close-on-exec; the child gets read_fd as its stdin
        try:
            with open(Path(session_dir) / "logs" / LOG_NAME, "ab") as log:
                process = subprocess.Popen(
                    [sys.executable, "-I", __file__, str(os.getpid()), token],
                    stdin=read_fd, stdout=log, stderr=log, start_new_session=True)
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        return cls(process, write_fd)

    def dismiss(self) -> None:
        """Tell the reaper the cluster was stopped and wait for it to exit (at once: it stops nothing). Idempotent."""
        if self._write_fd is None:
            return
        write_fd, self._write_fd = self._write_fd, None
        try:
            os.write(write_fd, _DISMISS)
        except BrokenPipeError:  # it exited already
            pass
        finally:
            os.close(write_fd)
        self._process.wait()


# ---------------------------------------------------------------- the reaper process


def main(driver_pid: int, token: str) -> int:
    try:
        driver = os.pidfd_open(driver_pid)
    except ProcessLookupError:  # gone already
        driver = -1
    if driver >= 0 and os.getppid() == driver_pid:  # the pidfd is the driver's (not a reused pid's): wait for it or a dismissal
        poller = select.poll()
        poller.register(driver, select.POLLIN)
        poller.register(sys.stdin.fileno(), select.POLLIN)
        ready = {fd for fd, _ in poller.poll()}
        if sys.stdin.fileno() in ready and os.read(sys.stdin.fileno(), 1) == _DISMISS:
            return 0
    _say(f"driver {driver_pid} is gone without stopping its Ray cluster: stopping the processes marked {MARKER_VAR}={token}")
    rounds = 0
    while found := marked_processes(token):
        if rounds == ROUNDS:
            _say(f"giving up after {ROUNDS} rounds, marked processes keep starting: {_names(found)}")
            return 1
        rounds += 1
        _say(f"SIGTERM to {len(found)}: {_names(found)}")
        alive = _signal_and_wait(found, signal.SIGTERM, TERM_GRACE_S)
        if alive:
            _say(f"SIGKILL to {len(alive)} alive {TERM_GRACE_S:g} s later: {_names(alive)}")
            for pidfd, _ in _signal_and_wait(alive, signal.SIGKILL, TERM_GRACE_S).values():
                os.close(pidfd)
    _say("none left")
    return 0


def marked_processes(token: str) -> dict[int, tuple[int, str]]:
    """pid -> (pidfd, name) of every live process whose environment holds `MARKER_VAR=token`, this one excepted."""
    needle = f"{MARKER_VAR}={token}".encode()
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid() or not _marked(entry.path, needle):
            continue
        try:
            pidfd = os.pidfd_open(int(entry.name))
        except OSError:  # exited meanwhile
            continue
        if _marked(entry.path, needle):  # still the same process: the pidfd holds it
            found[int(entry.name)] = (pidfd, _name(entry.path))
        else:
            os.close(pidfd)
    return found


def _marked(proc_dir: str, needle: bytes) -> bool:
    try:  # a zombie's environment reads empty; another user's cannot be read
        return needle in Path(proc_dir, "environ").read_bytes().split(b"\0")
    except OSError:
        return False


def _name(proc_dir: str) -> str:
    try:
        return Path(proc_dir, "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")[:60]
    except OSError:
        return "?"


def _signal_and_wait(processes: dict[int, tuple[int, str]], signum: int, grace_s: float) -> dict[int, tuple[int, str]]:
    """Send `signum` to each process, wait until all have exited or `grace_s` passed; the ones alive (their pidfds still
    open) are returned, the others' pidfds closed."""
    poller = select.poll()
    by_fd = {}
    for pid, (pidfd, _) in processes.items():
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signum)
        poller.register(pidfd, select.POLLIN)
        by_fd[pidfd] = pid
    deadline = time.monotonic() + grace_s
    while by_fd and (left_ms := (deadline - time.monotonic()) * 1000) > 0:
        for pidfd, _ in poller.poll(left_ms):
            poller.unregister(pidfd)
            os.close(pidfd)
            del by_fd[pidfd]
    return {pid: processes[pid] for pid in by_fd.values()}


def _names(processes: dict[int, tuple[int, str]]) -> str:
    return ", ".join(f"{pid} ({name})" for pid, (_, name) in sorted(processes.items()))


def _say(line: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} asyncgrpo reaper {os.getpid()}: {line}", flush=True)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2]))
