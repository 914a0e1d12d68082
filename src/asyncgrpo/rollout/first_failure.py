"""`FirstFailure`: the first fatal error of a run, kept as it was.

`fail()` records a diagnostic only if none is recorded yet (sticky: later errors, often
consequences of the first, never replace it). `check()` raises a *fresh* exception each
call, chained to the original error, so every caller gets its own traceback and the
original cause stays attached (NeMo-RL PR #2368 semantics).
"""

from __future__ import annotations

import traceback as traceback_module

from asyncgrpo.errors import Diagnostic, PipelineError, StallError


def format_traceback(exc: BaseException | None) -> str:
    if exc is None:
        return ""
    return "".join(traceback_module.format_exception(exc))


class FirstFailure:
    def __init__(self) -> None:
        self.diagnostic: Diagnostic | None = None

    @property
    def failed(self) -> bool:
        return self.diagnostic is not None

    def fail(self, diagnostic: Diagnostic) -> bool:
        """Record `diagnostic` if it is the first; return whether it was recorded."""
        if self.diagnostic is not None:
            return False
        self.diagnostic = diagnostic
        return True

    def check(self) -> None:
        """Raise a new PipelineError (StallError for a stall) carrying the first diagnostic, if any."""
        d = self.diagnostic
        if d is None:
            return
        error_type = StallError if d.kind == "stall" else PipelineError
        raise error_type(d) from d.original
