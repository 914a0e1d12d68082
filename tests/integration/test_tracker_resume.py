"""A resumed `train` continues its tracker run: 2 steps, then a resume to 4, is one MLflow run with steps 0-3
(issue 29, item 6); a fresh start (run.overwrite) starts a new one."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

from asyncgrpo.commands.train import train
from asyncgrpo.config import load_config


def _train(run_dir: Path, *overrides: str):
    cfg = load_config("recipes/demo.yaml", [
        "logging.progress=false", "eval.every_steps=0", "rollout.groups_per_step=2", "rollout.group_size=2",
        "checkpoint.every_steps=2", "logging.sinks=[jsonl, mlflow]", "logging.project=resume-test",
        f"run.output_dir={run_dir}", *overrides])
    return asyncio.run(train(cfg))


def _runs(run_dir: Path) -> list[tuple[str, list[int]]]:
    """Each MLflow run in the run directory's store: its id and the steps its `loss` was logged at."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    runs = client.search_runs([client.get_experiment_by_name("resume-test").experiment_id])
    return [(run.info.run_id, sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss"))) for run in runs]


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="mlflow is not installed (pip install 'asyncgrpo[sinks]')")
@pytest.mark.timeout(300)
def test_a_resumed_run_continues_its_mlflow_run_and_a_fresh_start_begins_a_new_one(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for this test's own reader
    _train(tmp_path, "train.max_steps=2")
    [(first, steps)] = _runs(tmp_path)
    assert steps == [0, 1]
    _train(tmp_path, "train.max_steps=4")
    assert _runs(tmp_path) == [(first, [0, 1, 2, 3])]
    _train(tmp_path, "train.max_steps=1", "run.overwrite=true")
    [(fresh, steps)] = _runs(tmp_path)  # the earlier run's store was removed with everything else it wrote
    assert fresh != first and steps == [0]
