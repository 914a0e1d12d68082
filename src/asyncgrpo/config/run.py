"""The run: section: the run's name, its directory, its seed and how it shuts down."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from asyncgrpo.config.section import Section


class RunConfig(Section):
    """The run's name and directory, its seed, and how long a clean shutdown may take."""

    name: str = Field("demo", min_length=1, description="Run name; the run directory defaults to runs/<name>.")
    output_dir: str | None = Field(None, description="Run directory (default runs/<run.name>).")
    seed: int = Field(0, ge=0, description="Seed for data order, sampling and initialisation.")
    shutdown_timeout_s: float = Field(30.0, gt=0, description="Bound on a clean shutdown after Ctrl-C, SIGTERM or a fatal error.")
    overwrite: bool = Field(
        False,
        description="Start over in a run directory that already holds an asyncgrpo run (only what asyncgrpo wrote is removed).",
    )

    @field_validator("name")
    @classmethod
    def _a_name_not_a_path(cls, name: str) -> str:
        if "/" in name or "\\" in name or name in (".", "..") or "\0" in name:
            raise ValueError(
                f"{name!r} is a path, not a name: the run directory is runs/<run.name>. Fix: give a plain name "
                f"(no '/', not '.' or '..'), or set run.output_dir to choose the directory itself"
            )
        return name

    @property
    def directory(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path("runs") / self.name

