"""`asyncgrpo plot` draws a short real training run and a simulation: every PNG is written and non-empty,
and the training run's timeline agrees with its accounting too."""

from __future__ import annotations

import asyncio
import importlib.util
from collections import Counter

import pytest

from asyncgrpo.cli import main
from asyncgrpo.config import load_config
from asyncgrpo.telemetry.metrics import read_jsonl
from asyncgrpo.train import train

pytestmark = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                reason="matplotlib is not installed (pip install 'asyncgrpo[plot]')")

PNGS = {"rewards.png", "loss_kl.png", "staleness.png", "counters.png", "offpolicy.png", "timeline.png"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_pngs(directory, expected):
    names = {p.name for p in directory.glob("*.png")}
    assert expected <= names, f"missing {expected - names}"
    for path in directory.glob("*.png"):
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, f"{path} is not a drawn PNG ({len(data)} bytes)"


@pytest.mark.timeout(300)
def test_plot_draws_a_short_training_run(tmp_path, capsys):
    cfg = load_config("recipes/demo.yaml", [
        f"run.output_dir={tmp_path}", "logging.progress=false", "train.max_steps=10", "rollout.groups_per_step=3",
        "rollout.group_size=4", "eval.every_steps=5", "eval.num_prompts=4", "checkpoint.every_steps=0",
    ])
    summary = asyncio.run(train(cfg))
    assert summary.result.outcome == "completed"
    timeline = read_jsonl(tmp_path / "timeline.jsonl")
    acc = summary.accounting
    takes = Counter(line["take"] for line in timeline if line["e"] == "take")
    assert set(takes.values()) == {1} and len(takes) == acc["taken"] - acc["in_flight"]
    assert Counter(line["outcome"] for line in timeline if line["e"] == "buffered")["trained"] == acc["trained"]
    assert [line["step"] for line in timeline if line["e"] == "eval"] == [0, 5, 10]
    assert main(["plot", str(tmp_path)]) == 0
    assert_pngs(tmp_path / "plots", PNGS | {"timeline_start.png"})
    assert str(tmp_path / "plots" / "timeline.png") in capsys.readouterr().out


def test_plot_draws_a_simulation(tmp_path):
    out = tmp_path / "sim"
    assert main(["simulate", "recipes/simulate.yaml", "train.max_steps=20", "--output-dir", str(out)]) == 0
    assert main(["plot", str(out), "--out", str(tmp_path / "png")]) == 0
    assert_pngs(tmp_path / "png", PNGS | {"timeline_start.png"})


def test_plot_of_a_directory_without_metrics_says_what_to_pass(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "has no metrics.jsonl" in err and "simulate --output-dir" in err
