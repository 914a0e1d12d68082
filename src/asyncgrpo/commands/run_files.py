"""The files a run writes into its directory, and what a failed write becomes.

- `open_record`: one of the append-only records (metrics.jsonl, samples.jsonl, outcomes.jsonl),
  cut back to the offset a checkpoint recorded; a file shorter than that offset is damaged and
  is refused by name (or, for samples, continued with a warning), never padded.
- `disk_problem` / `disk_diagnostic`: a write the disk refused (full, unwritable, read-only) as
  one paragraph naming the path, the free space there and the fix.
- `describe_last_checkpoint`: one true sentence about the newest complete checkpoint on disk.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from asyncgrpo.errors import ConfigError, Diagnostic, DiskError
from asyncgrpo.telemetry.metrics import JsonlFile
from asyncgrpo.training.checkpoint import latest_checkpoint


def describe_last_checkpoint(run_dir: Path) -> str:
    """One true sentence about the newest complete checkpoint on disk."""
    latest = latest_checkpoint(run_dir) if run_dir.is_dir() else None
    if latest is None:
        return "No checkpoint of this run is on disk yet."
    return f"The newest checkpoint on disk, {latest}, is complete (checkpoints are written atomically)."


def open_record(path: Path, offsets: dict[str, int], warnings: list[str] | None = None) -> JsonlFile:
    """Open one of the run's append-only records, cut back to the checkpoint's offset when resuming.

    A file shorter than its offset was damaged: with `warnings` (samples, kept for reading only)
    it is continued as it is and a warning says so; otherwise the run is refused by name. A
    file restored from the checkpoint's copy is exactly as long as its offset."""
    offset = offsets.get(path.name)
    try:
        size = path.stat().st_size if path.exists() else 0
        if offset is not None and size < offset:
            if warnings is None:
                raise ConfigError(
                    f"{path} has {size} bytes, fewer than the {offset} its checkpoint recorded: it was truncated or "
                    f"replaced, and the checkpoint holds no copy of it to restore. Fix: restore the file from a copy, "
                    f"or start over with run.overwrite=true."
                )
            warnings.append(f"{path} has {size} bytes, fewer than the {offset} its checkpoint recorded: earlier entries are lost")
            offset = size
        return JsonlFile(path, offset)
    except OSError as exc:
        raise DiskError(disk_problem(path, exc)) from exc


def write_or_disk_error(path: Path, text: str) -> None:
    """Write `text` to `path`; a refused write is a DiskError naming the path and the free space."""
    try:
        path.write_text(text)
    except OSError as exc:
        raise DiskError(disk_problem(path, exc)) from exc


def disk_problem(path: Path, exc: OSError) -> str:
    """One paragraph: what could not be written, why, the free space there, and the fix."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        free = f"{shutil.disk_usage(existing).free / 2**20:,.0f} MiB free there"
    except OSError:
        free = "free space unknown"
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    fix = "free some disk space" if full else f"make {existing} writable"
    return (
        f"cannot write {path}: {exc.strerror or exc} ({free}). Fix: {fix}, or choose another run.output_dir, then run "
        f"the same command again: it continues from the newest complete checkpoint."
    )


def disk_diagnostic(exc: OSError, run_dir: Path, path: Path, step: int) -> Diagnostic:
    """The run's diagnostic for a failed write of `path` (or the file the error names) after `step` steps."""
    target = Path(exc.filename) if exc.filename else path
    return Diagnostic(
        kind="disk",
        message=f"After step {step}, {disk_problem(target, exc)} {describe_last_checkpoint(run_dir)}",
        trainer_step=step,
        original=exc,
    )
