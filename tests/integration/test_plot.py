"""`asyncgrpo plot` draws a short real training run and a simulation: every PNG is written and non-empty,
and the training run's timeline agrees with its accounting too."""

from __future__ import annotations

import asyncio
import importlib.util
from collections import Counter

import pytest

from asyncgrpo.cli import main
from asyncgrpo.config import load_config
from asyncgrpo.rundir import PLOT_FILES
from asyncgrpo.telemetry.metrics import read_jsonl
from asyncgrpo.train import train

pytestmark = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                reason="matplotlib is not installed (pip install 'asyncgrpo[plot]')")

PNGS = {"rewards.png", "loss_kl.png", "staleness.png", "counters.png", "timeline.png"}
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
    assert {p.name for p in (tmp_path / "png").iterdir()} <= set(PLOT_FILES)  # what run.overwrite=true removes


def test_plot_of_a_directory_without_metrics_says_what_to_pass(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "has no metrics.jsonl" in err and "simulate --output-dir" in err


def test_a_distillation_runs_loss_panel_plots_distill_kl_mean():
    """distill/kl_mean is the distillation's key metric: loss_kl.png has a panel for it (issue 20, item 7)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from asyncgrpo.plot import _loss_kl

    metrics = [{"step": s, "loss": 1.0 / (s + 1), "kl": 0.0, "distill/kl_mean": 2.0 / (s + 1)} for s in range(5)]
    fig = _loss_kl(plt, metrics, [])
    panels = {ax.get_title(): ax for ax in fig.axes}
    assert list(panels) == ["loss", "kl", "distill/kl_mean"]
    assert list(panels["distill/kl_mean"].lines[0].get_ydata()) == [m["distill/kl_mean"] for m in metrics]
    plt.close(fig)
    grpo = _loss_kl(plt, [{"step": 0, "loss": 1.0, "kl": 0.0}], [])
    assert [ax.get_title() for ax in grpo.axes] == ["loss", "kl"]
    plt.close(grpo)


@pytest.mark.parametrize("content", ["not json\n", "not json"])
def test_plot_of_metrics_without_a_record_is_an_error_naming_the_file_not_empty_pngs(tmp_path, capsys, content):
    (tmp_path / "metrics.jsonl").write_text(content)
    assert main(["plot", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert str(tmp_path / "metrics.jsonl") in err and ("line 1, is not a JSON record" in err or "holds no step record" in err)
    assert not list(tmp_path.glob("plots/*.png"))
