"""What SIGINT and SIGTERM mean to a training run, even while its event loop is blocked.

- The first signal asks for a clean stop: `on_stop(signum)` is scheduled on the event loop
  (it cancels the pipeline; the step in progress finishes and a checkpoint is saved), and a
  timer thread ends the process after `shutdown_timeout_s` if the stop has not finished.
- The same signal again within `REPEAT_WINDOW_S` is the same request: `timeout` and service
  managers signal the process and then its process group, and the two copies arrive apart.
- Any signal after that window ends the process at once (exit 130 for SIGINT, 143 for SIGTERM).
- Every message names the signal received and says truthfully whether a checkpoint is on disk
  (`describe_checkpoint()` is asked at that moment).

Signals are received on a thread of their own, not on the event loop and not in the main thread:
`loop.add_signal_handler` runs its callback on the loop, and a Python signal handler runs in the
main thread, so either would wait for a reward function that blocks the loop (an `async def`
calling `time.sleep`). Instead the signals get a no-op Python handler and `signal.set_wakeup_fd`
points at a pipe: the interpreter's C-level handler writes each signal's number there, whichever
thread the kernel interrupted, and a daemon thread reading the pipe acts on it at once. The
shutdown timer is a thread too. (Code that holds the GIL without returning, such as a
catastrophic regex, stops every thread: sync reward functions run in processes for that reason.)
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

log = logging.getLogger("asyncgrpo")

EXIT_CODES: dict[int, int] = {signal.SIGINT: 130, signal.SIGTERM: 143}
REPEAT_WINDOW_S = 1.0


def _deliver_through_wakeup_fd(_signum: int, _frame: FrameType | None) -> None:
    """The Python-level handler does nothing: the signal's number already went to the wakeup fd."""


class StopSignals:
    """Installs the handlers for the duration of a run (see the module docstring); `received` lists the requests."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        shutdown_timeout_s: float,
        on_stop: Callable[[int], None],
        describe_checkpoint: Callable[[], str],
    ) -> None:
        self.loop = loop
        self.shutdown_timeout_s = shutdown_timeout_s
        self.on_stop = on_stop
        self.describe_checkpoint = describe_checkpoint
        self.received: list[int] = []
        self._first_at = 0.0
        self._timer: threading.Timer | None = None

    @contextmanager
    def installed(self) -> Iterator[StopSignals]:
        """Route SIGINT and SIGTERM to this object's reader thread; must be entered on the main thread."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the C-level handler must never block
        reader = threading.Thread(target=self._read, args=(read_fd,), name="asyncgrpo-signals", daemon=True)
        previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        previous = {signum: signal.signal(signum, _deliver_through_wakeup_fd) for signum in EXIT_CODES}
        reader.start()
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            signal.set_wakeup_fd(previous_fd)
            os.close(write_fd)  # the reader sees end of file and returns
            reader.join(timeout=5.0)
            if self._timer is not None:
                self._timer.cancel()

    def _read(self, read_fd: int) -> None:
        try:
            while data := os.read(read_fd, 64):
                for signum in data:
                    if signum in EXIT_CODES:
                        self._handle(signum)
        finally:
            os.close(read_fd)

    def _handle(self, signum: int) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.received:
            if signum == self.received[0] and now - self._first_at < REPEAT_WINDOW_S:
                return  # the same request delivered twice (to the process, then to its group)
            self.exit_now(signum, f"second signal ({name})")
            return
        self.received.append(signum)
        self._first_at = now
        again = "press Ctrl-C again" if signum == signal.SIGINT else f"send {name} again"
        log.warning(
            "received %s: stopping (cancelling in-flight rollouts, finishing the step in progress, saving a checkpoint) "
            "within run.shutdown_timeout_s = %gs; %s to exit at once",
            name, self.shutdown_timeout_s, again,
        )
        self._timer = threading.Timer(self.shutdown_timeout_s, self.exit_now, (signum, "the shutdown took longer than run.shutdown_timeout_s"))
        self._timer.daemon = True
        self._timer.start()
        try:
            self.loop.call_soon_threadsafe(self.on_stop, signum)
        except RuntimeError:  # the loop is already closed: the run is ending anyway
            pass

    def exit_now(self, signum: int, why: str) -> None:
        log.warning("%s: exiting at once. %s", why, self.describe_checkpoint())
        os._exit(EXIT_CODES[signum])
