"""A failure injected at each stage of `asyncgrpo train` ends as one paragraph and an exit code, never a raw
traceback; when a step completed, a checkpoint of it is on disk. In-process (`cli.main`), so each stage can be
made to fail exactly where the test says."""

from __future__ import annotations

import errno
import warnings

import pytest

import asyncgrpo.commands.train
import asyncgrpo.models.loading
from asyncgrpo.commands.cli import main
from asyncgrpo.generation.local import LocalEngine
from asyncgrpo.telemetry.metrics import MetricsWriter
from asyncgrpo.training import checkpoint
from asyncgrpo.training.trainer import TorchTrainer

QUICK = ["logging.progress=false", "rollout.groups_per_step=2", "rollout.group_size=2", "train.max_steps=4",
         "eval.num_prompts=4", "checkpoint.every_steps=2"]


def fail_on_call(n: int, error: BaseException):
    """A replacement for a function or method whose n-th call (1-based) raises `error`; others run the original."""

    def install(monkeypatch, owner, name):
        original = getattr(owner, name)
        calls = []

        def wrapper(*args, **kwargs):
            calls.append(1)
            if len(calls) == n:
                raise error
            return original(*args, **kwargs)

        async def async_wrapper(*args, **kwargs):
            calls.append(1)
            if len(calls) == n:
                raise error
            return await original(*args, **kwargs)

        import inspect

        monkeypatch.setattr(owner, name, async_wrapper if inspect.iscoroutinefunction(original) else wrapper)

    return install


STAGES = {
    # stage: (what to break, which call, the error, the exit code, words the paragraph must hold, steps saved)
    "model load": (asyncgrpo.models.loading, "load_model_and_tokenizer", 1, RuntimeError("weights unreadable"), 1, "unexpected RuntimeError", 0),
    "baseline eval": (asyncgrpo.commands.train, "evaluate", 1, RuntimeError("eval exploded"), 1, "unexpected RuntimeError", 0),
    "a step": (TorchTrainer, "train_step", 3, FloatingPointError("loss is nan"), 1, "error (step_error): Training step 2 failed", 2),
    "a checkpoint write": (checkpoint, "save_checkpoint", 1, RuntimeError("serializer bug"), 1,
                           "error (step_report): Step 1 trained, then failed", 2),
    "a metrics write": (MetricsWriter, "write", 2, OSError(errno.EIO, "Input/output error"), 1, "error (disk): After step 2, cannot write", 2),
    "weight publication": (LocalEngine, "load_weights", 3, RuntimeError("engine gone"), 1,
                           "error (weight_sync): Step 2 trained, then failed while publishing", 3),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", list(STAGES))
def test_a_failure_at_each_stage_is_one_paragraph_and_keeps_completed_steps(tmp_path, monkeypatch, capsys, stage):
    owner, name, call, error, code, words, saved = STAGES[stage]
    fail_on_call(call, error)(monkeypatch, owner, name)
    exit_code = main(["train", "recipes/demo.yaml", f"run.output_dir={tmp_path}", "eval.every_steps=2", *QUICK])
    err = capsys.readouterr().err
    assert exit_code == code and words in err, err
    assert "Traceback" not in err
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) if (tmp_path / "checkpoints").exists() else []
    assert (checkpoints[-1] if checkpoints else None) == (f"step_{saved:06d}" if saved else None)
    assert (tmp_path / "error.txt").is_file()


def test_a_recipe_that_is_not_utf8_is_one_line(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(b"run:\n  name: \xff\xfe\n")
    assert main(["train", str(recipe)]) == 3
    err = capsys.readouterr().err
    assert "is not UTF-8 text (byte 0xff at offset 13)" in err and "Traceback" not in err


@pytest.mark.timeout(300)
@pytest.mark.parametrize("reward", ["exits", "interrupts"])
def test_a_reward_that_raises_system_exit_or_keyboard_interrupt_is_a_reward_error(tmp_path, capsys, reward):
    exit_code = main(["train", "recipes/demo.yaml", f"run.output_dir={tmp_path}", "eval.every_steps=0",
                      f"reward.functions=[tests.integration.blocking_rewards:{reward}]", *QUICK])
    err = capsys.readouterr().err
    assert exit_code == 1 and "error (reward_error)" in err and reward in err, err
    assert "Traceback" not in err


@pytest.mark.timeout(300)
def test_an_environment_that_raises_system_exit_fails_the_run_with_a_diagnostic_never_exit_0(tmp_path, capsys):
    exit_code = main(["train", "recipes/demo.yaml", f"run.output_dir={tmp_path}", "eval.every_steps=0", "reward.functions=[]",
                      "env.factory=tests.envs:Exits", *QUICK])
    err = capsys.readouterr().err
    assert exit_code == 1 and "error (generation_failures)" in err and "tests.envs:Exits" in err and "SystemExit" in err, err
    assert "Traceback" not in err and (tmp_path / "error.txt").is_file()


@pytest.mark.timeout(300)
def test_an_async_reward_that_blocks_its_loop_fails_at_reward_timeout_s_naming_it(tmp_path, capsys):
    exit_code = main(["train", "recipes/demo.yaml", f"run.output_dir={tmp_path}", "eval.every_steps=0", "reward.timeout_s=1",
                      "reward.functions=[tests.integration.blocking_rewards:sleeps_on_the_loop]", *QUICK])
    err = capsys.readouterr().err
    assert exit_code == 1 and "error (reward_error)" in err, err
    assert "'sleeps_on_the_loop' did not return within reward.timeout_s = 1 s" in err and "Traceback" not in err


@pytest.mark.timeout(300)
def test_a_tracker_that_cannot_start_leaves_no_file_of_the_run_open(tmp_path, monkeypatch, capsys):
    """The trackers started last, after the run's records were opened, and a failing start left those open."""
    import gc

    from asyncgrpo.telemetry import sinks

    class Refused:
        def __init__(self, cfg, run_dir, resume):
            raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setitem(sinks.TRACKER_CLASSES, "tensorboard", Refused)
    exit_code = main(["train", "recipes/demo.yaml", f"run.output_dir={tmp_path}", "eval.every_steps=0", "logging.sinks=[jsonl, tensorboard]", *QUICK])
    err = capsys.readouterr().err
    assert exit_code == 1 and "the tensorboard tracker of logging.sinks failed while starting" in err and "Traceback" not in err, err
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        gc.collect()
    assert not [w for w in caught if str(tmp_path) in str(w.message)], [str(w.message) for w in caught]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fails_in", ["log", "close"])
def test_a_tracker_that_loses_its_service_is_a_named_tracker_diagnostic(tmp_path, monkeypatch, capsys, fails_in):
    """A killed W&B service raised ConnectionResetError: a disk error or an 'unexpected' one before (issue 20)."""
    from asyncgrpo.telemetry import sinks

    class Lost:
        ref: dict[str, str] = {}  # nothing to reopen on resume

        def __init__(self, cfg, run_dir, resume):
            pass

        def log(self, values, step):
            if fails_in == "log" and step == 1:
                raise ConnectionResetError(104, "Connection reset by peer")

        def close(self):
            if fails_in == "close":
                raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setitem(sinks.TRACKER_CLASSES, "tensorboard", Lost)
    exit_code = main(["train", "recipes/demo.yaml", f"run.output_dir={tmp_path}", "eval.every_steps=0", "logging.sinks=[jsonl, tensorboard]", *QUICK])
    err = capsys.readouterr().err
    saved = 2 if fails_in == "log" else 4
    assert exit_code == 1 and f"error (tracker): After step {saved}, the tensorboard tracker of logging.sinks failed" in err, err
    assert "Traceback" not in err and "unexpected" not in err and "cannot write" not in err
    assert (tmp_path / "checkpoints" / f"step_{saved:06d}").is_dir() and (tmp_path / "error.txt").is_file()
