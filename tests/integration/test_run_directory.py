"""The run directory belongs to asyncgrpo or is left alone: a marker, a lock, and starting over removes only
what asyncgrpo wrote. Real `asyncgrpo` processes, since deleting and locking are what is under test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from asyncgrpo.rundir import LOCK_FILE, MARKER
from tests.integration.train_process import ROOT, read_until, start_train

QUICK = ("train.max_steps=2", "eval.every_steps=0", "logging.progress=false", "rollout.groups_per_step=2", "rollout.group_size=2")


def asyncgrpo(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "asyncgrpo.commands.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def users_folder(path: Path) -> dict[str, str]:
    """A folder of someone's files; returns what it holds, to compare after."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "thesis.tex").write_text("years of work")
    (path / "data").mkdir(exist_ok=True)
    (path / "data" / "set.csv").write_text("a,b\n1,2\n")
    return snapshot(path)


def snapshot(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): p.read_text() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("overwrite", ["run.overwrite=false", "run.overwrite=true"])
def test_an_existing_folder_of_someone_elses_files_is_refused_and_left_intact(tmp_path, overwrite):
    before = users_folder(tmp_path / "mine")
    result = asyncgrpo("train", "recipes/demo.yaml", f"run.output_dir={tmp_path / 'mine'}", overwrite, *QUICK)
    assert result.returncode == 3, result.stderr
    assert "not an asyncgrpo run directory" in result.stderr and "thesis.tex" in result.stderr and "Fix:" in result.stderr
    assert "Traceback" not in result.stderr
    assert snapshot(tmp_path / "mine") == before and not (tmp_path / "mine" / MARKER).exists()


def test_check_refuses_the_same_folder_without_touching_it(tmp_path):
    before = users_folder(tmp_path / "mine")
    result = asyncgrpo("check", "recipes/demo.yaml", f"run.output_dir={tmp_path / 'mine'}")
    assert result.returncode == 3 and "not an asyncgrpo run directory" in result.stderr
    assert snapshot(tmp_path / "mine") == before


def test_a_run_name_that_is_a_path_is_refused_and_the_working_directory_is_untouched(tmp_path):
    work = tmp_path / "work"
    (work / "runs").mkdir(parents=True)
    before = users_folder(work)
    for name in ("..", ".", "../escape", "/abs"):
        result = asyncgrpo("train", str(ROOT / "recipes/demo.yaml"), f"run.name={name}", *QUICK, cwd=work / "runs")
        assert result.returncode == 3 and "is a path, not a name" in result.stderr, (name, result.stderr)
    assert snapshot(work) == before


def test_an_absolute_path_and_a_symlink_to_a_users_folder_are_refused(tmp_path):
    before = users_folder(tmp_path / "target")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    for output_dir in (tmp_path / "target", tmp_path / "link"):
        result = asyncgrpo("train", "recipes/demo.yaml", f"run.output_dir={output_dir}", "run.overwrite=true", *QUICK)
        assert result.returncode == 3 and "not an asyncgrpo run directory" in result.stderr
    assert snapshot(tmp_path / "target") == before


@pytest.mark.timeout(300)
def test_overwrite_removes_only_what_asyncgrpo_wrote_in_its_own_directory(tmp_path):
    run_dir = tmp_path / "run"
    first = asyncgrpo("train", "recipes/demo.yaml", f"run.output_dir={run_dir}", *QUICK)
    assert first.returncode == 0, first.stderr
    assert (run_dir / MARKER).is_file() and (run_dir / "checkpoints" / "step_000002").is_dir()
    (run_dir / "my_notes.md").write_text("what I saw in this run")
    (run_dir / "checkpoints" / "keep_me.txt").write_text("the good one was step 2")
    again = asyncgrpo("train", "recipes/demo.yaml", f"run.output_dir={run_dir}", "run.overwrite=true", "train.max_steps=1", *QUICK[1:])
    assert again.returncode == 0, again.stderr
    assert (run_dir / "my_notes.md").read_text() == "what I saw in this run"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["keep_me.txt", "step_000001"]
    assert "kept what asyncgrpo did not write: checkpoints/keep_me.txt" in again.stderr


@pytest.mark.timeout(300)
def test_a_second_trainer_on_the_same_directory_exits_3_naming_the_pid_and_a_killed_holder_does_not_block(tmp_path):
    run_dir = tmp_path / "run"
    with start_train(run_dir, "train.max_steps=200", "eval.every_steps=0", "checkpoint.every_steps=0") as first:
        assert read_until(first, "step ")
        second = asyncgrpo("train", "recipes/demo.yaml", f"run.output_dir={run_dir}", *QUICK)
        assert second.returncode == 3, second.stderr
        assert f"in use by process {first.pid}" in second.stderr and "Traceback" not in second.stderr
        assert first.poll() is None  # the first run goes on, untouched
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    assert (run_dir / LOCK_FILE).exists()  # the lock file stays, but its lock died with its holder
    third = asyncgrpo("train", "recipes/demo.yaml", f"run.output_dir={run_dir}", *QUICK)
    assert third.returncode == 0, third.stderr
    assert os.path.exists(run_dir / "checkpoints" / "step_000002")
