"""Running one training from Python: stop requests from any thread, signals for the run's length, one paragraph per error.

`run_training(prepared, control)` is what `asyncgrpo train` and `asyncgrpo.Trainer.train` both call.

- The run's Python objects (``python:`` names, objects.py) are registered for exactly its length.
- On the main thread, SIGINT and SIGTERM are routed to the run for its length (signals.py: the
  step in progress finishes, a checkpoint is saved; a second signal or an overlong stop ends the
  process, as the CLI's), and the previous handlers are restored afterwards. Off the main thread
  no handler is installed; `RunControl.request` stops the run.
- Inside a running event loop (a notebook), the run gets its own loop on a thread of its own;
  a KeyboardInterrupt of the waiting thread (the notebook's interrupt) becomes a stop request.
- `RunControl.request` may be called from any thread, before or during the run (a request that
  comes before the loop exists is delivered when it does). The first request names how the run
  was stopped (`stopped_by`: ``SIGINT``, ``SIGTERM`` or ``stop()``).
- asyncgrpo's own errors propagate unchanged; any other exception becomes one `AsyncGRPOError`
  paragraph, the traceback in the run directory's error.txt. Nothing here calls sys.exit.
- When nothing in the process configured logging, the ``asyncgrpo`` logger gets a stderr handler
  (INFO) for the run's length, removed afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from asyncgrpo.api_config import Prepared
from asyncgrpo.commands.run_files import describe_last_checkpoint
from asyncgrpo.commands.signals import StopSignals
from asyncgrpo.commands.train import Stop, train
from asyncgrpo.commands.train_summary import RunSummary
from asyncgrpo.config import Config
from asyncgrpo.errors import AsyncGRPOError
from asyncgrpo.objects import registered
from asyncgrpo.rundir import ERROR_FILE, is_foreign

log = logging.getLogger("asyncgrpo")

STOP_CALL = "stop()"


class RunControl:
    """Thread-safe stop requests for one run; `stopped_by` says what stopped it (None: nothing did)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: Stop | None = None
        self.stopped_by: str | None = None

    def request(self, label: str = STOP_CALL) -> None:
        """Ask the run to stop as Ctrl-C does (the step in progress finishes, a checkpoint is saved); from any thread."""
        with self._lock:
            if self.stopped_by is not None:
                return  # asked already: the one request is under way
            self.stopped_by = label
            loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            try:
                loop.call_soon_threadsafe(stop.request, signal.SIGINT)
            except RuntimeError:  # the loop closed: the run has ended anyway
                pass

    def signalled(self, signum: int) -> None:
        """A signal's stop (signals.py calls it on the loop)."""
        with self._lock:
            if self.stopped_by is None:
                self.stopped_by = signal.Signals(signum).name
            stop = self._stop
        if stop is not None:
            stop.request(signum)

    @contextmanager
    def attached(self, loop: asyncio.AbstractEventLoop, stop: Stop) -> Iterator[None]:
        with self._lock:
            self._loop, self._stop = loop, stop
            pending = self.stopped_by is not None
        if pending:  # asked before the loop existed
            stop.request(signal.SIGINT)
        try:
            yield
        finally:
            with self._lock:
                self._loop = self._stop = None


def run_training(prepared: Prepared, control: RunControl | None = None) -> RunSummary:
    """Run `prepared`'s training to its end (see the module docstring); the summary, whatever the outcome."""
    control = control if control is not None else RunControl()
    cfg = prepared.config
    with registered(prepared.objects), console_logging():
        try:
            summary = _run_somewhere(cfg, control)
        except AsyncGRPOError:
            raise
        except Exception as exc:  # noqa: BLE001 - every run ends in a paragraph, never a raw traceback
            raise AsyncGRPOError(_unexpected_error(cfg.run.directory, exc)) from exc
    if summary.interrupted_by is not None:
        summary.stopped_by = control.stopped_by  # "stop()" is no signal: the summary names who asked
    return summary


def _run_somewhere(cfg: Config, control: RunControl) -> RunSummary:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_train(cfg, control, signals=threading.current_thread() is threading.main_thread()))
    return _run_on_own_thread(cfg, control)


def _run_on_own_thread(cfg: Config, control: RunControl) -> RunSummary:
    """This thread runs an event loop (a notebook): the run gets its own loop on a thread, and this one waits for it."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["summary"] = asyncio.run(_train(cfg, control, signals=False))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, which raises it
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="asyncgrpo-run")
    thread.start()
    try:
        thread.join()  # as long as the run takes: its own stall and shutdown bounds end it
    except KeyboardInterrupt:
        control.request(signal.Signals.SIGINT.name)
        thread.join()  # the stop is bounded by run.shutdown_timeout_s of the run's own stages
    if "error" in outcome:
        raise outcome["error"]
    summary: RunSummary = outcome["summary"]
    return summary


async def _train(cfg: Config, control: RunControl, *, signals: bool) -> RunSummary:
    loop = asyncio.get_running_loop()
    stop = Stop()
    with control.attached(loop, stop):
        if not signals:
            return await train(cfg, stop=stop)
        handlers = StopSignals(
            loop,
            shutdown_timeout_s=cfg.run.shutdown_timeout_s,
            on_stop=control.signalled,
            describe_checkpoint=lambda: describe_last_checkpoint(cfg.run.directory),
        )
        with handlers.installed():
            return await train(cfg, stop=stop)


@contextmanager
def console_logging() -> Iterator[None]:
    """A stderr handler on the ``asyncgrpo`` logger for the block, unless logging is configured already."""
    logger = logging.getLogger("asyncgrpo")
    if logger.handlers or logging.getLogger().handlers:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _unexpected_error(run_dir: Path, exc: BaseException) -> str:
    where = "run the same command with --debug to see the traceback, and please report it with that"
    report = "".join(traceback.format_exception(exc))
    if run_dir.is_dir() and not is_foreign(run_dir):
        try:
            (run_dir / ERROR_FILE).write_text(report)
            where = f"the traceback is in {run_dir / ERROR_FILE}; please report it with that file"
        except OSError:
            pass  # error.txt is a courtesy: the paragraph still says how to see the traceback
    return (
        f"the run stopped on an unexpected {type(exc).__name__}: {exc}. This is not a recipe mistake asyncgrpo knows "
        f"how to name; {where}. {describe_last_checkpoint(run_dir)}"
    )
