"""Where step metrics go: `metrics.jsonl` always, plus the trackers named in `logging.sinks`.

    logging:
      sinks: [jsonl, tensorboard, wandb, mlflow, trackio]   # any combination; jsonl is always written

- tensorboard: event files in `<run dir>/tensorboard` (torch's SummaryWriter; needs `tensorboard`).
- wandb: a Weights & Biases run in `<run dir>/wandb`, project `logging.project`; `WANDB_MODE=offline`
  works with no network (`wandb sync` uploads it later).
- mlflow: a run in experiment `logging.project` at `MLFLOW_TRACKING_URI`, default the sqlite store
  `<run dir>/mlflow.db` (artifact root `<run dir>/mlartifacts`), with the config as params (dotted keys:
  `rollout.group_size`). It needs `sqlalchemy` and `alembic` beside mlflow-skinny (the `sinks` extra has
  them) and no environment variable: `mlflow ui --backend-store-uri sqlite:///<run dir>/mlflow.db` reads it.
- trackio: a run in project `logging.project` in the trackio store `<run dir>/trackio` (`TRACKIO_DIR`, when
  set, wins), read with `TRACKIO_DIR=<run dir>/trackio trackio show`. trackio reads its store's folder once
  per process, when imported, so it runs in a process of its own (telemetry/trackio_worker.py).

A resumed run continues its tracker runs: `<run dir>/trackers.json` records each tracker's run
(W&B's run id, MLflow's tracking URI and run id, trackio's project, run name and store) when it starts,
and a resume (which keeps the file; a fresh start removes it) reopens them: W&B `id=..., resume="allow"`,
MLflow the same run id (set RUNNING again; its params stay the first invocation's: MLflow refuses a
changed param, and the resume's changes are in its log), trackio `resume="must"`. Steps logged after the
checkpoint a resume starts from are logged again by the resumed run (metrics.jsonl keeps only the new
ones); each tracker shows a repeated step its own way (W&B drops a step below its last, MLflow keeps both).

Invariants:
- A tracker whose package is missing is a config error (`sink_problems`, called by preflight,
  before any model loads), naming the package and its pip command; never a silent no-op.
- Every step, every tracker gets every metric key of the metrics line that has a value (the
  key set is fixed: telemetry/metrics.py); a null (an eval metric before its first evaluation)
  is left out, since trackers hold numbers. The x axis is `step` (0-based, as in metrics.jsonl;
  checkpoints/step_K follows the line of step K-1, whose `version` is K: DESIGN.md §5).
  `logging.metric_names: trl` adds TRL GRPOTrainer's name of each key that has one (metric_names.TRL_NAMES).
- A tracker's error is the run's diagnostic (kind `tracker`), like a failed write of metrics.jsonl:
  `TrackerError` names the sink, what it was doing, the error and the fix, whatever the library
  raised (a killed W&B service raises ConnectionResetError, which must not read as a disk error or
  an unexpected one). A failed tracker is closed at once and not called again; a failure while
  closing is returned by `close()` for the run to report. W&B is torn down on close, so its own
  exit hook never retries a dead service and prints a raw traceback at exit.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from asyncgrpo.atomic import replace_file
from asyncgrpo.config import Config
from asyncgrpo.errors import AsyncGRPOError
from asyncgrpo.metric_names import trl_name
from asyncgrpo.rundir import MLFLOW_ARTIFACTS_DIR, MLFLOW_STORE, TRACKER_RUNS_FILE, TRACKIO_STORE_DIR
from asyncgrpo.telemetry import trackio_worker

# sink -> the (module to import, pip package) pairs it needs
TRACKERS: dict[str, list[tuple[str, str]]] = {
    "tensorboard": [("tensorboard", "tensorboard")],
    "wandb": [("wandb", "wandb")],
    "mlflow": [("mlflow", "mlflow-skinny")],
    "trackio": [("trackio", "trackio")],
}
# MLflow's store in the run directory (when MLFLOW_TRACKING_URI is not set) is a sqlite database: SQLAlchemy's, laid out by alembic.
MLFLOW_STORE_PACKAGES = [("sqlalchemy", "sqlalchemy"), ("alembic", "alembic")]


def sink_problems(sinks: Iterable[str], run_dir: Path) -> list[str]:
    """One paragraph per tracker in `sinks` with a package this Python cannot import, or whose store in `run_dir`
    it cannot name."""
    problems = []
    for sink in sinks:
        if sink == "mlflow" and not os.environ.get("MLFLOW_TRACKING_URI") and (odd := sorted(set("?%") & set(str(run_dir.resolve())))):
            # SQLAlchemy's sqlite URI ends the file name at '?' and decodes '%xx'; MLflow makes the parent folder of
            # the URI's text as it is, so no escaping puts the store, and nothing else, where it belongs.
            problems.append(
                f"logging.sinks names mlflow, whose store would be {run_dir.resolve() / MLFLOW_STORE}, but that path holds "
                f"{' and '.join(repr(c) for c in odd)}, which MLflow's sqlite URI cannot name (it would write somewhere "
                f"else). Fix: choose a run.directory without '?' or '%', or set MLFLOW_TRACKING_URI to a store of your own."
            )
        if sink not in TRACKERS:
            continue
        needed = TRACKERS[sink] + (MLFLOW_STORE_PACKAGES if sink == "mlflow" and not os.environ.get("MLFLOW_TRACKING_URI") else [])
        if missing := [package for module, package in needed if importlib.util.find_spec(module) is None]:
            problems.append(
                f"logging.sinks names {sink}, but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed in "
                f"this Python ({sys.executable}). Fix: `pip install {' '.join(missing)}` (or `pip install 'asyncgrpo[sinks]'` "
                f"for every tracker), or remove {sink} from logging.sinks; metrics.jsonl is written either way."
            )
    return problems


# sink -> what to check when it fails
TRACKER_FIXES: dict[str, str] = {
    "tensorboard": "check that the run directory's tensorboard/ folder is writable",
    "wandb": "check that W&B's service is running and reachable (its log is wandb/debug-internal.log in the run directory)",
    "mlflow": "check that MLFLOW_TRACKING_URI's server (or the run directory's mlflow.db) answers",
    "trackio": "check trackio's store (the run directory's trackio/ folder, or TRACKIO_DIR) and its messages above",
}


class TrackerError(AsyncGRPOError):
    """A tracker of `logging.sinks` failed: one paragraph naming it, what it was doing, the error and the fix."""

    def __init__(self, sink: str, action: str, exc: BaseException) -> None:
        self.sink = sink
        super().__init__(
            f"the {sink} tracker of logging.sinks failed while {action} ({type(exc).__name__}: {exc}); metrics.jsonl holds "
            f"every step written so far. Fix: {TRACKER_FIXES[sink]}, or remove {sink} from logging.sinks; then run the "
            f"same command again (it continues from the newest checkpoint)."
        )


class Tracker(Protocol):
    ref: dict[str, str]  # what reopens this tracker's run on resume (trackers.json); empty: nothing to reopen

    def log(self, values: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    ref: dict[str, str] = {}  # a resume adds an event file beside the earlier ones: the same run to TensorBoard

    def __init__(self, cfg: Config, run_dir: Path, resume: dict[str, str] | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, cfg: Config, run_dir: Path, resume: dict[str, str] | None) -> None:
        import wandb

        run_id = resume["id"] if resume and resume.get("project") == cfg.logging.project else None
        self.run = wandb.init(project=cfg.logging.project, name=cfg.run.name, dir=str(run_dir), config=cfg.model_dump(mode="json"),
                              id=run_id, resume="allow" if run_id else None)
        self.ref = {"project": cfg.logging.project, "id": self.run.id}

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        import wandb

        try:
            self.run.finish()
        finally:
            wandb.teardown()  # unregisters W&B's exit hook, which would retry a dead service at exit and print a traceback


class MlflowTracker:
    def __init__(self, cfg: Config, run_dir: Path, resume: dict[str, str] | None) -> None:
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        store = None
        if not uri:  # the run directory's own store, made here: see own_store
            uri = f"sqlite:///{(run_dir / MLFLOW_STORE).resolve()}"
            store = own_store(uri, run_dir / MLFLOW_ARTIFACTS_DIR)
        self.client = MlflowClient(tracking_uri=uri)
        if resume and resume.get("tracking_uri") == uri:
            self.run_id = self.client.get_run(resume["run_id"]).info.run_id  # a run deleted from the store: MLflow's error, named
            self.client.update_run(self.run_id, status="RUNNING")
        else:  # a fresh run (or a resume logging to another store): a new run, with the config as its params
            experiment = self.client.get_experiment_by_name(cfg.logging.project)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else (store or self.client).create_experiment(cfg.logging.project))
            self.run_id = self.client.create_run(experiment_id, run_name=cfg.run.name).info.run_id
            self.log_params(cfg)
        self.ref = {"tracking_uri": uri, "run_id": self.run_id}

    def log_params(self, cfg: Config) -> None:
        """The config as params, one per leaf, dotted keys; a value past MLflow's length limit is cut, ending in `...`."""
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        params = [Param(key, value if len(value) <= MAX_PARAM_VAL_LENGTH else value[:MAX_PARAM_VAL_LENGTH - 3] + "...")
                  for key, value in flat_params(cfg.model_dump(mode="json")).items()]
        for start in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[start:start + MAX_PARAMS_TAGS_PER_BATCH])

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, value, now, step) for key, value in values.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def own_store(uri: str, artifacts: Path) -> Any:
    """MLflow's sqlite store at `uri`, with its tables (made when the file is new) and the artifact root `artifacts`.

    MLflow keeps one database engine per URI for the whole process; the connections it pools stay open on the
    file they opened, so after a fresh start (rundir.clear_run) deleted the file they would go on reading and
    writing the deleted one. The store is made, its engine's pool emptied, and made again: the second one opens the
    file now at `uri`, and lays out its tables when it is new. Made here rather than by MlflowClient, whose store
    puts the artifact root in the working directory (./mlruns): an experiment this store creates keeps its
    artifacts in `artifacts/<experiment id>`, in the run directory.
    """
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    SqlAlchemyStore(uri, artifacts.resolve().as_uri()).engine.dispose()
    return SqlAlchemyStore(uri, artifacts.resolve().as_uri())


def flat_params(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as `{dotted.key: text}`: a mapping opens into its keys, any other value is JSON text (a string as is)."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flat_params(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value)
    return flat


TRACKIO_START_S = 300.0  # importing trackio and starting (or reopening) its run
TRACKIO_LOG_S = 60.0  # trackio.log queues the values: the answer comes at once unless the process is stuck
TRACKIO_FINISH_S = 600.0  # trackio.finish flushes what is queued, and uploads it when a Space is configured
TRACKIO_EXIT_S = 60.0  # after finish, or once its stdin is closed, the process ends; past this it is killed


class TrackioError(Exception):
    """trackio's process failed: trackio raised (its error type and text), exited, or did not answer in time."""


class TrackioTracker:
    """trackio, in a process of its own (telemetry/trackio_worker.py, whose docstring says why), with its store in
    `<run dir>/trackio`, or in TRACKIO_DIR when that is set."""

    def __init__(self, cfg: Config, run_dir: Path, resume: dict[str, str] | None) -> None:
        store = os.environ.get("TRACKIO_DIR") or str((run_dir / TRACKIO_STORE_DIR).resolve())
        self.ref = {"project": cfg.logging.project, "name": cfg.run.name, "dir": store}
        # Its own session: a Ctrl-C at the terminal reaches only the run, which then finishes the trackio run itself.
        self.process = subprocess.Popen([sys.executable, trackio_worker.__file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        env={**os.environ, "TRACKIO_DIR": store}, start_new_session=True)
        self.pending = b""
        assert self.process.stdin is not None
        # Written without blocking, under each call's deadline: a process stuck without reading fills the pipe.
        os.set_blocking(self.process.stdin.fileno(), False)
        try:
            self.call(TRACKIO_START_S, "init", {"project": cfg.logging.project, "name": cfg.run.name,
                                                "config": cfg.model_dump(mode="json"), "resume": "must" if resume == self.ref else "never"})
        except BaseException:
            self.stop()
            raise

    def log(self, values: dict[str, float], step: int) -> None:
        self.call(TRACKIO_LOG_S, "log", values, step)

    def close(self) -> None:
        try:
            self.call(TRACKIO_FINISH_S, "finish")
        finally:
            self.stop()

    def call(self, seconds: float, *request: Any) -> None:
        """Send one request and wait for its answer, both within `seconds`. Raises TrackioError."""
        assert self.process.stdin is not None and self.process.stdout is not None
        deadline = time.monotonic() + seconds
        unsent = memoryview(json.dumps(request).encode() + b"\n")
        while unsent:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([], [self.process.stdin], [], remaining)[1]:
                raise TrackioError(f"trackio's process (PID {self.process.pid}) did not read {request[0]} within {seconds:.0f} s")
            try:
                unsent = unsent[os.write(self.process.stdin.fileno(), unsent):]
            except BlockingIOError:
                continue  # the room select saw was smaller than a write can take at once: wait for more
            except BrokenPipeError:
                raise self.exited() from None
        while b"\n" not in self.pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self.process.stdout], [], [], remaining)[0]:
                raise TrackioError(f"trackio's process (PID {self.process.pid}) did not answer {request[0]} within {seconds:.0f} s")
            chunk = os.read(self.process.stdout.fileno(), 65536)
            if not chunk:
                raise self.exited()
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        error = json.loads(line)
        if error is not None:
            raise TrackioError(f"trackio raised {error[0]}: {error[1]}")

    def exited(self) -> TrackioError:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(TRACKIO_EXIT_S)
        return TrackioError(f"trackio's process (PID {self.process.pid}) exited with code {self.process.returncode}; "
                            f"its messages are above")

    def stop(self) -> None:
        """End the process: its stdin closed (which ends it), killed if still running after TRACKIO_EXIT_S."""
        assert self.process.stdin is not None and self.process.stdout is not None
        with contextlib.suppress(BrokenPipeError):
            self.process.stdin.close()
        try:
            self.process.wait(TRACKIO_EXIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()


def earlier_runs(path: Path) -> dict[str, dict[str, str]]:
    """The tracker runs an earlier invocation in this run directory started (trackers.json); none on a fresh start."""
    if not path.exists():
        return {}
    try:
        runs = json.loads(path.read_text())
        if not isinstance(runs, dict) or not all(isinstance(ref, dict) for ref in runs.values()):
            raise ValueError("not an object of tracker runs")
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"{path} cannot be read ({type(exc).__name__}: {exc}); it records the tracker runs a resume continues; "
            f"delete it to start new tracker runs (metrics.jsonl and the checkpoints are not affected)"
        ) from exc
    return runs


TRACKER_CLASSES: dict[str, type] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
    "trackio": TrackioTracker,
}


class Trackers:
    """The trackers of `logging.sinks` (besides metrics.jsonl, which MetricsWriter writes)."""

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        self.trackers: dict[str, Tracker] = {}
        self.trl_names = cfg.logging.metric_names == "trl"
        runs_file = run_dir / TRACKER_RUNS_FILE
        runs: dict[str, dict[str, str]] = {}
        for name in dict.fromkeys(cfg.logging.sinks):
            if name in TRACKER_CLASSES:
                try:
                    runs = runs or earlier_runs(runs_file)
                    self.trackers[name] = TRACKER_CLASSES[name](cfg, run_dir, runs.get(name))
                    if self.trackers[name].ref:
                        runs[name] = self.trackers[name].ref
                        replace_file(runs_file, json.dumps(runs, indent=1).encode())
                except Exception as exc:  # noqa: BLE001 - any library's error: named, and the started ones closed
                    self.close()
                    raise TrackerError(name, "starting", exc) from exc

    def log(self, line: dict[str, Any]) -> None:
        """One metrics line: every key with a numeric value. A tracker's failure raises TrackerError; it is closed first."""
        if not self.trackers:
            return
        values = {k: float(v) for k, v in line.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        if self.trl_names:
            values |= {theirs: value for key, value in values.items() if (theirs := trl_name(key)) is not None}
        for name, tracker in list(self.trackers.items()):
            try:
                tracker.log(values, line["step"])
            except Exception as exc:  # noqa: BLE001 - any library's error: named (the sinks' failure policy)
                del self.trackers[name]
                with contextlib.suppress(Exception):  # the first error is the one to report
                    tracker.close()
                raise TrackerError(name, f"logging step {line['step']}", exc) from exc

    def close(self) -> list[TrackerError]:
        """Close every tracker; returns the failures, each named (the run reports the first)."""
        failures = []
        for name, tracker in self.trackers.items():
            try:
                tracker.close()
            except Exception as exc:  # noqa: BLE001 - any library's error: named
                failures.append(TrackerError(name, "closing", exc))
        self.trackers = {}
        return failures
