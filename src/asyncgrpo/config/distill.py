"""The distill: section: `algorithm: distill`'s teacher and how it is queued, timed and trusted. The simulated
teacher of `asyncgrpo simulate` reads its latency and faults from the simulate: section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from asyncgrpo.config.section import Device, Section


class DistillConfig(Section):
    """`algorithm: distill`: on-policy distillation from a teacher that scores the student's sampled tokens (distill/)."""

    teacher: str = Field(
        "builtin:tiny", min_length=1,
        description="The teacher: builtin:tiny, a local Hugging Face model directory or a hub id (as model.path), with the student's tokenizer.",
    )
    teacher_seed: int | None = Field(
        None, ge=0, description="Seed the builtin:tiny teacher is built from (null: run.seed + 1, a different model than the student).",
    )
    batch_size: int = Field(32, ge=1, description="Most samples the teacher scores in one forward pass.")
    queue_size: int = Field(256, ge=1, description="Most samples waiting for the teacher; more wait to be queued.")
    timeout_s: float = Field(60.0, gt=0, description="Deadline for the teacher to score one sample, queueing included.")
    device: Device = Field("auto", description="Where the teacher runs: auto (train.device), cpu, cuda, cuda:N or mps.")
    on_error: Literal["fail", "drop"] = Field(
        "fail",
        description="fail: a teacher error is fatal (teacher_error); drop: the sample is dropped as reward_error (the failure policy counts it).",
    )
