"""Which checkpoint a run continues from, and which recipe changes a resume accepts."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import yaml

from asyncgrpo.config import load_config
from asyncgrpo.errors import ConfigError
from asyncgrpo.training.resume import plan_resume


def make_checkpoint(run_dir: Path, step: int, overrides: list[str] = ()) -> Path:
    """The files a complete checkpoint has, each well-formed and tiny (the planner reads headers, not tensors)."""
    path = run_dir / "checkpoints" / f"step_{step:06d}"
    path.mkdir(parents=True)
    cfg = load_config(None, [f"run.output_dir={run_dir}", *overrides])
    (path / "run_config.yaml").write_text(cfg.to_yaml())
    (path / "config.json").write_text("{}")
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    (path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with zipfile.ZipFile(path / "trainer_state.pt", "w") as archive:
        archive.writestr("archive/data.pkl", b"state")
    (path / "state.json").write_text(json.dumps({"step": step, "version": step, "extra": {"done": {"0": [1, 2]}}}))
    return path


def config(run_dir: Path, *overrides: str):
    return load_config(None, [f"run.output_dir={run_dir}", *overrides])


def test_a_new_run_directory_starts_from_scratch(tmp_path):
    plan = plan_resume(config(tmp_path / "run"))
    assert plan.checkpoint is None and plan.step == 0 and plan.notes == []


def test_auto_takes_the_newest_complete_checkpoint_and_names_the_ones_it_skips(tmp_path):
    make_checkpoint(tmp_path, 3)
    make_checkpoint(tmp_path, 6)
    (make_checkpoint(tmp_path, 9) / "state.json").write_text("{not json")
    partial = make_checkpoint(tmp_path, 12)
    (partial / "trainer_state.pt").unlink()
    (tmp_path / "checkpoints" / ".tmp-step_000015-1-abc").mkdir()  # a write that was killed
    plan = plan_resume(config(tmp_path))
    assert plan.checkpoint == tmp_path / "checkpoints" / "step_000006" and plan.step == 6
    assert any("step_000012" in n and "trainer_state.pt" in n for n in plan.notes)
    assert any("step_000009" in n and "unreadable" in n for n in plan.notes)


def test_a_changed_key_that_decides_the_data_is_refused_with_its_name(tmp_path):
    make_checkpoint(tmp_path, 3)
    with pytest.raises(ConfigError) as info:
        plan_resume(config(tmp_path, "rollout.group_size=4", "data.source=builtin:addition"))
    message = str(info.value)
    assert "rollout.group_size: 8 in the checkpoint, 4 now" in message
    assert "data.source" in message and "run.overwrite=true" in message


def test_compatible_changes_are_allowed_and_reported(tmp_path):
    make_checkpoint(tmp_path, 3)
    plan = plan_resume(config(tmp_path, "train.lr=0.001", "train.max_steps=500"))
    assert plan.checkpoint is not None
    assert "train.lr: 0.0001 -> 0.001" in plan.changed and "train.max_steps: 200 -> 500" in plan.changed


def test_never_refuses_a_used_run_directory_unless_told_to_overwrite(tmp_path):
    make_checkpoint(tmp_path, 3)
    with pytest.raises(ConfigError, match="run.overwrite=true"):
        plan_resume(config(tmp_path, "checkpoint.resume=never"))
    assert plan_resume(config(tmp_path, "checkpoint.resume=never", "run.overwrite=true")).checkpoint is None


def test_an_explicit_checkpoint_path_must_be_complete(tmp_path):
    good = make_checkpoint(tmp_path / "a", 3)
    assert plan_resume(config(tmp_path / "b", f"checkpoint.resume={good}")).checkpoint == good
    (good / "state.json").unlink()
    with pytest.raises(ConfigError, match="state.json is missing"):
        plan_resume(config(tmp_path / "b", f"checkpoint.resume={good}"))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: (p / "model.safetensors").write_bytes(b""), "too short for a safetensors header"),
        (lambda p: _truncate(p / "model.safetensors", 20), "its header claims"),
        (lambda p: _truncate(p / "model.safetensors", -3), "truncated or padded"),
        (lambda p: _truncate(p / "trainer_state.pt", -10), "trainer_state.pt is not a whole archive"),
        (lambda p: (p / "trainer_state.pt").write_bytes(b""), "trainer_state.pt is not a whole archive"),
        (lambda p: (p / "state.json").write_text(json.dumps({"step": 6, "version": 6, "extra": {"done": [1]}})), "ledger"),
    ],
)
def test_a_damaged_newest_checkpoint_is_skipped_for_the_older_intact_one(tmp_path, damage, reason):
    make_checkpoint(tmp_path, 3)
    damage(make_checkpoint(tmp_path, 6))
    plan = plan_resume(config(tmp_path))
    assert plan.checkpoint == tmp_path / "checkpoints" / "step_000003"
    assert len(plan.notes) == 1 and "step_000006" in plan.notes[0] and reason in plan.notes[0]


def test_checkpoints_none_of_which_is_intact_are_refused_naming_each(tmp_path):
    (make_checkpoint(tmp_path, 3) / "model.safetensors").write_bytes(b"")
    _truncate(make_checkpoint(tmp_path, 6) / "trainer_state.pt", -4)
    with pytest.raises(ConfigError) as info:
        plan_resume(config(tmp_path))
    message = str(info.value)
    assert "none is intact" in message and "step_000003" in message and "step_000006" in message
    assert "run.overwrite=true" in message


def _truncate(file: Path, keep: int) -> None:
    """Keep the first `keep` bytes (or all but the last -keep)."""
    data = file.read_bytes()
    file.write_bytes(data[:keep])


@pytest.mark.parametrize(("saved", "now", "line"), [
    (["train.lora.r=4"], [], "train.lora.r: 4 in the checkpoint, None now"),
    ([], ["train.lora.r=4"], "train.lora.r: None in the checkpoint, 4 now"),
    (["train.lora.r=4"], ["train.lora.r=8"], "train.lora.r: 4 in the checkpoint, 8 now"),
    (["train.lora.r=4"], ["train.lora.r=4", "train.lora.alpha=8"], "train.lora.alpha: 32.0 in the checkpoint, 8.0 now"),
    (["train.lora.r=4"], ["train.lora.r=4", "train.lora.target_modules=[q_proj]"], "train.lora.target_modules: 'all-linear' in"),
])
def test_adding_removing_or_reshaping_lora_on_resume_is_refused_before_the_model_loads(tmp_path, saved, now, line):
    checkpoint = make_checkpoint(tmp_path, 3, saved)
    with pytest.raises(ConfigError) as info:
        plan_resume(config(tmp_path, *now))
    assert line in str(info.value) and f"model.path={checkpoint}" in str(info.value)


def test_a_lora_run_resumes_with_another_adapter_dropout(tmp_path):
    make_checkpoint(tmp_path, 3, ["train.lora.r=4"])
    plan = plan_resume(config(tmp_path, "train.lora.r=4", "train.lora.dropout=0.1"))
    assert plan.step == 3 and plan.changed == ["train.lora.dropout: 0.0 -> 0.1"]


def test_an_explicit_checkpoint_of_this_run_wins_over_overwrite_and_nothing_is_removed(tmp_path):
    """`make demo ARGS=checkpoint.resume=PATH` passes run.overwrite=true too: the user asked for that checkpoint (issue 20, item 14)."""
    path = make_checkpoint(tmp_path, 3)
    plan = plan_resume(config(tmp_path, "run.overwrite=true", f"checkpoint.resume={path}"))
    assert plan.checkpoint == path and plan.step == 3 and not plan.start_over
    [note] = plan.notes
    assert "checkpoint.resume" in note and "run.overwrite=true" in note and "nothing in" in note


def test_an_explicit_checkpoint_of_another_run_with_overwrite_continues_it_in_a_cleared_directory(tmp_path):
    path = make_checkpoint(tmp_path / "other", 3, [f"run.output_dir={tmp_path / 'other'}"])
    plan = plan_resume(config(tmp_path / "run", "run.overwrite=true", f"checkpoint.resume={path}"))
    assert plan.checkpoint == path and plan.start_over
    assert "removed" in plan.notes[0] and "run.overwrite=true" in plan.notes[0]


def test_a_checkpoint_saved_before_the_simulator_keys_moved_reports_no_change(tmp_path):
    path = make_checkpoint(tmp_path, 3, ["simulate.step_time_s=2"])
    old = yaml.safe_load((path / "run_config.yaml").read_text())
    simulate = old.pop("simulate")
    old["train"].update(step_time_s=simulate.pop("step_time_s"), token_time_s=simulate.pop("token_time_s"))
    old["distill"].update(simulated_latency_s=simulate.pop("teacher_latency_s"), simulated_error_rate=simulate.pop("teacher_error_rate"))
    old["generation"]["scripted"] = simulate
    (path / "run_config.yaml").write_text(yaml.safe_dump(old))
    assert plan_resume(config(tmp_path, "simulate.step_time_s=2")).changed == []
    assert plan_resume(config(tmp_path, "simulate.step_time_s=5")).changed == ["simulate.step_time_s: 2.0 -> 5.0"]
