"""The Python API as a script and a notebook use it: train, Ctrl-C, stop(), resume, errors, two runs in one process."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import sys
import threading
from pathlib import Path

import datasets
import pytest
import yaml

import asyncgrpo
from asyncgrpo import objects
from asyncgrpo.errors import ConfigError
from asyncgrpo.tasks import TASKS
from tests.integration.train_process import read_until

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("api_script.py")
QUICK = {"train.warmup_steps": 0, "eval.every_steps": 0, "checkpoint.every_steps": 0, "logging.progress": False,
         "rollout.groups_per_step": 2, "rollout.group_size": 4}


def start_script(run_dir: Path, max_steps: int) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(SCRIPT), str(run_dir), str(max_steps)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.timeout(300)
def test_a_script_trains_tiny_with_its_own_reward_function_and_a_dataset(tmp_path):
    with start_script(tmp_path, 4) as proc:
        out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    result = json.loads(out)
    assert result["outcome"] == "completed" and result["steps"] == 4 and result["metrics_steps"] == [0, 1, 2, 3]
    assert "reward/says_the_letter" in result["reward_keys"]
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    # config.yaml describes the run: the data were rows passed in (fingerprinted), not a file it did not read.
    assert saved["data"]["source"].startswith("python:train_dataset@") and saved["eval"]["source"].startswith("python:eval_dataset@")
    assert saved["reward"]["functions"] == ["python:says_the_letter"] and saved["reward"]["isolation"] == "thread"
    assert "Traceback" not in err


@pytest.mark.timeout(300)
def test_ctrl_c_inside_a_script_finishes_the_step_saves_a_checkpoint_and_raises_keyboard_interrupt(tmp_path):
    with start_script(tmp_path, 40) as proc:
        assert proc.stderr is not None
        if not read_until(proc, "step "):  # a progress line: training is under way
            pytest.fail(f"the script ended before training started (exit {proc.wait()})")
        proc.send_signal(signal.SIGINT)
        out, rest = proc.communicate(timeout=120)
    assert proc.returncode in (130, -signal.SIGINT), rest  # an uncaught KeyboardInterrupt, as any Python script
    result = json.loads(out)
    assert result["raised"] == "KeyboardInterrupt" and result["outcome"] == "interrupted" and result["stopped_by"] == "SIGINT"
    assert 4 <= result["steps"] < 40 and result["metrics_steps"] == list(range(result["steps"]))
    assert result["checkpoint"].endswith(f"step_{result['steps']:06d}") and Path(result["checkpoint"]).is_dir()
    assert "KeyboardInterrupt" in rest and "received SIGINT" in rest


def process_state(earlier: set[threading.Thread]) -> dict[str, object]:
    """What a run must leave as it found it. Threads started since `earlier` get a bounded join first (a reward call that a
    stop abandoned leaves its thread written off, and it ends when the call returns: threads.py); any still alive is a leak.
    Threads of `earlier` are not compared: an earlier test's written-off thread may end meanwhile."""
    started = [t for t in set(threading.enumerate()) - earlier if t is not threading.current_thread()]
    for thread in started:
        thread.join(30)
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    return {
        "threads_left": sorted(t.name for t in started if t.is_alive()),
        "handlers": [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)],
        "wakeup_fd": wakeup,
        "log_handlers": (list(logging.getLogger("asyncgrpo").handlers), list(logging.getLogger().handlers)),
        "objects": dict(objects._table),
    }


@pytest.mark.timeout(300)
def test_two_runs_in_one_process_stop_from_another_thread_then_resume_leaving_nothing_behind(tmp_path):
    earlier = set(threading.enumerate())
    before = process_state(earlier)
    rows = TASKS["repeat_letter"].rows(128, 0)
    calls = []

    def reward(prompts, completions, trainer_state, **kwargs):  # runs on a reward thread; stops the run once 2 steps are trained
        calls.append(threading.current_thread().name)
        if trainer_state.global_step >= 2:
            trainer.stop()
        return [float(len(c) > 1) for c in completions]

    trainer = asyncgrpo.Trainer(model="builtin:tiny", reward_funcs=[reward], train_dataset=datasets.Dataset.from_list(rows),
                                config=ROOT / "recipes/demo.yaml", **QUICK, **{"run.output_dir": str(tmp_path), "train.max_steps": 30})
    first = trainer.train()
    assert first.outcome == "interrupted" and first.stopped_by == "stop()" and 2 <= first.steps < 30
    assert first.final_checkpoint is not None and len(first.metrics) == first.steps
    assert f"interrupted by stop() after {first.steps} steps" in str(first)
    assert all(name != threading.current_thread().name for name in calls)  # the stop came from another thread
    assert process_state(earlier) == before

    # The same config and run directory continue from the checkpoint, as the CLI does.
    again = asyncgrpo.Trainer(model="builtin:tiny", reward_funcs=[reward], train_dataset=rows,
                              config=ROOT / "recipes/demo.yaml", **QUICK, **{"run.output_dir": str(tmp_path), "train.max_steps": first.steps + 2})
    second = again.train()
    assert second.outcome == "completed" and second.steps == first.steps + 2
    assert [m["step"] for m in second.metrics] == list(range(first.steps + 2))
    assert process_state(earlier) == before

    # Other rows cannot continue this run.
    with pytest.raises(ConfigError, match="rows passed to the Python API differ"):
        asyncgrpo.Trainer(model="builtin:tiny", reward_funcs=[reward], train_dataset=rows[:64], config=ROOT / "recipes/demo.yaml",
                          **QUICK, **{"run.output_dir": str(tmp_path), "train.max_steps": 40}).train()
    assert process_state(earlier) == before


@pytest.mark.timeout(300)
def test_a_failing_reward_raises_run_failed_with_the_runs_first_error(tmp_path):
    def broken(prompts, completions, **kwargs):
        raise ValueError("no grader today")

    trainer = asyncgrpo.Trainer(model="builtin:tiny", reward_funcs=[broken], config=ROOT / "recipes/demo.yaml",
                                **QUICK, **{"run.output_dir": str(tmp_path), "train.max_steps": 3})
    with pytest.raises(asyncgrpo.RunFailed) as info:
        trainer.train()
    assert "broken" in str(info.value) and "no grader today" in str(info.value)
    assert info.value.result.outcome == "failed"


@pytest.mark.timeout(300)
def test_inside_a_running_event_loop_as_in_a_notebook_the_run_gets_its_own_loop(tmp_path):
    trainer = asyncgrpo.Trainer(model="builtin:tiny", reward_funcs=["builtin:repeat_letter"], config=ROOT / "recipes/demo.yaml",
                                **QUICK, **{"run.output_dir": str(tmp_path), "train.max_steps": 2})

    async def cell() -> asyncgrpo.Result:
        return trainer.train()  # a notebook cell calls train() while the kernel's loop runs

    result = asyncio.run(cell())
    assert result.outcome == "completed" and result.steps == 2


@pytest.mark.timeout(300)
def test_an_environment_class_defined_in_the_caller_plays_episodes_in_threads(tmp_path):
    made = []

    class Echo:  # a class of the caller's, not importable by name: python:Echo, run in threads
        def __init__(self) -> None:
            made.append(self)

        def reset(self, row):
            return row["prompt"]

        def step(self, action_text):
            return "again: ", float(len(action_text) > 0), True, {}

        def close(self):
            pass

    trainer = asyncgrpo.Trainer(model="builtin:tiny", reward_funcs=[], environment_factory=Echo, config=ROOT / "recipes/demo.yaml",
                                **QUICK, **{"run.output_dir": str(tmp_path), "train.max_steps": 2, "env.max_turns": 2, "env.max_tokens": 40})
    assert trainer.config.env is not None and trainer.config.env.factory == "python:Echo"
    result = trainer.train()
    assert result.outcome == "completed" and len(made) >= 2 * 2 * 4  # every episode made its own environment
    assert all(m["reward/env"] is not None for m in result.metrics)


def test_check_and_simulate_see_the_callers_objects(tmp_path):
    def tidy(prompts, completions, **kwargs):
        return [1.0 for _ in completions]

    trainer = asyncgrpo.Trainer(reward_funcs=[tidy], train_dataset=TASKS["repeat_letter"].rows(64, 0), config=ROOT / "recipes/simulate.yaml",
                                **{"train.max_steps": 5, "run.output_dir": str(tmp_path)})
    assert "64 prompts from 64 rows" in trainer.check()
    report = trainer.simulate().report()
    assert report["outcome"] == "completed" and report["steps"] == 5
    assert objects._table == {}
