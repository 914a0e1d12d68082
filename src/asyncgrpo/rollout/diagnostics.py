"""The run's diagnostics that the collector raises: what failed, where, and what to do about it. Pure.

Each function builds the `Diagnostic` for one way the collector fails a run: a backend that
cannot serve it, a reward function that failed (with `reward.on_error: fail`), a broken rule
of the failure policy, and a stall. Versions and the trainer's step say where the run was.
"""

from __future__ import annotations

from asyncgrpo.config import Config
from asyncgrpo.errors import Diagnostic, FatalBackendError, RewardError, TeacherError
from asyncgrpo.rollout.failures import Verdict
from asyncgrpo.rollout.first_failure import format_traceback


def backend_fatal(error: FatalBackendError, backend: str, version: int | None, step: int) -> Diagnostic:
    return Diagnostic(
        kind=error.kind,
        message=f"The generation backend cannot serve this run: {error}. Retrying cannot fix this; "
        f"check the servers, the model name, the URLs and the credentials.",
        backend=error.backend or backend,
        generation_version=version,
        trainer_step=step,
        original=error,
        traceback=format_traceback(error),
    )


def reward_failed(error: RewardError, version: int | None, step: int) -> Diagnostic:
    return Diagnostic(
        kind="reward_error",
        message=f"A reward failed: {error} Or set reward.on_error: drop to drop such groups (counted as "
        f"reward_error) instead of stopping.",
        generation_version=version,
        trainer_step=step,
        original=error,
        traceback=format_traceback(error),
    )


def teacher_failed(error: TeacherError, version: int | None, step: int) -> Diagnostic:
    return Diagnostic(
        kind="teacher_error",
        message=f"The distillation teacher failed: {error}. Fix the cause, or set distill.on_error: drop to drop "
        f"such samples (counted as reward_error, under rollout.max_drop_fraction) instead of stopping.",
        generation_version=version,
        trainer_step=step,
        original=error,
        traceback=format_traceback(error),
    )


def scoring_failed(error: RewardError | TeacherError, cfg: Config, version: int | None, step: int) -> Diagnostic | None:
    """The run's diagnostic when scoring a group raised `error` and its `on_error` (`distill.on_error` for the teacher,
    `reward.on_error` for the reward functions) is `fail`; None when it is `drop` (the group is dropped)."""
    if isinstance(error, TeacherError):
        return teacher_failed(error, version, step) if cfg.distill.on_error == "fail" else None
    return reward_failed(error, version, step) if cfg.reward.on_error == "fail" else None


def policy_broken(verdict: Verdict, backend: str, version: int | None, step: int) -> Diagnostic:
    return Diagnostic(
        kind=verdict.kind,
        message=verdict.message,
        backend=backend,
        generation_version=version,
        trainer_step=step,
        count=verdict.count,
        threshold=verdict.threshold,
        original=verdict.original,
        traceback=format_traceback(verdict.original),
        details={
            "by_reason": verdict.by_reason,
            "examples": {reason: repr(e) for reason, e in verdict.examples.items()},
        },
    )


def stalled(
    step: int, stall_timeout_s: float, cfg: Config, *, buffered: int, in_flight: int, open_requests: int, scoring: int,
    scoring_state: str, exhausted: bool, backend: str, serving_version: int,
) -> Diagnostic:
    """Step `step` waited `stall_timeout_s` with no progress. The collector's counts at the stall: groups `buffered` and
    `in_flight`, requests open, groups being `scoring` and the scorer's `scoring_state` (algorithms/), and whether the source is
    `exhausted`; the bound's source is `Config.stall_bound`'s unless the caller set another."""
    bound, source = cfg.stall_bound()
    source = source if bound == stall_timeout_s else "as the caller set it"
    state = (f"{buffered} buffered, {in_flight} groups in flight with {open_requests} requests open and {scoring} being scored{scoring_state}, "
             f"source exhausted: {exhausted}")
    return Diagnostic(
        kind="stall",
        message=(
            f"The pipeline stalled: no rollout or episode turn finished and no step trained for {stall_timeout_s:g} s "
            f"(rollout.stall_timeout_s, {source}) while step {step} waited for {cfg.rollout.groups_per_step} groups. "
            f"State: {state}, serving version {serving_version}. Check that the generation backend answers."
        ),
        backend=backend,
        generation_version=serving_version,
        trainer_step=step,
        threshold=stall_timeout_s,
    )
