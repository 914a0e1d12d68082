"""A real `asyncgrpo train` process stopped by SIGTERM / SIGINT: bounded, clean exit code, checkpoint saved."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_mid_run_stops_within_the_shutdown_bound_and_saves_a_checkpoint(tmp_path, signum, code):
    with subprocess.Popen(
        [sys.executable, "-m", "asyncgrpo.cli", "train", "recipes/demo.yaml", f"run.output_dir={tmp_path}",
         "logging.progress=false", "train.max_steps=40", "eval.every_steps=0", "checkpoint.every_steps=0",
         "run.shutdown_timeout_s=60"],
        cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    ) as proc:
        assert proc.stderr is not None
        # Progress lines come every 4 steps; the first one means training is under way with work in flight.
        for line in proc.stderr:
            if line.startswith("step "):
                break
        else:
            pytest.fail(f"the run ended before training started (exit {proc.wait()})")
        signalled = time.monotonic()
        proc.send_signal(signum)
        rest = proc.stderr.read()
        assert proc.wait(timeout=120) == code, rest
    assert time.monotonic() - signalled < 60  # run.shutdown_timeout_s
    assert f"interrupted by {signal.Signals(signum).name}" in rest
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(len(steps))) and 4 <= len(steps) < 40
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert checkpoints and int(checkpoints[-1].split("_")[1]) == len(steps)  # weights, metrics and checkpoint agree
    assert "Traceback" not in rest


@pytest.mark.timeout(300)
def test_a_second_ctrl_c_exits_at_once_and_leaves_every_checkpoint_complete(tmp_path):
    from asyncgrpo.training.resume import checkpoint_problem

    with subprocess.Popen(
        [sys.executable, "-m", "asyncgrpo.cli", "train", "recipes/demo.yaml", f"run.output_dir={tmp_path}",
         "logging.progress=false", "train.max_steps=40", "eval.every_steps=0", "checkpoint.every_steps=1"],
        cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    ) as proc:
        assert proc.stderr is not None
        for line in proc.stderr:
            if line.startswith("step "):
                break
        proc.send_signal(signal.SIGINT)
        for line in proc.stderr:
            if line.startswith("received SIGINT"):
                break
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        assert proc.wait(timeout=60) == 130, rest
    assert "second SIGINT: exiting at once" in rest
    checkpoints = [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step_")]
    assert checkpoints and all(checkpoint_problem(p) is None for p in checkpoints)
