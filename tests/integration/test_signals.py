"""A real `asyncgrpo train` process stopped by SIGTERM / SIGINT: bounded, clean exit code, checkpoint saved."""

from __future__ import annotations

import signal
import time

import pytest

from tests.integration.train_process import read_until, records, start_train


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_mid_run_stops_within_the_shutdown_bound_and_saves_a_checkpoint(tmp_path, signum, code):
    with start_train(tmp_path, "train.max_steps=40", "eval.every_steps=0", "checkpoint.every_steps=0", "run.shutdown_timeout_s=60") as proc:
        # Progress lines come every 4 steps; the first one means training is under way with work in flight.
        if not read_until(proc, "step "):
            pytest.fail(f"the run ended before training started (exit {proc.wait()})")
        signalled = time.monotonic()
        proc.send_signal(signum)
        rest = proc.stderr.read()
        assert proc.wait(timeout=120) == code, rest
    assert time.monotonic() - signalled < 60  # run.shutdown_timeout_s
    assert f"interrupted by {signal.Signals(signum).name}" in rest
    steps = [m["step"] for m in records(tmp_path, "metrics.jsonl")]
    assert steps == list(range(len(steps))) and 4 <= len(steps) < 40
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert checkpoints and int(checkpoints[-1].split("_")[1]) == len(steps)  # weights, metrics and checkpoint agree
    assert "Traceback" not in rest


@pytest.mark.timeout(300)
def test_a_second_ctrl_c_exits_at_once_and_leaves_every_checkpoint_complete(tmp_path):
    from asyncgrpo.training.resume import checkpoint_problem

    with start_train(tmp_path, "train.max_steps=40", "eval.every_steps=0", "checkpoint.every_steps=1") as proc:
        assert read_until(proc, "step ")
        proc.send_signal(signal.SIGINT)
        assert read_until(proc, "received SIGINT")
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        assert proc.wait(timeout=60) == 130, rest
    assert "second SIGINT: exiting at once" in rest
    checkpoints = [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step_")]
    assert checkpoints and all(checkpoint_problem(p) is None for p in checkpoints)
