"""The fast tier's guard: a test in tests/unit or tests/sim starts no process, opens no network socket, imports no
Ray and takes no optimizer step, so `make test-fast` is what the README says it is.

The tiers, by folder: tests/unit (pure functions and in-process objects) and tests/sim (whole runs on virtual time)
are the fast tier; tests/component (one real child process, or a real torch training step; no network) and
tests/integration (servers, Ray, whole training runs, the CLI) are the rest of `make test`.

While a fast-tier test runs (its setup, call and teardown, fixtures included) the guard records:
- a process start: the interpreter's audit events `subprocess.Popen`, `os.fork`, `os.forkpty`, `os.posix_spawn`,
  `os.spawn`, `os.exec` and `os.system`, and calls of `_posixsubprocess.fork_exec`, which multiprocessing's spawn and
  forkserver start methods call directly, with no audit event (a Ray cluster is processes too);
- a network socket: the audit events `socket.bind` and `socket.connect` with an (host, port) address (a Unix
  socket's address is a path, and is not network);
- Ray: the audit event `import` for `ray` (raised the first time the process imports it);
- an optimizer step: torch's global optimizer step pre-hook.
Recording does not block the action (blocking could leave a pool waiting for a worker that never starts); the
test's teardown report is made a failure naming each thing it did and where such a test belongs.

Invariants: nothing is installed before the first fast-tier test, so a run of the other tiers alone pays nothing
(installing imports torch for its optimizer hook: about 2 s, once, where no test module imported it already);
what a thread that was already running when the run entered the fast tier does (a leftover of an earlier tier in
`make test`, or a thread started while the test modules were imported) is never blamed on a fast-tier test, while
every thread started during the fast tier is watched; the hooks cannot be removed (audit hooks are permanent), so
each checks one flag first and is cheap while no fast-tier test runs.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent
FAST_TIERS = ("unit", "sim")

PROCESS_EVENTS = frozenset({"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system"})
SOCKET_EVENTS = frozenset({"socket.bind", "socket.connect"})


def is_fast_tier(path: Path) -> bool:
    """Whether a test file is in the fast tier (under tests/unit or tests/sim)."""
    try:
        relative = path.resolve().relative_to(TESTS)
    except ValueError:
        return False
    return relative.parts[0] in FAST_TIERS


def _describe(args: tuple[Any, ...]) -> str:
    text = repr(args[0]) if len(args) == 1 else repr(args)
    return text if len(text) <= 160 else text[:157] + "..."


class FastTierGuard:
    """A pytest plugin: records what a fast-tier test must not do, and fails its teardown report if it did."""

    def __init__(self) -> None:
        self._watching = False
        self._installed = False
        self._in_fast_tier = False
        self._earlier_threads: set[threading.Thread] = set()
        self._seen: list[str] = []
        self._lock = threading.Lock()

    def _record(self, what: str) -> None:
        if threading.current_thread() in self._earlier_threads:
            return
        with self._lock:
            if what not in self._seen:
                self._seen.append(what)

    def _audit(self, event: str, args: tuple[Any, ...]) -> None:
        if not self._watching:
            return
        if event in PROCESS_EVENTS:
            self._record(f"started a process ({event}: {_describe(args[:2])})")
        elif event in SOCKET_EVENTS and len(args) > 1 and isinstance(args[1], tuple):
            self._record(f"opened a network socket ({event} to {args[1]!r})")
        elif event == "import" and args and (args[0] == "ray" or str(args[0]).startswith("ray.")):
            self._record("imported ray")

    def _install(self) -> None:
        """Installs the hooks, once, at the first fast-tier test."""
        import _posixsubprocess

        from torch.optim.optimizer import register_optimizer_step_pre_hook

        sys.addaudithook(self._audit)
        fork_exec = _posixsubprocess.fork_exec

        def watched_fork_exec(*args: Any, **kwargs: Any) -> Any:
            if self._watching:
                self._record("started a process (_posixsubprocess.fork_exec: a multiprocessing or subprocess child)")
            return fork_exec(*args, **kwargs)

        _posixsubprocess.fork_exec = watched_fork_exec

        def optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            if self._watching:
                self._record(f"took an optimizer step ({type(optimizer).__name__}.step)")

        register_optimizer_step_pre_hook(optimizer_step)
        self._installed = True

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        if not is_fast_tier(item.path):
            self._in_fast_tier = False
            return
        if not self._installed:
            self._install()
        if not self._in_fast_tier:  # entering the fast tier: what runs already is another tier's (or collection's)
            self._earlier_threads |= {t for t in threading.enumerate() if t is not threading.main_thread()}
        self._in_fast_tier = True
        with self._lock:
            self._seen = []
        self._watching = True

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        report = yield
        if call.when != "teardown" or not self._watching:
            return report
        self._watching = False
        with self._lock:
            seen, self._seen = self._seen, []
        if seen:
            report.outcome = "failed"
            report.longrepr = (
                f"{item.nodeid} is in the fast tier ({', '.join(f'tests/{t}/' for t in FAST_TIERS)}: "
                "`make test-fast`), which starts no process, opens no network socket, imports no Ray and takes no "
                "optimizer step; this test " + "; ".join(seen) + ". Move it to tests/component/ (one real child "
                "process or a real torch step, no network) or tests/integration/ (servers, Ray, whole runs), "
                "with `git mv` (see tests/tier_guard.py).")
        return report
