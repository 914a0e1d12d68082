"""The run directory: whose it is, who is using it, and what a fresh start may remove.

Invariants:
- asyncgrpo only ever deletes or rewrites what it wrote. A run directory carries `MARKER`,
  written when asyncgrpo creates (or first takes an empty) directory; an existing non-empty
  directory without it is refused, whatever `run.overwrite` says. Starting over in a marked
  directory removes only what asyncgrpo wrote, entry by entry: the files of `OWNED_FILES`, and
  inside the directories of `OWNED_DIRS` the entries named as asyncgrpo (or the tracker it
  drives) names them. Anything else a user put there, at the top or inside those directories,
  stays, and `clear_run` names it.
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
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from asyncgrpo.atomic import is_temporary
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
TRACKER_RUNS_FILE = "trackers.json"  # telemetry/sinks.py: the tracker runs a resume continues
MLFLOW_STORE = "mlflow.db"  # telemetry/sinks.py: MLflow's tracking store (sqlite), unless MLFLOW_TRACKING_URI is set
MLFLOW_ARTIFACTS_DIR = "mlartifacts"  # ... and its artifact root, a folder per experiment id
TRACKIO_STORE_DIR = "trackio"  # telemetry/sinks.py: trackio's store (TRACKIO_DIR), unless TRACKIO_DIR is set
PLOTS_DIR = "plots"
TUNED_FILE = "tuned.yaml"  # commands/tune.py: the calibrated simulator recipe
TUNE_PLOT_FILE = "tune.png"  # commands/tune.py --plot: the swept configs' frontier
PLOT_FILES = ("rewards.png", "loss_kl.png", "staleness.png", "counters.png", "offpolicy.png", "env.png", "distill.png",  # commands/plot.py
              "timeline.png", "timeline_start.png")
OWNED_FILES = (CONFIG_FILE, METRICS_FILE, SAMPLES_FILE, OUTCOMES_FILE, ERROR_FILE, TIMELINE_FILE, TRACKER_RUNS_FILE, TUNED_FILE, TUNE_PLOT_FILE,
               MLFLOW_STORE, f"{MLFLOW_STORE}-journal")  # sqlite's rollback journal, left by a run killed mid-write
OWNED_DIRS: dict[str, re.Pattern[str]] = {
    # directory: the names of what asyncgrpo writes in it (whole-name matches), besides atomic.py's temporaries
    CHECKPOINTS_DIR: re.compile(r"step_\d{6,}"),  # training/checkpoint.py
    WEIGHTS_DIR: re.compile(r"v\d{6,}"),  # generation/weight_sync.py
    PLOTS_DIR: re.compile("|".join(map(re.escape, PLOT_FILES))),
    # telemetry/sinks.py's trackers: torch's SummaryWriter, wandb.init(dir=run_dir), MLflow's artifact root,
    # trackio's store (a project's database, its sqlite side files and lock; media, artifacts, traces, inbox)
    "tensorboard": re.compile(r"events\.out\.tfevents\..+"),
    "wandb": re.compile(r"(offline-)?run-\d{8}_\d{6}-\w+|latest-run|debug(-internal)?\.log"),
    MLFLOW_ARTIFACTS_DIR: re.compile(r"\d+"),
    TRACKIO_STORE_DIR: re.compile(r"[\w-]+\.(db|db-wal|db-shm|db-journal|lock)|media|artifacts|traces|inbox"),
    "mlruns": re.compile(r"\d+|\.trash|models"),  # MLflow's file store, where runs before the sqlite store logged
}
OWNED_ENTRIES = (*OWNED_FILES, *OWNED_DIRS)
"""What a run writes besides the marker and the lock, and so where starting over removes what it wrote."""


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


@dataclass
class Cleared:
    """What `clear_run` did: the entries it removed and those it kept, as paths relative to the run directory."""

    removed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


def clear_run(run_dir: Path) -> Cleared:
    """Remove what an earlier run wrote in `run_dir` (which `claim` holds), entry by entry (see the module docstring).

    A directory of `OWNED_DIRS` left empty is removed too (a symbolic link to one stays, emptied of what asyncgrpo
    wrote); an entry asyncgrpo would not have written, such as a directory where it writes a file, is kept."""
    cleared = Cleared()
    for name in OWNED_FILES:
        path = run_dir / name
        if path.is_symlink() or path.is_file():
            path.unlink()
            cleared.removed.append(name)
        elif path.exists():
            cleared.kept.append(name)
    for name, written in OWNED_DIRS.items():
        folder = run_dir / name
        if not folder.is_dir():
            if folder.exists() or folder.is_symlink():
                cleared.kept.append(name)
            continue
        for entry in sorted(folder.iterdir()):
            relative = f"{name}/{entry.name}"
            if not (is_temporary(entry.name) or written.fullmatch(entry.name)):
                cleared.kept.append(relative)
            elif entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
                cleared.removed.append(relative)
            else:
                entry.unlink()
                cleared.removed.append(relative)
        if not folder.is_symlink() and not any(folder.iterdir()):
            folder.rmdir()
    return cleared


def _holder(fd: int) -> int | None:
    """The PID the lock's holder wrote into the lock file, if readable."""
    try:
        return int(os.pread(fd, 32, 0).decode().strip())
    except (OSError, ValueError):
        return None
