"""The exception hierarchy.

Every error a user can see derives from `AsyncGRPOError`; its message says what happened,
the value against its limit, and what to try.

Generation errors are classified by type, and the class alone decides the policy
(DESIGN.md §3 "Error classes"):

- `TransientGenerationError` (refused, reset, timeout, 429, 5xx): retried with bounded,
  jittered backoff under the rollout deadline.
- `PromptRejectedError` (prompt too long, 413): the rollout fails at once; a group whose
  members all fail this way is dropped as `invalid_prompt`.
- `FatalBackendError`: fatal for the run at once: `MisconfiguredBackendError` (401/403/404/422)
  and `BackendDeadError` (no healthy server for `generation.backend_dead_after_s`).
- Any other exception raised by a backend: not retried; the rollout fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class AsyncGRPOError(Exception):
    """Root of every asyncgrpo error."""


class ConfigError(AsyncGRPOError):
    """A recipe, override or referenced file is wrong. Raised before any model loads."""


class RunDirectoryBusyError(ConfigError):
    """Another process holds the run directory's lock (exit 3, like a config error: nothing was started)."""

    def __init__(self, run_dir: Any, pid: int | None) -> None:
        holder = f"process {pid}" if pid is not None else "another process"
        super().__init__(
            f"run directory {run_dir} is in use by {holder}, which holds its lock: two trainers on one run directory "
            f"would overwrite each other's checkpoints and records. Fix: wait for that run to end (or stop it), or "
            f"train into another directory with run.name=... or run.output_dir=..."
        )
        self.pid = pid


class DiskError(AsyncGRPOError):
    """A file of the run could not be written (disk full, unwritable, read-only): names the path, the free space and the fix."""


class TrainerRankError(AsyncGRPOError):
    """A rank of the data-parallel trainer died, failed or did not answer in time: every rank was stopped, and no
    checkpoint can be written after it (the run resumes from its newest one)."""


class GenerationError(AsyncGRPOError):
    """A generator could not produce a completion. `backend` names the generator."""

    def __init__(self, message: str, *, backend: str = "") -> None:
        super().__init__(message)
        self.backend = backend


class EpisodeError(AsyncGRPOError):
    """An environment's reset, step or close raised: the episode's rollout fails. `backend` names the environment."""

    def __init__(self, message: str, *, backend: str = "", transient: bool = False) -> None:
        super().__init__(message)
        self.backend = backend
        self.transient = transient


class TransientGenerationError(GenerationError):
    """Worth retrying: the backend may answer next time (refused, reset, timeout, 429, 5xx)."""


class RequestTimeoutError(TransientGenerationError):
    """One attempt exceeded `generation.request_timeout_s`."""


class RolloutDeadlineError(TransientGenerationError):
    """A request's transient errors outlasted `generation.rollout_deadline_s`: it is not retried again."""


class PromptRejectedError(GenerationError):
    """The backend rejected this prompt (too long, 413). Retrying cannot help; the backend works."""


class FatalBackendError(GenerationError):
    """Retrying or dropping cannot help: the run fails at once with diagnostic kind `kind`."""

    kind = "backend_error"


class MisconfiguredBackendError(FatalBackendError):
    """The backend refuses every request as configured (401/403/404/422). Fatal at once."""

    kind = "misconfigured_backend"


class BackendDeadError(FatalBackendError):
    """No server was healthy for `generation.backend_dead_after_s`; the message names each server and its last error."""

    kind = "backend_dead"


class RewardError(AsyncGRPOError):
    """A reward function raised, timed out, or returned something that is not one score per completion."""


class TeacherError(AsyncGRPOError):
    """The distillation teacher could not score a sample (`algorithm: distill`): its forward pass raised, the
    sample does not fit the teacher, or the teacher worker stopped. `distill.on_error` decides: fatal or dropped."""


class TeacherTimeoutError(TeacherError):
    """The teacher did not score a sample within `distill.timeout_s` (queueing included)."""


FatalKind = str  # one of DIAGNOSTIC_KINDS

DIAGNOSTIC_KINDS = (
    "generation_failures",
    "drop_fraction",
    "filtered_fraction",
    "backend_dead",
    "misconfigured_backend",
    "reward_error",
    "teacher_error",
    "stall",
    "no_steps",
    "step_error",
    "weight_sync",
    "backend_error",
    "disk",
    "tracker",
    "eval",
    "internal",
    "step_report",
)


@dataclass(frozen=True)
class Diagnostic:
    """The first fatal error of a run, kept as it was (sticky). Fields follow DESIGN.md §3 "Diagnostic"."""

    kind: FatalKind
    message: str
    backend: str = ""
    generation_version: int | None = None
    trainer_step: int | None = None
    count: int | None = None
    threshold: float | None = None
    original: BaseException | None = field(default=None, compare=False)
    traceback: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "message": self.message,
            "backend": self.backend,
            "generation_version": self.generation_version,
            "trainer_step": self.trainer_step,
            "count": self.count,
            "threshold": self.threshold,
            "exception": None if self.original is None else repr(self.original),
            "traceback": self.traceback,
            "details": self.details,
        }

    def render(self) -> str:
        """A paragraph for a person: what failed, the count against its limit, and the cause."""
        parts = [self.message]
        facts = []
        if self.backend:
            facts.append(f"backend={self.backend}")
        if self.generation_version is not None:
            facts.append(f"generation_version={self.generation_version}")
        if self.trainer_step is not None:
            facts.append(f"trainer_step={self.trainer_step}")
        if self.count is not None:
            facts.append(f"count={self.count}")
        if self.threshold is not None:
            facts.append(f"threshold={self.threshold:g}")
        if facts:
            parts.append("(" + ", ".join(facts) + ")")
        if self.original is not None:
            parts.append(f"First error: {self.original!r}")
        return " ".join(parts)


class PipelineError(AsyncGRPOError):
    """The rollout pipeline failed; `diagnostic` holds the first fatal error, unchanged.

    `Collector.raise_if_failed()` raises a fresh instance on every call, chained to the original error.
    """

    def __init__(self, diagnostic: Diagnostic) -> None:
        super().__init__(diagnostic.render())
        self.diagnostic = diagnostic

    @classmethod
    def caused_by(cls, diagnostic: Diagnostic, cause: BaseException) -> PipelineError:
        """The error for `diagnostic`, chained to `cause` (for an error returned rather than raised)."""
        error = cls(diagnostic)
        error.__cause__ = cause
        return error


class StallError(PipelineError):
    """No rollout (or episode turn) finished and no step trained for `rollout.stall_timeout_s`; names what was awaited."""
