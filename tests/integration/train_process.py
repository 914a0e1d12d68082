"""`asyncgrpo train` as a real process, for the signal, crash and resume tests.

The tests follow the run through its stderr lines (progress lines start with "step "), so
they act at a known point without sleeping.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def start_train(run_dir: Path, *overrides: str, env: dict[str, str] | None = None, new_session: bool = False) -> subprocess.Popen[str]:
    """Start `asyncgrpo train recipes/demo.yaml` into `run_dir` with `overrides`; stderr is piped, as text. With
    `new_session` it leads a process group of its own (as a shell's foreground job: `os.killpg` is a terminal's Ctrl-C)."""
    return subprocess.Popen(
        [sys.executable, "-m", "asyncgrpo.commands.cli", "train", "recipes/demo.yaml", "logging.progress=false",
         f"run.output_dir={run_dir}", *overrides],
        cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env={**os.environ, **(env or {})},
        start_new_session=new_session,
    )


def read_until(proc: subprocess.Popen[str], prefix: str) -> bool:
    """Consume stderr up to the first line starting with `prefix`; False if the process ended first."""
    assert proc.stderr is not None
    return any(line.startswith(prefix) for line in proc.stderr)


def records(run_dir: Path, name: str) -> list[dict]:
    """The JSON lines of one of the run's files (metrics.jsonl, outcomes.jsonl, ...)."""
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]
