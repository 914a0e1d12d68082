"""`asyncgrpo train ... train.world_size=2` as a real process on a local Ray cluster it starts itself (2 CPUs: one
generator actor and two trainer ranks): a trainer rank SIGKILLed mid-run fails the run with one paragraph naming the
rank; the same command resumes from the newest checkpoint, SIGTERM stops it with a final checkpoint, and the same
command again trains to the end, every prompt of every epoch exactly once. After each run no Ray process of it is
left. The test follows the runs through their stderr lines (no sleeping).
"""

from __future__ import annotations

import os
import signal
from collections import Counter

import pytest

from tests.integration.ray_cluster import left_after, processes_of
from tests.integration.train_process import read_until, records, start_train

# 40 prompts x 2 epochs / 4 groups per step = 20 steps; a checkpoint every 2 steps (as tests/integration/test_resume.py).
RECIPE = (
    "data.builtin_size=40", "data.num_epochs=2", "rollout.groups_per_step=4", "rollout.group_size=4",
    "train.max_steps=20", "eval.every_steps=0", "checkpoint.every_steps=2", "checkpoint.keep_last=2",
)
RAY = ("runtime=ray", "ray.num_cpus=2", "ray.generators=1", "ray.generator.num_cpus=0.5", "train.world_size=2",
       "ray.trainer.num_cpus=0.5", "ray.trainer_timeout_s=120")


def trainer_ranks(temp_dir: str) -> list[int]:
    return sorted(pid for pid, cmdline in processes_of(temp_dir).items() if cmdline.startswith("ray::TrainerRank"))


def newest_checkpoint(run_dir) -> int:
    return max(int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))


def rank_pids(started: str) -> list[int]:
    """The pids, in rank order, of the driver's line 'trainer ranks: trainer rank 0 of 2 (pid P on NODE); ...'."""
    return [int(part.split("(pid ")[1].split()[0]) for part in started.split("; ")]


@pytest.mark.timeout(600)
def test_a_killed_trainer_rank_fails_the_run_naming_it_sigterm_stops_the_resume_and_every_prompt_trains_once(tmp_path, ray_tmpdir):
    run_dir = tmp_path / "run"
    env = {"RAY_TMPDIR": ray_tmpdir}
    with start_train(run_dir, *RECIPE, *RAY, env=env) as proc:
        started = next((line for line in proc.stderr if line.startswith("trainer ranks: ")), None)
        # logging.progress=false: a line every 2 steps; the second comes after the checkpoint of step 2.
        if started is None or not (read_until(proc, "step ") and read_until(proc, "step ")):
            pytest.fail(f"the run ended before step 4 (exit {proc.wait()}): {proc.stderr.read()}")
        assert sorted(rank_pids(started)) == trainer_ranks(ray_tmpdir), processes_of(ray_tmpdir)
        rank0 = rank_pids(started)[0]  # the rank that also publishes the weights and writes the checkpoints
        os.kill(rank0, signal.SIGKILL)
        rest = proc.stderr.read()
        assert proc.wait(timeout=180) == 1, rest
    # The kill lands in a step (step_error) or in writing a checkpoint after one (step_report).
    error = next((line for line in rest.splitlines() if line.startswith(("  error (step_error): ", "  error (step_report): "))), None)
    assert error is not None, rest
    assert f"trainer rank 0 of 2 (pid {rank0} on " in error and " died (" in error, error
    assert "run the same command again: it resumes from the newest checkpoint" in error
    assert "checkpoint of" not in error and "  checkpoint: " not in rest  # none can be written without all ranks
    assert "Traceback" not in rest
    assert not left_after(ray_tmpdir), "Ray processes outlived the failed run"
    resume_from = newest_checkpoint(run_dir)
    assert 2 <= resume_from <= len(records(run_dir, "metrics.jsonl")) < 20

    # SIGTERM stops a resumed run as in the local runtime: the step in progress finishes, rank 0 writes the final
    # checkpoint, exit 143, and no Ray process is left.
    with start_train(run_dir, *RECIPE, *RAY, env=env) as proc:
        if not (read_until(proc, "resuming from") and read_until(proc, "step ")):
            pytest.fail(f"the resumed run ended before a step (exit {proc.wait()}): {proc.stderr.read()}")
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait(timeout=180) == 143, rest
    assert "interrupted by SIGTERM" in rest and "Traceback" not in rest
    stopped_at = len(records(run_dir, "metrics.jsonl"))
    assert resume_from < stopped_at < 20 and newest_checkpoint(run_dir) == stopped_at
    assert not left_after(ray_tmpdir), "Ray processes outlived the stopped run"

    with start_train(run_dir, *RECIPE, *RAY, env=env) as proc:
        rest = proc.stderr.read()
        assert proc.wait(timeout=300) == 0, rest
    assert "resuming from" in rest and "completed 20 steps" in rest

    assert [m["step"] for m in records(run_dir, "metrics.jsonl")] == list(range(20))
    per_epoch = Counter((o["epoch"], o["prompt_id"]) for o in records(run_dir, "outcomes.jsonl"))
    assert set(per_epoch.values()) == {1}, "a prompt ended twice in one epoch"
    for epoch in (0, 1):
        assert sorted(pid for e, pid in per_epoch if e == epoch) == list(range(40))
