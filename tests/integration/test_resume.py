"""Kill a real `asyncgrpo train` again and again, resume it, and check from its records that every prompt
of every epoch was trained exactly once (or dropped once, with its reason) and the steps are continuous."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from asyncgrpo.commands.train import train
from asyncgrpo.config import load_config
from asyncgrpo.training.checkpoint import PAUSE_FOR_TESTS_ENV
from tests.integration.train_process import read_until, records, start_train

# 40 prompts x 2 epochs / 4 groups per step = 20 steps; a checkpoint every 2 steps.
RECIPE = (
    "data.builtin_size=40", "data.num_epochs=2", "rollout.groups_per_step=4", "rollout.group_size=4",
    "train.max_steps=20", "eval.every_steps=0", "checkpoint.every_steps=2", "checkpoint.keep_last=2",
)


def start(run_dir: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return start_train(run_dir, *RECIPE, env=env)


def kill_when(proc: subprocess.Popen[str], marker: str) -> bool:
    """SIGKILL the process once a stderr line starts with `marker`; False if it ended first."""
    seen = read_until(proc, marker)
    if seen:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    return seen


@pytest.mark.timeout(600)
def test_sigkill_at_many_points_then_resume_trains_every_prompt_exactly_once(tmp_path):
    run_dir = tmp_path / "run"
    kills = 0
    # Five kills in the middle of training (each after some progress, at varying steps) ...
    for _ in range(5):
        with start(run_dir) as proc:
            kills += kill_when(proc, "step ")
    # ... and one inside a checkpoint write: the writer stops right before its rename.
    with start(run_dir, {PAUSE_FOR_TESTS_ENV: "14"}) as proc:
        killed_in_write = kill_when(proc, "asyncgrpo-test: checkpoint writer paused")
    assert kills >= 4 and killed_in_write
    # Then to the end.
    with start(run_dir) as proc:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    assert "resuming from" in err and "completed 20 steps" in err

    assert [m["step"] for m in records(run_dir, "metrics.jsonl")] == list(range(20))
    outcomes = records(run_dir, "outcomes.jsonl")
    per_epoch = Counter((o["epoch"], o["prompt_id"]) for o in outcomes)
    assert set(per_epoch.values()) == {1}, "a prompt ended twice in one epoch"
    assert {e for e, _ in per_epoch} == {0, 1}
    for epoch in (0, 1):
        assert sorted(pid for e, pid in per_epoch if e == epoch) == list(range(40))
    assert all(o["outcome"] == "trained" or o.get("reason") for o in outcomes)
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.timeout(300)
def test_sigterm_saves_a_checkpoint_and_the_same_command_continues(tmp_path):
    run_dir = tmp_path / "run"
    with start(run_dir) as proc:
        assert read_until(proc, "step ")
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait(timeout=120) == 143
    assert "to continue: run the same command again" in rest
    done = len(records(run_dir, "metrics.jsonl"))
    assert (run_dir / "checkpoints" / f"step_{done:06d}").is_dir()
    with start(run_dir) as proc:
        _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and f"resuming from {run_dir / 'checkpoints' / f'step_{done:06d}'}" in err
    assert [m["step"] for m in records(run_dir, "metrics.jsonl")] == list(range(20))


@pytest.mark.timeout(300)
def test_a_resumed_run_repeats_the_next_step_of_the_uninterrupted_one(tmp_path):
    """Staleness 0 and per-request seeds make generation deterministic for the same weights and prompts.
    Exact equality of the metrics is not promised: the engine batches whatever requests are queued when
    it starts a wave, and a different batch shape changes float rounding, which can flip a sampled token.
    So the test checks the data order exactly (the same prompts at step k+1) and the metrics within a
    tolerance."""
    common = ["logging.progress=false", "rollout.max_staleness=0", "rollout.groups_per_step=3", "rollout.group_size=4",
              "eval.every_steps=0", "checkpoint.every_steps=3"]

    def run(run_dir: Path, steps: int):
        cfg = load_config("recipes/demo.yaml", [*common, f"run.output_dir={run_dir}", f"train.max_steps={steps}"])
        return asyncio.run(train(cfg))

    run(tmp_path / "straight", 5)
    run(tmp_path / "resumed", 3)
    summary = run(tmp_path / "resumed", 5)
    assert summary.result.steps == 5

    def trained_at(run_dir: Path, step: int) -> set[int]:
        return {o["prompt_id"] for o in records(run_dir, "outcomes.jsonl") if o["step"] == step}

    for step in (3, 4):
        assert trained_at(tmp_path / "resumed", step) == trained_at(tmp_path / "straight", step)
    straight, resumed = records(tmp_path / "straight", "metrics.jsonl"), records(tmp_path / "resumed", "metrics.jsonl")
    assert [m["step"] for m in resumed] == list(range(5))
    assert resumed[3]["reward/mean"] == pytest.approx(straight[3]["reward/mean"], abs=0.05)
    assert resumed[3]["loss"] == pytest.approx(straight[3]["loss"], abs=0.05)
    assert resumed[3]["lr"] == straight[3]["lr"]


def _train(run_dir: Path, *overrides: str):
    cfg = load_config("recipes/demo.yaml", ["logging.progress=false", "eval.every_steps=0", "rollout.groups_per_step=2",
                                           "rollout.group_size=2", f"run.output_dir={run_dir}", *overrides])
    return asyncio.run(train(cfg))


@pytest.mark.timeout(300)
def test_a_resume_applies_a_changed_learning_rate_weight_decay_and_warm_up_from_its_first_step(tmp_path):
    constant = "train.lr_schedule=constant"  # the demo recipe decays its rate; this test reads the rate itself
    _train(tmp_path, "train.max_steps=3", "train.lr=0.001", "train.warmup_steps=0", constant)
    summary = _train(tmp_path, "train.max_steps=5", "train.lr=0.05", "train.warmup_steps=10", "train.weight_decay=0.1", constant)
    assert summary.result.steps == 5
    lrs = [m["lr"] for m in records(tmp_path, "metrics.jsonl")]
    assert lrs[:3] == [0.001] * 3
    # warm-up over 10 updates, 3 already taken: the 4th update uses 4/10 of the new rate
    assert lrs[3:] == pytest.approx([0.05 * 4 / 10, 0.05 * 5 / 10])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("damage", ["emptied", "deleted", "garbled"])
def test_damaged_records_are_restored_from_the_checkpoint_never_padded_or_shortened(tmp_path, damage):
    _train(tmp_path, "train.max_steps=4", "checkpoint.every_steps=2")
    for name in ("outcomes.jsonl", "metrics.jsonl", "timeline.jsonl"):
        path = tmp_path / name
        if damage == "deleted":
            path.unlink()
        else:
            path.write_text("" if damage == "emptied" else "x" * 100_000)
    summary = _train(tmp_path, "train.max_steps=6", "checkpoint.every_steps=2")
    assert summary.result.steps == 6
    for name in ("outcomes.jsonl", "metrics.jsonl", "timeline.jsonl"):
        assert b"\0" not in (tmp_path / name).read_bytes()
    assert [m["step"] for m in records(tmp_path, "metrics.jsonl")] == list(range(6))
    assert [t["step"] for t in records(tmp_path, "timeline.jsonl") if t["e"] == "step"] == list(range(6))
    trained = Counter(o["prompt_id"] for o in records(tmp_path, "outcomes.jsonl") if o["outcome"] == "trained")
    assert sum(trained.values()) == 6 * 2 and set(trained.values()) == {1}


@pytest.mark.timeout(300)
def test_the_timeline_survives_the_same_command_on_a_finished_run_and_continues_on_resume(tmp_path):
    """timeline.jsonl is one of the run's records: appended on every start, never truncated (issue 20, item 1)."""
    _train(tmp_path, "train.max_steps=3", "checkpoint.every_steps=2")
    first = (tmp_path / "timeline.jsonl").read_bytes()
    _train(tmp_path, "train.max_steps=3", "checkpoint.every_steps=2")  # the documented way to resume; nothing left to train
    assert (tmp_path / "timeline.jsonl").read_bytes().startswith(first)
    summary = _train(tmp_path, "train.max_steps=5", "checkpoint.every_steps=2")
    assert summary.result.steps == 5
    lines = records(tmp_path, "timeline.jsonl")
    assert [line["step"] for line in lines if line["e"] == "start"] == [0, 3, 3]
    steps = [line for line in lines if line["e"] == "step"]
    assert [line["step"] for line in steps] == list(range(5))
    ends = [line["sync"][1] for line in steps]
    assert ends == sorted(ends)  # the run's time continues across the resumes
    takes = [line["take"] for line in lines if line["e"] == "take"]
    assert len(takes) == len(set(takes))  # take numbers continue too


@pytest.mark.timeout(300)
def test_checkpoint_resume_path_with_overwrite_continues_that_checkpoint(tmp_path):
    """What `make demo ARGS=checkpoint.resume=PATH` runs: the named checkpoint is continued, not discarded (issue 20, item 14)."""
    _train(tmp_path, "train.max_steps=2", "checkpoint.every_steps=2")
    path = tmp_path / "checkpoints" / "step_000002"
    summary = _train(tmp_path, "train.max_steps=3", "run.overwrite=true", f"checkpoint.resume={path}")
    assert summary.result.steps == 3 and summary.totals.steps == 1
    assert [m["step"] for m in records(tmp_path, "metrics.jsonl")] == [0, 1, 2]
