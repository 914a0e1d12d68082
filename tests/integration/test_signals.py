"""A real `asyncgrpo train` process stopped by SIGTERM / SIGINT: bounded, clean exit code, checkpoint saved."""

from __future__ import annotations

import signal
import time

import pytest

from asyncgrpo.commands.signals import REPEAT_WINDOW_S
from asyncgrpo.training.checkpoint import PAUSE_FOR_TESTS_ENV
from asyncgrpo.training.integrity import checkpoint_problem
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
@pytest.mark.parametrize(("paused_at", "said"), [(3, "The newest checkpoint on disk, "), (1, "No checkpoint of this run is on disk yet.")])
def test_a_second_ctrl_c_exits_at_once_and_says_truthfully_what_is_on_disk(tmp_path, paused_at, said):
    """The stop is held up by a checkpoint write that never ends (the test hook pauses the writer of step
    `paused_at`), so only the second Ctrl-C, sent after the repeat window, can end the process."""
    env = {PAUSE_FOR_TESTS_ENV: str(paused_at)}
    with start_train(tmp_path, "train.max_steps=40", "eval.every_steps=0", "checkpoint.every_steps=1", env=env) as proc:
        assert read_until(proc, "asyncgrpo-test: checkpoint writer paused")
        proc.send_signal(signal.SIGINT)
        assert read_until(proc, "received SIGINT")
        time.sleep(REPEAT_WINDOW_S + 0.2)  # a later Ctrl-C, not the same one delivered twice
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        assert proc.wait(timeout=60) == 130, rest
    assert "second signal (SIGINT): exiting at once" in rest and said in rest
    checkpoints = sorted(p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert [p.name for p in checkpoints] == [f"step_{s:06d}" for s in range(1, paused_at)][-2:]
    assert all(checkpoint_problem(p) is None for p in checkpoints)


@pytest.mark.timeout(300)
def test_sigterm_delivered_twice_10_ms_apart_is_one_request_the_final_checkpoint_is_saved(tmp_path):
    """`timeout` signals the process, then its process group: the two copies are one request."""
    with start_train(tmp_path, "train.max_steps=40", "eval.every_steps=0", "checkpoint.every_steps=0") as proc:
        assert read_until(proc, "step ")
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait(timeout=120) == 143, rest
    assert "exiting at once" not in rest and "interrupted by SIGTERM" in rest
    steps = len(records(tmp_path, "metrics.jsonl"))
    assert checkpoint_problem(tmp_path / "checkpoints" / f"step_{steps:06d}") is None


@pytest.mark.timeout(300)
def test_the_stop_message_names_the_signal_received(tmp_path):
    with start_train(tmp_path, "train.max_steps=40", "eval.every_steps=0", "checkpoint.every_steps=0") as proc:
        assert read_until(proc, "step ")
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        proc.wait(timeout=120)
    assert "received SIGTERM" in rest and "send SIGTERM again to exit at once" in rest and "Ctrl-C" not in rest


@pytest.mark.timeout(300)
def test_an_environment_that_blocks_the_event_loop_is_reported_and_a_stop_still_ends_the_process(tmp_path):
    """An `async def` step that calls time.sleep blocks the pipeline's loop (async environment methods run on it), so
    env.step_timeout_s cannot fire; the watchdog says where it is blocked, and the shutdown timer (a thread) ends the
    process after run.shutdown_timeout_s. (An async reward that does the same blocks only its own reward loop:
    tests/integration/test_every_stage_fails_cleanly.py.)"""
    with start_train(tmp_path, "env.factory=tests.envs:SleepsOnTheLoop", "env.step_timeout_s=1", "env.cancel_grace_s=1", "reward.functions=[]",
                     "logging.blocked_loop_warn_s=2", "run.shutdown_timeout_s=3", "eval.every_steps=0") as proc:
        assert read_until(proc, "warning: the event loop has not turned for")
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait(timeout=60) == 143, rest
    assert time.monotonic() - signalled < 30
    assert "received SIGTERM" in rest and "the shutdown took longer than run.shutdown_timeout_s: exiting at once" in rest
    assert "No checkpoint of this run is on disk yet." in rest


@pytest.mark.timeout(300)
def test_a_signal_during_the_baseline_evaluation_stops_it_instead_of_waiting_for_it(tmp_path):
    """The baseline evaluation runs before the pipeline; a stop used to wait for it to end (bounded only by the
    shutdown timer). Here its reward never returns (an async call the deadline lets run for an hour)."""
    rewards = tmp_path / "slow_reward.py"
    rewards.write_text(
        "import asyncio, sys\n\n\n"
        "async def judge(prompts, completions, **columns):\n"
        "    print('asyncgrpo-test: reward waiting', file=sys.stderr, flush=True)\n"
        "    await asyncio.sleep(3600)\n"
    )
    run_dir = tmp_path / "run"
    overrides = [f"reward.functions=[{rewards}:judge]", "reward.timeout_s=3600", "run.shutdown_timeout_s=120"]
    with start_train(run_dir, *overrides) as proc:
        assert read_until(proc, "asyncgrpo-test: reward waiting")  # the baseline evaluation is scoring
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait(timeout=150) == 143, rest
    assert time.monotonic() - signalled < 30, rest  # well inside run.shutdown_timeout_s: the evaluation was cancelled
    assert "interrupted by SIGTERM" in rest and "Traceback" not in rest
