"""What the console says: tokens/s as a moving rate, the bar's fields (counters only once non-zero), and a
summary that puts a failure's diagnostic first and ends with what to try."""

from __future__ import annotations

from pathlib import Path

from asyncgrpo.commands.train_summary import RunSummary
from asyncgrpo.errors import Diagnostic
from asyncgrpo.pipeline import PipelineResult
from asyncgrpo.telemetry.metrics import MovingRate
from asyncgrpo.telemetry.progress import RunTotals, step_fields

ACCOUNTING = {"taken": 10, "trained": 8, "requeued": 0, "dropped": {"failed": 2}, "in_flight": 0, "buffered": 0}


def test_the_token_rate_is_a_moving_rate_over_the_last_steps():
    rate = MovingRate(0.0, 0, window=2)
    # Tokens arrive in bursts: 100 in the first second, none in the next, 100 in the third.
    assert rate.add(1.0, 100) == 100.0
    assert rate.add(2.0, 100) == 50.0
    assert rate.add(3.0, 200) == 50.0  # (200 - 100) / (3 - 1): the rate over the last 2 steps
    assert rate.add(4.0, 400) == 150.0  # (400 - 100) / (4 - 2): older points have left the window
    assert MovingRate(5.0, 7).add(5.0, 9) == 0.0  # no time passed: no rate, no division by zero


def values(**extra):
    return {"reward/mean": 0.5, "staleness/mean": 0.5, "staleness/max": 1, "throughput/gen_tokens_per_s": 1234.4,
            "eval/reward_mean": None, "rollout/failed_total": 0, "rollout/stale_groups_total": 0,
            "rollout/dropped_groups_total": 0, **extra}


def test_the_bar_shows_eval_and_counters_only_when_there_are_some():
    totals = RunTotals(wait_s=1.0, busy_s=3.0)
    quiet = step_fields(values(), totals, in_flight_groups=5)
    assert quiet == {"reward": "0.500", "stale": "0.5/1", "inflight": "5", "wait": "25%", "tok/s": "1234"}
    busy = step_fields(values(**{"eval/reward_mean": 0.75, "rollout/failed_total": 3, "rollout/dropped_groups_total": 1}), totals, 0)
    assert busy["eval"] == "0.750" and busy["failed"] == "3" and busy["dropped"] == "1" and "stale" in busy


def test_a_failed_run_summary_starts_with_the_diagnostic_and_ends_with_what_to_try(tmp_path):
    diagnostic = Diagnostic(kind="drop_fraction", message="40 of the last 64 groups were dropped")
    summary = RunSummary(
        run_dir=tmp_path, result=PipelineResult("failed", "error", 3, diagnostic), accounting=ACCOUNTING,
        final_checkpoint=Path(tmp_path / "checkpoints" / "step_000003"),
        totals=RunTotals(steps=3, samples=24, tokens=300, wait_s=1.0, busy_s=1.0, staleness=[0, 1], eval_first=0.1, eval_last=0.4,
                         last={"rollout/failed_total": 7, "rollout/generated_tokens_total": 300}),
        wall_s=75.0,
    )
    lines = summary.render().splitlines()
    assert lines[0].startswith("asyncgrpo: failed after 3 steps") and lines[1].startswith("  error (drop_fraction): 40 of the last")
    text = "\n".join(lines)
    assert "trained: 3 steps, 24 samples, 300 completion tokens in 1m15s" in text
    assert "eval reward: 0.100 -> 0.400" in text and "mean 0.50, max 1; the trainer waited for batches 50%" in text
    assert "counters: failed_total 7" in text and "generated" not in text.split("counters:")[1].splitlines()[0]
    assert lines[-2] == "  what to try: the 'drop_fraction' section of docs/troubleshooting.md"
    assert lines[-1].startswith("  to continue: run the same command again")


def test_an_interrupted_runs_staleness_max_is_the_max_of_what_it_trained(tmp_path):
    """A stop ends the pipeline with a PipelineResult that never saw a step: the summary's max comes from the steps (issue 20, item 6)."""
    summary = RunSummary(run_dir=tmp_path, result=PipelineResult("failed", "signal", 4), accounting=ACCOUNTING, interrupted_by=2,
                         totals=RunTotals(steps=4, samples=8, tokens=80, staleness=[1, 1, 0.0, 1, 1]))
    assert "staleness trained: mean 0.80, max 1" in summary.render()


def test_a_resumed_runs_summary_says_which_lines_count_this_invocation_and_which_the_whole_run(tmp_path):
    summary = RunSummary(
        run_dir=tmp_path, result=PipelineResult("completed", "max_steps", 250), accounting=ACCOUNTING, start_step=100,
        first_rewards=[0.5], last_rewards=[0.9],
        totals=RunTotals(steps=150, samples=1200, tokens=9000, staleness=[1, 1], eval_first=0.5, eval_last=0.9,
                         kl_first=0.25, kl_last=0.05, last={"rollout/failed_total": 7}),
    )
    text = summary.render()
    assert "trained this invocation (resumed at step 100): 150 steps, 1200 samples" in text
    assert "eval reward this invocation: 0.500 -> 0.900" in text and "reward this invocation: first 10% of steps" in text
    assert "staleness trained this invocation: mean 1.00, max 1" in text
    assert "prompts, whole run: taken 10" in text and "counters, whole run: failed_total 7" in text
    assert "distill/kl_mean this invocation: first step 0.2500 -> last 0.0500" in text
    fresh = RunSummary(run_dir=tmp_path, result=PipelineResult("completed", "max_steps", 2), accounting=ACCOUNTING,
                       totals=RunTotals(steps=2, samples=4, tokens=9, staleness=[0, 1])).render()
    assert "this invocation" not in fresh and "whole run" not in fresh and "  trained: 2 steps" in fresh
