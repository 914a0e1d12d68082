"""The run directory: whose it is, who is using it, and what a fresh start may remove.

Invariants:
- asyncgrpo only ever deletes or rewrites what it wrote. A run directory carries `MARKER`,
  written when asyncgrpo creates (or first takes an empty) directory; an existing non-empty
  directory without it is refused, whatever `run.overwrite` says. Starting over in a marked
  directory removes only the entries of `OWNED_ENTRIES`: anything else a user put there stays.
- One trainer per run directory: `claim` holds an exclusive `flock` on `LOCK_FILE` for the whole
  run. The kernel releases it when the holder exits, however it exits (SIGKILL included), so a
  stale lock never blocks; a second trainer is refused, naming the PID that holds the lock.
- Nothing here imports torch: `check_run_directory` runs in preflight.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from asyncgrpo.errors import ConfigError, RunDirectoryBusyError

MARKER = ".asyncgrpo-run"
LOCK_FILE = ".asyncgrpo.lock"
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
OUTCOMES_FILE = "outcomes.jsonl"
ERROR_FILE = "error.txt"
CHECKPOINTS_DIR = "checkpoints"
WEIGHTS_DIR = "weights"
TIMELINE_FILE = "timeline.jsonl"
PLOTS_DIR = "plots"
TRACKER_DIRS = ("tensorboard", "wandb", "mlruns")  # telemetry/sinks.py
OWNED_ENTRIES = (CONFIG_FILE, METRICS_FILE, SAMPLES_FILE, OUTCOMES_FILE, ERROR_FILE, CHECKPOINTS_DIR, WEIGHTS_DIR,
                 TIMELINE_FILE, PLOTS_DIR, *TRACKER_DIRS)
"""What a run writes besides the marker and the lock, and so what starting over removes."""


def check_run_directory(run_dir: Path) -> None:
    """Raise ConfigError unless `run_dir` may become (or already is) an asyncgrpo run directory."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run.output_dir = {str(run_dir)!r} is a file, not a directory. Fix: choose another run.output_dir.")
    if is_foreign(run_dir):
        entries = sorted(p.name for p in run_dir.iterdir())
        shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
        raise ConfigError(
            f"run directory {run_dir} already exists and holds files asyncgrpo did not write ({shown}); it has no "
            f"{MARKER} marker, so it is not an asyncgrpo run directory and asyncgrpo will neither write into it nor "
            f"delete anything in it (run.overwrite does not change that). Fix: choose a new or empty directory with "
            f"run.output_dir=..., or a new run.name=..."
        )


def is_foreign(run_dir: Path) -> bool:
    """True when `run_dir` is a non-empty directory that asyncgrpo did not create."""
    if not run_dir.is_dir() or (run_dir / MARKER).is_file():
        return False
    return any(entry.name != LOCK_FILE for entry in run_dir.iterdir())


@contextlib.contextmanager
def claim(run_dir: Path) -> Iterator[Path]:
    """Create or take `run_dir` for this process: check it, lock it, mark it. Yields the directory.

    Raises ConfigError for a foreign directory, RunDirectoryBusyError when another process holds
    the lock, and ConfigError naming the path when the directory cannot be created or written.
    """
    check_run_directory(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ConfigError(f"cannot create the run directory {run_dir}: {exc.strerror}. Fix: choose a writable run.output_dir.") from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            raise RunDirectoryBusyError(run_dir, _holder(fd)) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        marker = run_dir / MARKER
        if not marker.is_file():
            marker.write_text(json.dumps({"created_by": "asyncgrpo", "created_at": time.time()}) + "\n")
        yield run_dir
    finally:
        os.close(fd)  # releases the lock


def clear_run(run_dir: Path) -> list[str]:
    """Remove what an earlier run wrote in `run_dir` (which `claim` holds). Returns the removed names."""
    removed = []
    for name in OWNED_ENTRIES:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed


def _holder(fd: int) -> int | None:
    """The PID the lock's holder wrote into the lock file, if readable."""
    try:
        return int(os.pread(fd, 32, 0).decode().strip())
    except (OSError, ValueError):
        return None
