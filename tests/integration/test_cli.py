"""The command line as a user meets it: bad recipes fail fast with one paragraph, simulate --json is one object."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "asyncgrpo.commands.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("rollout.grup_size=4", "did you mean rollout.group_size?"),
        ("rollout.group_size=1", "rollout.group_size = 1"),
        ("rollout.min_group_survivors=9", "rollout.min_group_survivors = 9 exceeds rollout.group_size = 8"),
        ("model.path=/no/such/model", "model.path = '/no/such/model'"),
        ("reward.functions=[no_such_module:score]", "reward.functions[0] = 'no_such_module:score'"),
        ("reward.functions=[json:no_such_function]", "has no attribute 'no_such_function'"),
        ("data.source=no_such_file.jsonl", "data.source = 'no_such_file.jsonl'"),
        ("reward.functions=[python:my_reward]", "names a Python object passed to asyncgrpo's Python API"),
    ],
)
def test_a_bad_recipe_fails_fast_with_the_key_and_the_fix_and_no_traceback(override, expected):
    result = cli("train", "recipes/demo.yaml", override, "run.output_dir=/tmp/asyncgrpo-never-created")
    assert result.returncode == 3
    assert expected in result.stderr and "Fix:" in result.stderr
    assert "Traceback" not in result.stderr
    assert not Path("/tmp/asyncgrpo-never-created").exists()  # refused before anything is loaded or written


def test_debug_shows_the_traceback():
    result = cli("train", "recipes/demo.yaml", "rollout.group_size=1", "--debug")
    assert result.returncode == 3 and "Traceback" in result.stderr


def test_check_accepts_the_shipped_recipes():
    for recipe in ("recipes/demo.yaml", "recipes/simulate.yaml"):
        result = cli("check", recipe)
        assert result.returncode == 0, result.stderr


def test_simulate_json_prints_exactly_one_object_with_the_documented_keys():
    result = cli("simulate", "recipes/simulate.yaml", "train.max_steps=10", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)  # the whole of stdout is one JSON object
    for key in ("outcome", "stop_reason", "steps", "error", "counters", "staleness_max", "accounting",
                "virtual_time_s", "wall_time_s", "efficiency"):
        assert key in report
    assert report["outcome"] == "completed" and report["steps"] == 10
    acc = report["accounting"]
    assert acc["taken"] == acc["trained"] + acc["requeued"] + sum(acc["dropped"].values()) + acc["in_flight"] + acc["buffered"]


def test_simulate_exit_codes_follow_the_outcome():
    failed = cli("simulate", "recipes/simulate.yaml", "simulate.faults=[{error: http_400, rate: 1.0}]", "--json")
    assert failed.returncode == 1
    assert json.loads(failed.stdout)["error"]["kind"] == "generation_failures"
    assert cli("simulate", "recipes/simulate.yaml", "bogus.key=1", "--json").returncode == 3
