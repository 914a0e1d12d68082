"""Each tracker of logging.sinks writes every metric key of every step where its own reader finds it;
a tracker whose package is missing is a config error naming the pip command. A test whose tracker
package is not installed skips and says so (`pip install 'asyncgrpo[sinks]'` installs them all)."""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

import pytest

from asyncgrpo import metric_names
from asyncgrpo.config import Config, load_config
from asyncgrpo.errors import ConfigError
from asyncgrpo.rundir import clear_run
from asyncgrpo.telemetry import sinks
from asyncgrpo.telemetry.sinks import Trackers, sink_problems

# MLflow's store models ask SQLAlchemy for `lazy="noload"`, which SQLAlchemy 2.1 deprecates: MLflow's warning, not ours.
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated:DeprecationWarning")

LINES = [
    {"step": 0, "version": 1, "loss": 0.5, "reward/mean": 0.25, "eval/reward_mean": None, "rollout/failed_total": 0},
    {"step": 1, "version": 2, "loss": 0.25, "reward/mean": 0.5, "eval/reward_mean": 0.75, "rollout/failed_total": 3},
]
# Every key with a value, per step (the x axis is `step` itself).
EXPECTED = {0: {"version": 1.0, "loss": 0.5, "reward/mean": 0.25, "rollout/failed_total": 0.0},
            1: {"version": 2.0, "loss": 0.25, "reward/mean": 0.5, "eval/reward_mean": 0.75, "rollout/failed_total": 3.0}}


RUN_DIR = Path("/runs/demo")


def needs(module: str):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{module} is not installed (pip install 'asyncgrpo[sinks]')")


# A run of 4 steps in two invocations: steps 0-1, then a resume logging steps 2-3 (a checkpoint at step 2).
RESUMED = [{**line, "step": line["step"] + 2} for line in LINES]
EXPECTED_RESUMED = {**EXPECTED, **{step + 2: values for step, values in EXPECTED.items()}}


def write(tmp_path, sink: str, lines: list[dict] = LINES) -> Config:
    cfg = Config.model_validate({"run": {"name": "sinktest"}, "logging": {"sinks": ["jsonl", sink], "project": "asyncgrpo-test"}})
    trackers = Trackers(cfg, tmp_path)
    for line in lines:
        trackers.log(line)
    assert trackers.close() == []
    return cfg


@needs("tensorboard")
def test_tensorboard_event_files_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    write(tmp_path, "tensorboard")
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    got: dict[int, dict[str, float]] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            got.setdefault(event.step, {})[tag] = event.value
    assert got == EXPECTED


def mlflow_runs(store):
    """The MLflow runs in the sqlite store `store` (the run directory's mlflow.db), read as a user would (no
    environment variable), and each one's metrics by step."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    runs = []
    for run in client.search_runs([client.get_experiment_by_name("asyncgrpo-test").experiment_id]):
        got: dict[int, dict[str, float]] = {}
        for key in run.data.metrics:
            for metric in client.get_metric_history(run.info.run_id, key):
                got.setdefault(metric.step, {})[key] = metric.value
        runs.append((run, got))
    return runs


@pytest.fixture
def mlflow_env(tmp_path, monkeypatch):
    """No MLflow variable set, and a working directory of its own (MLflow's client defaults put files there)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    yield run_dir
    assert list(cwd.iterdir()) == []


@needs("mlflow")
def test_mlflow_writes_a_sqlite_store_in_the_run_directory_that_mlflow_reads_with_no_variable(mlflow_env):
    cfg = write(mlflow_env, "mlflow")
    [(run, got)] = mlflow_runs(mlflow_env / "mlflow.db")
    assert run.info.run_name == "sinktest" and run.info.status == "FINISHED"
    assert got == EXPECTED
    # The config as params, one per leaf, under dotted keys.
    assert run.data.params["rollout.group_size"] == str(cfg.rollout.group_size)
    assert run.data.params["run.name"] == "sinktest" and run.data.params["logging.sinks"] == '["jsonl", "mlflow"]'
    assert len(run.data.params) > 50
    assert run.info.artifact_uri.startswith((mlflow_env / "mlartifacts").as_uri() + "/")
    assert sorted(p.name for p in mlflow_env.iterdir()) == ["mlflow.db", "trackers.json"]


def test_a_run_directory_mlflows_sqlite_uri_cannot_name_is_a_config_problem_naming_the_fix(monkeypatch):
    """SQLAlchemy ends the file name at '?' and decodes '%xx', and MLflow makes the URI text's parent folder as it is:
    the store would land outside the run directory."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    [problem] = sink_problems(["mlflow"], Path("/runs/lr 50%?a=1"))
    assert problem.startswith("logging.sinks names mlflow, whose store would be /runs/lr 50%?a=1/mlflow.db, but that "
                              "path holds '%' and '?'") and "Fix: choose a run.directory without" in problem
    assert sink_problems(["jsonl"], Path("/runs/lr 50%?a=1")) == []
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert sink_problems(["mlflow"], Path("/runs/lr 50%?a=1")) == []


@needs("mlflow")
def test_a_resumed_run_continues_its_mlflow_run(mlflow_env):
    write(mlflow_env, "mlflow")
    write(mlflow_env, "mlflow", RESUMED)
    [(run, got)] = mlflow_runs(mlflow_env / "mlflow.db")
    assert run.info.status == "FINISHED" and got == EXPECTED_RESUMED


@needs("mlflow")
def test_after_a_fresh_start_in_the_same_process_mlflow_writes_the_new_store(mlflow_env):
    """MLflow pools connections per URI for the process: a run after clear_run must not write the deleted file."""
    write(mlflow_env, "mlflow")
    [(first, _)] = mlflow_runs(mlflow_env / "mlflow.db")  # a reader in this process opens (and pools) a connection too
    clear_run(mlflow_env)
    assert not (mlflow_env / "mlflow.db").exists()
    write(mlflow_env, "mlflow", RESUMED)
    [(run, got)] = mlflow_runs(mlflow_env / "mlflow.db")
    assert run.info.run_id != first.info.run_id and got == {step + 2: values for step, values in EXPECTED.items()}


@needs("mlflow")
def test_mlflow_tracking_uri_wins_over_the_run_directorys_store(mlflow_env, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/elsewhere.db")
    write(mlflow_env, "mlflow")
    [(run, got)] = mlflow_runs(tmp_path / "elsewhere.db")
    assert got == EXPECTED and not (mlflow_env / "mlflow.db").exists()


def test_the_config_flattens_into_dotted_params():
    assert sinks.flat_params({"a": {"b": 1, "c": {"d": "x"}, "e": [1, 2], "f": {}}, "g": None}) == {
        "a.b": "1", "a.c.d": "x", "a.e": "[1, 2]", "a.f": "{}", "g": "null"}


def wandb_steps(run_file) -> dict[int, dict[str, float]]:
    got = {}
    for history in wandb_history(run_file.read_bytes()):
        got[int(history.pop("_step"))] = {k: v for k, v in history.items() if not k.startswith("_")}
    return got


@needs("wandb")
def test_wandb_offline_run_files_hold_every_key(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network: the run is written for a later `wandb sync`
    monkeypatch.setenv("WANDB_SILENT", "true")
    write(tmp_path, "wandb")
    [run_file] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    assert wandb_steps(run_file) == EXPECTED


@needs("wandb")
def test_a_resumed_run_continues_its_wandb_run(tmp_path, monkeypatch):
    """Offline, each invocation writes a directory of its own; both hold the same run id (`wandb sync` makes them one run)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    write(tmp_path, "wandb")
    write(tmp_path, "wandb", RESUMED)
    run_files = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 2 and len({path.stem for path in run_files}) == 1, run_files  # run-<id>.wandb
    assert {**wandb_steps(run_files[0]), **wandb_steps(run_files[1])} == EXPECTED_RESUMED


def wandb_history(data: bytes) -> list[dict[str, float]]:
    """The history rows of a .wandb file: a LevelDB-style log (32 KiB blocks of CRC, length, type records)
    of `Record` protobufs, after a 7-byte header."""
    from wandb.proto import wandb_internal_pb2

    assert data[:4] == b":W&B"
    rows, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                rows.append({"/".join(item.nested_key) or item.key: float(item.value_json) for item in record.history.item})
    return rows


def test_a_tracker_whose_package_is_missing_fails_check_with_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(sinks.importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    [problem] = sink_problems(["jsonl", "tensorboard", "wandb"], RUN_DIR) if real("tensorboard") else sink_problems(["wandb"], RUN_DIR)
    assert "logging.sinks names wandb" in problem and "pip install wandb" in problem and "remove wandb from logging.sinks" in problem
    from asyncgrpo.commands.train import preflight

    with pytest.raises(ConfigError, match="pip install wandb"):
        preflight(load_config(None, ["logging.sinks=[jsonl, wandb]", "run.name=sinks-missing"]))


@needs("mlflow")
def test_mlflows_store_in_the_run_directory_needs_sqlalchemy_and_alembic_a_tracking_uri_does_not(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(sinks.importlib.util, "find_spec", lambda name, *a: None if name in ("sqlalchemy", "alembic") else real(name, *a))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    [problem] = sink_problems(["mlflow"], RUN_DIR)
    assert "logging.sinks names mlflow, but sqlalchemy and alembic are not installed" in problem
    assert "`pip install sqlalchemy alembic`" in problem
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert sink_problems(["mlflow"], RUN_DIR) == []


def test_an_unknown_sink_is_a_config_error_naming_the_choices():
    with pytest.raises(ConfigError, match="logging.sinks"):
        load_config(None, ["logging.sinks=[jsonl, neptune]"])


TRACKIO_READER = """
import json, sys
from trackio.sqlite_storage import SQLiteStorage
print(json.dumps([SQLiteStorage.get_runs("asyncgrpo-test"), SQLiteStorage.get_logs("asyncgrpo-test", "sinktest")]))
"""


def trackio_runs(store):
    """The runs of project asyncgrpo-test in the trackio store `store`, and run sinktest's values by step, read as a
    user would: trackio imported with TRACKIO_DIR=store (in a process of its own, since trackio reads it at import)."""
    import json
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", TRACKIO_READER], env={**os.environ, "TRACKIO_DIR": str(store)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    runs, logs = json.loads(proc.stdout.strip().splitlines()[-1])
    return runs, {row.pop("step"): {k: v for k, v in row.items() if k != "timestamp"} for row in logs}


@pytest.fixture
def trackio_env(tmp_path, monkeypatch):
    monkeypatch.delenv("TRACKIO_DIR", raising=False)
    for run in ("a", "b"):
        (tmp_path / run).mkdir()
    return tmp_path


@needs("trackio")
def test_trackio_writes_its_store_in_the_run_directory_each_run_its_own(trackio_env):
    """trackio reads TRACKIO_DIR once per process: two runs in one process still get a store each, in their run directory."""
    write(trackio_env / "a", "trackio")
    write(trackio_env / "b", "trackio", RESUMED)
    assert trackio_runs(trackio_env / "a" / "trackio") == (["sinktest"], EXPECTED)
    assert trackio_runs(trackio_env / "b" / "trackio") == (["sinktest"], {step + 2: values for step, values in EXPECTED.items()})


@needs("trackio")
def test_a_resumed_run_continues_its_trackio_run(trackio_env):
    write(trackio_env / "a", "trackio")
    write(trackio_env / "a", "trackio", RESUMED)
    assert trackio_runs(trackio_env / "a" / "trackio") == (["sinktest"], EXPECTED_RESUMED)


@needs("trackio")
def test_trackio_dir_wins_over_the_run_directorys_store(trackio_env, monkeypatch):
    monkeypatch.setenv("TRACKIO_DIR", str(trackio_env / "elsewhere"))
    write(trackio_env / "a", "trackio")
    assert trackio_runs(trackio_env / "elsewhere") == (["sinktest"], EXPECTED)
    assert not (trackio_env / "a" / "trackio").exists()


@needs("trackio")
def test_a_failed_trackio_call_is_named_and_its_process_ends(trackio_env, monkeypatch):
    """trackio refuses to resume a run its store does not hold: the run's error says so; no process is left behind."""
    import json

    (trackio_env / "a" / "trackers.json").write_text(json.dumps(
        {"trackio": {"project": "asyncgrpo-test", "name": "sinktest", "dir": str(trackio_env / "a" / "trackio")}}))
    cfg = Config.model_validate({"run": {"name": "sinktest"}, "logging": {"sinks": ["trackio"], "project": "asyncgrpo-test"}})
    started = []
    real = sinks.subprocess.Popen

    def popen(*args, **kwargs):
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(sinks.subprocess, "Popen", popen)
    with pytest.raises(sinks.TrackerError, match=r"the trackio tracker of logging.sinks failed while starting \(TrackioError: "
                                                 r"trackio raised ValueError: Run 'sinktest' does not exist"):
        Trackers(cfg, trackio_env / "a")
    [process] = started
    assert process.returncode is not None



def test_a_trackio_process_that_stops_reading_cannot_block_the_run_on_a_full_pipe(tmp_path, monkeypatch):
    """The request's write is under the call's deadline too: a stuck process that no longer reads fills the pipe, and
    a log larger than the pipe's buffer must end in a named TrackioError, not a write that never returns."""
    import types

    stuck = tmp_path / "stuck_trackio.py"  # answers init, then neither reads nor exits
    stuck.write_text("import sys, time\nsys.stdin.readline()\nprint('null', flush=True)\ntime.sleep(600)\n")
    monkeypatch.setattr(sinks, "trackio_worker", types.SimpleNamespace(__file__=str(stuck)))
    monkeypatch.setattr(sinks, "TRACKIO_LOG_S", 1.0)
    monkeypatch.setattr(sinks, "TRACKIO_EXIT_S", 1.0)
    cfg = Config.model_validate({"run": {"name": "sinktest"}, "logging": {"project": "asyncgrpo-test"}})
    tracker = sinks.TrackioTracker(cfg, tmp_path, None)
    with pytest.raises(sinks.TrackioError, match=r"trackio's process \(PID \d+\) did not read log within 1 s"):
        tracker.log({f"metric_{i}": float(i) for i in range(20_000)}, 1)  # ~400 kB, over any pipe's buffer
    tracker.stop()
    assert tracker.process.returncode is not None  # killed after TRACKIO_EXIT_S

KILLED_RUN_SCRIPT = """
import pathlib, sys
from asyncgrpo.config import Config
from asyncgrpo.telemetry.sinks import Trackers
from tests.component.test_sinks import LINES
cfg = Config.model_validate({"run": {"name": "sinktest"}, "logging": {"sinks": ["trackio"], "project": "asyncgrpo-test"}})
trackers = Trackers(cfg, pathlib.Path(sys.argv[1]))
for line in LINES:
    trackers.log(line)
print(trackers.trackers["trackio"].process.pid, flush=True)
sys.stdin.read()  # until killed
"""


@needs("trackio")
def test_trackios_process_ends_with_its_run_and_keeps_what_was_logged_when_the_run_is_killed(trackio_env):
    import os
    import select
    import subprocess
    import sys

    with subprocess.Popen([sys.executable, "-c", KILLED_RUN_SCRIPT, str(trackio_env / "a")], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as run:
        try:
            pidfd = os.pidfd_open(int(run.stdout.readline()))
        finally:
            run.kill()  # SIGKILL: the run closes nothing; the trackio process sees its stdin end
    try:
        assert select.select([pidfd], [], [], 60)[0], "trackio's process outlived the killed run by 60 s"
    finally:
        os.close(pidfd)
    assert trackio_runs(trackio_env / "a" / "trackio") == (["sinktest"], EXPECTED)


class Failing:
    """A tracker whose service went away: every call raises what W&B raises then."""

    closed = 0

    ref: dict[str, str] = {}

    def __init__(self, cfg, run_dir, resume):
        pass

    def log(self, values, step):
        raise ConnectionResetError(104, "Connection reset by peer")

    def close(self):
        Failing.closed += 1
        raise ConnectionResetError(104, "Connection reset by peer")


def test_a_tracker_that_fails_is_named_closed_and_not_called_again(tmp_path, monkeypatch):
    """Issue 20: a killed W&B service ended the run as an unexpected ConnectionResetError."""
    monkeypatch.setitem(sinks.TRACKER_CLASSES, "wandb", Failing)
    cfg = Config.model_validate({"run": {"name": "sinktest"}, "logging": {"sinks": ["jsonl", "wandb"]}})
    trackers = Trackers(cfg, tmp_path)
    Failing.closed = 0
    with pytest.raises(sinks.TrackerError) as info:
        trackers.log(LINES[0])
    message = str(info.value)
    assert "the wandb tracker of logging.sinks failed while logging step 0 (ConnectionResetError" in message
    assert "W&B's service" in message and "remove wandb from logging.sinks" in message
    assert not isinstance(info.value, OSError) and Failing.closed == 1
    trackers.log(LINES[1])  # the failed tracker is gone
    assert trackers.close() == []


def test_a_tracker_that_fails_to_close_is_returned_by_name(tmp_path, monkeypatch):
    class FailsOnClose(Failing):
        def log(self, values, step):
            pass

    monkeypatch.setitem(sinks.TRACKER_CLASSES, "mlflow", FailsOnClose)
    cfg = Config.model_validate({"run": {"name": "sinktest"}, "logging": {"sinks": ["mlflow"]}})
    trackers = Trackers(cfg, tmp_path)
    trackers.log(LINES[0])
    [failure] = trackers.close()
    assert "the mlflow tracker of logging.sinks failed while closing" in str(failure)


KILLED_WANDB_SCRIPT = """
import os, pathlib, signal, sys
from asyncgrpo.config import Config
from asyncgrpo.telemetry.sinks import TrackerError, Trackers
from tests.component.test_sinks import LINES
cfg = Config.model_validate({"run": {"name": "sinktest"}, "logging": {"sinks": ["wandb"], "project": "asyncgrpo-test"}})
trackers = Trackers(cfg, pathlib.Path(sys.argv[1]))
trackers.log(LINES[0])
children = pathlib.Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()
for pid in children:  # W&B's service process: killed, as an OOM killer or a user would
    os.kill(int(pid), signal.SIGKILL)
try:
    trackers.log(LINES[1])
except TrackerError as exc:
    print("named:", exc)
print("closing:", trackers.close())
"""


@needs("wandb")
def test_a_killed_wandb_service_is_a_named_tracker_error_and_no_traceback_at_exit(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    proc = subprocess.run([sys.executable, "-c", KILLED_WANDB_SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # W&B notices the dead service when logging step 1 or, if that send was still buffered, when closing: named either way.
    assert "the wandb tracker of logging.sinks failed while" in proc.stdout, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "atexit" not in proc.stderr, proc.stderr


class Recording:
    """A tracker that keeps what it was given."""

    ref: dict[str, str] = {}
    logged: list[tuple[int, dict[str, float]]] = []

    def __init__(self, cfg, run_dir, resume):
        Recording.logged = []

    def log(self, values, step):
        Recording.logged.append((step, values))

    def close(self):
        pass


@pytest.mark.parametrize("names", ["asyncgrpo", "trl"])
def test_metric_names_trl_gives_trackers_trl_names_beside_ours(tmp_path, monkeypatch, names):
    monkeypatch.setitem(sinks.TRACKER_CLASSES, "wandb", Recording)
    cfg = Config.model_validate({"logging": {"sinks": ["wandb"], "metric_names": names}})
    trackers = Trackers(cfg, tmp_path)
    trackers.log({**LINES[1], "reward/format": 0.5, "completion/len_mean": 12, "lr": 1e-5, "kl": 0.1, "eval/reward/format": 1})
    [(step, values)] = Recording.logged
    ours = {"version": 2.0, "loss": 0.25, "reward/mean": 0.5, "eval/reward_mean": 0.75, "rollout/failed_total": 3.0,
            "reward/format": 0.5, "completion/len_mean": 12.0, "lr": 1e-5, "kl": 0.1, "eval/reward/format": 1.0}
    theirs = {"reward": 0.5, "eval_reward": 0.75, "rewards/format/mean": 0.5, "completions/mean_length": 12.0,
              "learning_rate": 1e-5, "eval_rewards/format/mean": 1.0}
    assert step == 1 and values == (ours | theirs if names == "trl" else ours)


@needs("trl")
def test_the_trl_names_are_the_ones_trls_grpo_trainer_logs():
    """Each name of the table is one GRPOTrainer logs (learning_rate and the eval_ prefix are transformers.Trainer's)."""
    from pathlib import Path

    import trl.trainer.grpo_trainer

    source = Path(trl.trainer.grpo_trainer.__file__).read_text()
    for ours, theirs in metric_names.TRL_NAMES.items():
        if theirs not in ("learning_rate", "eval_reward"):
            assert f'_metrics[mode]["{theirs}"]' in source, (ours, theirs)
    assert '_metrics[mode][f"rewards/{reward_func_name}/mean"]' in source


@needs("mlflow")
def test_a_config_value_past_mlflows_param_limit_is_cut_not_refused(mlflow_env, monkeypatch):
    import mlflow.utils.validation

    monkeypatch.setattr(mlflow.utils.validation, "MAX_PARAM_VAL_LENGTH", 10)  # MLflow's own check reads it too
    write(mlflow_env, "mlflow")
    [(run, _)] = mlflow_runs(mlflow_env / "mlflow.db")
    assert run.data.params["logging.sinks"] == '["jsonl...' and run.data.params["run.name"] == "sinktest"
