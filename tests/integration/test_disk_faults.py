"""A disk that refuses a write ends the run with one paragraph (the path, the free space, the fix), keeps the
previous checkpoint intact and writes error.txt; never a raw traceback."""

from __future__ import annotations

import asyncio
import errno
import resource
import signal
import subprocess
import sys

import pytest

import asyncgrpo.atomic
from asyncgrpo.commands.train import train
from asyncgrpo.config import load_config
from asyncgrpo.training.integrity import checkpoint_problem
from tests.integration.train_process import ROOT, records

QUICK = ["eval.every_steps=0", "logging.progress=false", "rollout.groups_per_step=2", "rollout.group_size=2"]


def _small_file_limit() -> None:
    """In the child: files may not grow past 2 MiB (the tiny model's weights are 4 MiB), as on a full disk."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 * 2**20, 2 * 2**20))


@pytest.mark.timeout(300)
def test_a_checkpoint_the_disk_refuses_ends_in_one_paragraph_with_error_txt(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "asyncgrpo.commands.cli", "train", "recipes/demo.yaml", f"run.output_dir={tmp_path}", "train.max_steps=2", *QUICK],
        cwd=ROOT, capture_output=True, text=True, timeout=300, preexec_fn=_small_file_limit,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "error (disk): After step 2, cannot write" in result.stderr and "File too large" in result.stderr
    assert "MiB free there" in result.stderr and "Fix: free some disk space" in result.stderr
    assert "No checkpoint of this run is on disk yet." in result.stderr
    assert "cannot write" in (tmp_path / "error.txt").read_text()
    assert [m["step"] for m in records(tmp_path, "metrics.jsonl")] == [0, 1]
    assert not [p for p in (tmp_path / "checkpoints").iterdir()]  # the failed write left nothing behind


@pytest.mark.timeout(300)
def test_the_previous_checkpoint_stays_intact_when_a_later_one_cannot_be_written(tmp_path, monkeypatch):
    real_fsync_tree = asyncgrpo.atomic.fsync_tree
    calls = []

    def disk_full_after_the_first(root):
        calls.append(root)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(root / "model.safetensors"))
        real_fsync_tree(root)

    monkeypatch.setattr(asyncgrpo.atomic, "fsync_tree", disk_full_after_the_first)
    cfg = load_config("recipes/demo.yaml", [f"run.output_dir={tmp_path}", "train.max_steps=6", "checkpoint.every_steps=2", *QUICK])
    summary = asyncio.run(train(cfg))
    d = summary.result.diagnostic
    assert summary.exit_code == 1 and d.kind == "disk" and "No space left on device" in d.message
    assert "step_000002" in d.message and "is complete" in d.message
    assert summary.result.steps == 4  # the step whose checkpoint failed had trained
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000002"]
    assert checkpoint_problem(tmp_path / "checkpoints" / "step_000002") is None
    assert (tmp_path / "error.txt").is_file()
