"""The eval: section: held-out evaluation, how often and on what."""

from __future__ import annotations

from pydantic import Field

from asyncgrpo.config.section import Section


class EvalConfig(Section):
    """Held-out evaluation: how often, on which prompts, with how many samples each."""

    every_steps: int = Field(
        0, ge=0, description="Evaluate every N steps (0 = never); with an env: section each sample is an episode, played as in training.",
    )
    source: str | None = Field(
        None,
        description="Held-out prompts (same forms as data.source); default: the builtin task's eval split, or the last eval.num_prompts rows of the"
        " data.",
    )
    num_prompts: int = Field(64, ge=1, description="Prompts per evaluation.")
    samples_per_prompt: int = Field(1, ge=1, description="k of pass@k.")
    temperature: float = Field(0.0, ge=0, description="0 = greedy.")
    success_threshold: float = Field(1.0, description="A sample passes when its reward reaches this.")

