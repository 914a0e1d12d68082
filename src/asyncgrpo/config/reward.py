"""The reward: section: the reward functions, their weights and where and how long they run."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from asyncgrpo.config.section import Section


class RewardConfig(Section):
    """The reward functions of `algorithm: grpo`, their weights, and where and how long each call may run."""

    functions: list[str] = Field(
        default_factory=lambda: ["builtin:repeat_letter"],
        description="builtin:<name> or module:function, each reward(prompts, completions, **columns) -> list[float | None]. May be empty "
        "([]) when an environment (env:) gives the reward.",
    )
    weights: list[float] | None = Field(None, description="One weight per function (default 1.0 each).")
    timeout_s: float = Field(30.0, gt=0, description="Deadline for one reward call on one group.")
    on_error: Literal["fail", "drop"] = Field("fail", description="fail: a reward exception is fatal; drop: the group is dropped as reward_error.")
    isolation: Literal["thread", "process"] = Field(
        "process",
        description="Where sync functions run: thread (reused daemon threads; one whose call timed out is written off) or process (worker "
        "processes, killed and replaced on timeout; needs functions importable by name).",
    )
    workers: int = Field(
        4, ge=1,
        description="Worker processes (isolation: process) or threads (thread), i.e. sync reward calls at once; more wait for a free worker.",
    )

