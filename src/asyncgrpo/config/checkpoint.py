"""The checkpoint: section: how often the run is saved, how many checkpoints are kept, and what a run resumes from."""

from __future__ import annotations

from pydantic import Field

from asyncgrpo.config.section import Section


class CheckpointConfig(Section):
    """Checkpoints: how often one is saved, how many are kept, and what a run continues from."""

    every_steps: int = Field(50, ge=0, description="Save every N steps (0 = only the final checkpoint).")
    keep_last: int = Field(2, ge=1, description="Checkpoints kept; older ones are deleted once a newer one is complete.")
    resume: str = Field(
        "auto", min_length=1,
        description="auto: continue from the newest complete checkpoint of the run directory; never: refuse a used run directory; or the path of a "
        "checkpoint, continued even with run.overwrite=true (which then removes nothing, or only an earlier run's files when the checkpoint "
        "lies outside the run directory).",
    )

