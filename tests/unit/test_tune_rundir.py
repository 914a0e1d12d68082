"""`asyncgrpo tune` on a directory that lacks what calibration needs: one clear paragraph naming what is
missing and how to produce it, exit code 1, no traceback, nothing written."""

from __future__ import annotations

import json

import pytest
import yaml

from asyncgrpo.commands.cli import main
from asyncgrpo.config import load_config
from asyncgrpo.rundir import CONFIG_FILE, MARKER, METRICS_FILE, TIMELINE_FILE


def run_dir(tmp_path, *, steps: int = 6, rollouts: bool = True, timeline: bool = True):
    """A run directory with `steps` recorded steps (one finished rollout per step when `rollouts`)."""
    cfg = load_config("recipes/simulate.yaml", [])
    (tmp_path / MARKER).write_text("{}")
    (tmp_path / CONFIG_FILE).write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    lines, metrics = [{"e": "start", "server": "s", "max_inflight": 4, "group_size": 2, "max_rollout_spans": 10, "step": 0, "at": 0.0}], []
    for step in range(steps):
        t = float(step)
        if rollouts:
            lines.append({"e": "rollout", "take": step, "member": 0, "start": t, "end": t + 0.5, "outcome": "finished",
                          "version": step, "tokens": 10, "server": "s"})
        lines.append({"e": "take", "take": step, "prompt": step, "end": t + 0.5, "ending": "buffered"})
        lines.append({"e": "step", "step": step, "wait": [t, t + 0.5], "train": [t + 0.5, t + 0.9], "sync": [t + 0.9, t + 1.0]})
        metrics.append({"step": step, "rollout/trained_tokens_total": 10 * (step + 1)})
    if timeline:
        (tmp_path / TIMELINE_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return tmp_path


def tune_error(capsys, path) -> str:
    assert main(["tune", str(path)]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and not captured.out
    return captured.err


def test_a_foreign_directory_is_named_as_not_a_run_directory(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    err = tune_error(capsys, tmp_path)
    assert "not an asyncgrpo run directory" in err and MARKER in err and "asyncgrpo train" in err
    assert not (tmp_path / "tuned.yaml").exists()


def test_a_missing_path_is_named(tmp_path, capsys):
    assert "is not a directory" in tune_error(capsys, tmp_path / "nowhere")


def test_a_run_without_a_timeline_says_how_to_produce_one(tmp_path, capsys):
    err = tune_error(capsys, run_dir(tmp_path, timeline=False))
    assert f"{TIMELINE_FILE} is missing" in err and "train.max_steps=20" in err


def test_too_few_steps_names_the_count_and_the_minimum(tmp_path, capsys):
    err = tune_error(capsys, run_dir(tmp_path, steps=3))
    assert "records 3 training steps" in err and "at least 5" in err


def test_a_timeline_without_rollout_spans_names_the_logging_key(tmp_path, capsys):
    err = tune_error(capsys, run_dir(tmp_path, rollouts=False))
    assert "logging.timeline_max_rollouts" in err


@pytest.mark.parametrize("text", ['{"e": "step"\n', "not json\n"])
def test_a_corrupt_timeline_line_is_named(tmp_path, capsys, text):
    path = run_dir(tmp_path)
    with (path / TIMELINE_FILE).open("a") as f:
        f.write(text)
    assert "line 20, is not JSON" in tune_error(capsys, path)


def test_a_last_line_cut_short_by_a_killed_run_is_left_out(tmp_path):
    from asyncgrpo.tuning.records import load_run

    path = run_dir(tmp_path)
    with (path / TIMELINE_FILE).open("a") as f:
        f.write('{"e": "ste')
    assert len(load_run(path).steps) == 6


def test_starting_over_removes_what_tune_wrote(tmp_path):
    """tuned.yaml and tune.png describe the old run: a fresh start in the directory (run.overwrite) removes them."""
    from asyncgrpo.rundir import clear_run

    path = run_dir(tmp_path)
    (path / "tuned.yaml").write_text("{}")
    (path / "tune.png").write_bytes(b"png")
    cleared = clear_run(path)
    assert {"tuned.yaml", "tune.png"} <= set(cleared.removed)
    assert not (path / "tuned.yaml").exists() and not (path / "tune.png").exists()


def test_only_evaluations_inside_the_training_loop_count_each_process_baseline_does_not(tmp_path):
    """A process evaluates once before its loop (at step 0, or at the step a resume starts from): no step waits on it."""
    from asyncgrpo.tuning.records import load_run

    path = run_dir(tmp_path)
    extra = [{"e": "eval", "step": 0, "span": [-2.0, -1.0]}, {"e": "eval", "step": 3, "span": [3.0, 3.5]},
             {"e": "start", "server": "s", "max_inflight": 4, "group_size": 2, "max_rollout_spans": 10, "step": 4, "at": 4.0},
             {"e": "eval", "step": 4, "span": [4.0, 4.2]}]
    with (path / TIMELINE_FILE).open("a") as f:
        f.write("".join(json.dumps(line) + "\n" for line in extra))
    assert [e["step"] for e in load_run(path).evals] == [3]
