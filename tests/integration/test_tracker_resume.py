"""A resumed `train` continues its tracker runs: 2 steps, then a resume to 4, is one MLflow run and one trackio run
with steps 0-3, each in its store in the run directory (issue 29, item 6); a fresh start (run.overwrite) removes
those stores and starts new runs."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncgrpo.commands.train import train
from asyncgrpo.config import load_config

pytestmark = [
    pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("mlflow", "sqlalchemy", "alembic", "trackio")),
                       reason="mlflow, sqlalchemy, alembic or trackio is not installed (pip install 'asyncgrpo[sinks]')"),
    # MLflow's store models ask SQLAlchemy for `lazy="noload"`, which SQLAlchemy 2.1 deprecates: MLflow's warning, not ours.
    pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated:DeprecationWarning"),
]


def _train(run_dir: Path, *overrides: str):
    cfg = load_config("recipes/demo.yaml", [
        "logging.progress=false", "eval.every_steps=0", "rollout.groups_per_step=2", "rollout.group_size=2",
        "checkpoint.every_steps=2", "logging.sinks=[jsonl, mlflow, trackio]", "logging.project=resume-test",
        "run.name=tracked", f"run.output_dir={run_dir}", *overrides])
    return asyncio.run(train(cfg))


def _mlflow_runs(run_dir: Path) -> list[tuple[str, list[int]]]:
    """Each MLflow run in the run directory's store: its id and the steps its `loss` was logged at."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("resume-test").experiment_id])
    return [(run.info.run_id, sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss"))) for run in runs]


TRACKIO_READER = """
import json
from trackio.sqlite_storage import SQLiteStorage
runs = SQLiteStorage.get_runs("resume-test")
print(json.dumps({run: sorted(row["step"] for row in SQLiteStorage.get_logs("resume-test", run)) for run in runs}))
"""


def _trackio_runs(run_dir: Path) -> dict[str, list[int]]:
    """Each trackio run in the run directory's store, and the steps it logged (read with TRACKIO_DIR, as a user would)."""
    proc = subprocess.run([sys.executable, "-c", TRACKIO_READER], env={**os.environ, "TRACKIO_DIR": str(run_dir / "trackio")},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_a_resumed_run_continues_its_tracker_runs_and_a_fresh_start_begins_new_ones(tmp_path, monkeypatch):
    for variable in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE", "TRACKIO_DIR"):
        monkeypatch.delenv(variable, raising=False)
    _train(tmp_path, "train.max_steps=2")
    [(first, steps)] = _mlflow_runs(tmp_path)
    assert steps == [0, 1] and _trackio_runs(tmp_path) == {"tracked": [0, 1]}
    _train(tmp_path, "train.max_steps=4")
    assert _mlflow_runs(tmp_path) == [(first, [0, 1, 2, 3])] and _trackio_runs(tmp_path) == {"tracked": [0, 1, 2, 3]}
    _train(tmp_path, "train.max_steps=1", "run.overwrite=true")
    [(fresh, steps)] = _mlflow_runs(tmp_path)  # the earlier run's stores were removed with everything else it wrote
    assert fresh != first and steps == [0] and _trackio_runs(tmp_path) == {"tracked": [0]}
