"""`LoopWatchdog`: reports an event loop that has stopped turning, and what its thread is doing.

A coroutine that blocks (an ``async def`` reward calling ``time.sleep``, a sync call in C code
that holds the GIL) stops every task, timeout and signal handler on the loop, silently. The
watchdog makes that visible:

    with LoopWatchdog(loop, threshold_s=5.0, on_blocked=None):
        ...  # the loop runs here

The loop heartbeats through a `call_later` chain (every `threshold_s / 4`). A daemon thread
waits on a `threading.Event` with a timeout that ends exactly when the loop would have been
silent for the next reporting threshold; if the heartbeat has not moved by then, it reports
one `BlockedLoop`: for how long, and the innermost frames of the loop's thread
(``file:line function``), via `on_blocked` (called on the watchdog thread), or by default as one
warning on the "asyncgrpo" logger.

Invariants:
- One report when a block passes `threshold_s`, then again only while the same block lasts
  twice as long as at the previous report (doubling); a turn of the loop starts afresh.
- Nothing runs on the loop but the heartbeat; the thread never polls the loop's state faster
  than the heartbeat could change it, and every wait is bounded.
- Leaving the block cancels the heartbeat and stops and joins the thread (bounded).
- Enter it on the loop's thread: that thread is the one whose frames are reported.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

log = logging.getLogger("asyncgrpo")

FRAMES_SHOWN = 6
JOIN_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class BlockedLoop:
    """One report: the loop has not turned for `blocked_s`; `frames` (innermost first) of its thread."""

    blocked_s: float
    threshold_s: float
    frames: tuple[str, ...]  # "file:line function"

    @property
    def message(self) -> str:
        where = " <- ".join(self.frames) if self.frames else "(no frames: the thread is not running Python code)"
        return (
            f"the event loop has not turned for {self.blocked_s:.1f} s (watchdog threshold {self.threshold_s:g} s): "
            f"nothing else on it runs meanwhile (rollouts, timeouts, signal handlers). Its thread is in {where}. "
            f"Fix: do not block in async code; run blocking work in a thread or process (reward.isolation: process)."
        )


class LoopWatchdog:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        threshold_s: float,
        on_blocked: Callable[[BlockedLoop], None] | None = None,
    ) -> None:
        if not threshold_s > 0:
            raise ValueError(f"threshold_s must be positive, got {threshold_s}")
        self.loop = loop
        self.threshold_s = threshold_s
        self.on_blocked = on_blocked if on_blocked is not None else _log_warning
        self._last_beat = time.monotonic()  # written by the loop, read by the thread (a float: atomic)
        self._stop = threading.Event()
        self._handle: asyncio.TimerHandle | None = None
        self._thread: threading.Thread | None = None
        self._loop_thread_id = 0

    def __enter__(self) -> LoopWatchdog:
        self._loop_thread_id = threading.get_ident()
        self._beat()
        self._thread = threading.Thread(target=self._watch, name="asyncgrpo-loop-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._handle is not None:
            self._handle.cancel()
        if self._thread is not None:
            self._thread.join(JOIN_TIMEOUT_S)

    def _beat(self) -> None:
        self._last_beat = time.monotonic()
        if not self._stop.is_set():
            self._handle = self.loop.call_later(self.threshold_s / 4, self._beat)

    def _watch(self) -> None:
        beat = self._last_beat
        report_at = self.threshold_s  # silence, in seconds, that triggers the next report of this block
        while not self._stop.wait(max(0.0, beat + report_at - time.monotonic())):
            if self._last_beat != beat:  # the loop turned: a new block, if any, starts from its beat
                beat, report_at = self._last_beat, self.threshold_s
                continue
            blocked_s = time.monotonic() - beat
            if blocked_s < report_at:
                continue
            self.on_blocked(BlockedLoop(blocked_s, self.threshold_s, self._frames()))
            report_at = 2 * blocked_s

    def _frames(self) -> tuple[str, ...]:
        frame = sys._current_frames().get(self._loop_thread_id)
        if frame is None:
            return ()
        stack = traceback.extract_stack(frame)[::-1][:FRAMES_SHOWN]
        return tuple(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in stack)


def _log_warning(report: BlockedLoop) -> None:
    log.warning("warning: %s", report.message)
