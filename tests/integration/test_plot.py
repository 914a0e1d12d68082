"""`asyncgrpo plot` draws a short real training run, a simulation, an environment run and a distillation: which
PNGs and panels each gets (a series that carries no information is left out, and the command says so), the
timeline's switch from a bar per rollout to rates and in-flight bands, and the training run's timeline
agreeing with its accounting."""

from __future__ import annotations

import asyncio
from collections import Counter

import matplotlib
import pytest

from asyncgrpo.commands.cli import main
from asyncgrpo.commands.plot import COUNTERS, _counters, _distill, _env, _loss_kl
from asyncgrpo.commands.plot_timeline import BARS_MAX, Pipeline
from asyncgrpo.commands.train import train
from asyncgrpo.config import load_config
from asyncgrpo.rundir import PLOT_FILES
from asyncgrpo.telemetry.metrics import read_jsonl

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PNGS = {"rewards.png", "loss_kl.png", "staleness.png", "offpolicy.png", "timeline.png"}
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
    out = capsys.readouterr().out
    assert str(tmp_path / "plots" / "timeline.png") in out
    assert "loss_kl.png: left out kl (0 at every step: the loss has no KL term" in out  # the demo has no KL term
    assert not {"env.png", "distill.png"} & {p.name for p in (tmp_path / "plots").iterdir()}
    counters = any(m[key] for m in read_jsonl(tmp_path / "metrics.jsonl") for keys in COUNTERS for key in keys)
    assert (tmp_path / "plots" / "counters.png").is_file() == counters
    assert counters or "counters.png: not written: no rollout failed" in out
    assert not Pipeline.of(timeline).aggregated(None)  # about 150 rollouts: a bar each


def test_plot_draws_a_simulation_without_the_panels_it_has_no_values_for(tmp_path, capsys):
    out = tmp_path / "sim"
    assert main(["simulate", "recipes/simulate.yaml", "train.max_steps=20", "--output-dir", str(out)]) == 0
    png = out / "plots"  # the run's own plots folder, which asyncgrpo owns
    png.mkdir()
    (png / "loss_kl.png").write_bytes(PNG_MAGIC)  # an earlier run's: it would read as this one's
    capsys.readouterr()
    assert main(["plot", str(out)]) == 0
    assert_pngs(png, {"rewards.png", "staleness.png", "counters.png", "timeline.png", "timeline_start.png"})
    names = {p.name for p in png.iterdir()}
    assert not {"loss_kl.png", "offpolicy.png", "env.png", "distill.png"} & names  # a simulation trains nothing
    assert names <= set(PLOT_FILES)  # what run.overwrite=true removes
    said = capsys.readouterr().out
    assert "loss_kl.png: not written" in said and "offpolicy.png: not written: no off-policy value" in said
    pipeline = Pipeline.of(read_jsonl(out / "timeline.jsonl"))
    assert len(pipeline.bars) > BARS_MAX and pipeline.aggregated(None)  # about 1500 rollouts: rates and bands
    # A folder the user chose with --out: a file of the same name there may be the user's own, so it is kept and named.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "loss_kl.png").write_bytes(PNG_MAGIC)
    assert main(["plot", str(out), "--out", str(mine)]) == 0
    assert (mine / "loss_kl.png").read_bytes() == PNG_MAGIC and f"an older {mine / 'loss_kl.png'} was kept" in capsys.readouterr().out


def rollouts(n, start=0.0, end=10.0):
    """A timeline of n rollouts of one trained take each, all open from start to end."""
    lines = [{"e": "start", "max_inflight": n}]
    for k in range(n):
        lines += [{"e": "rollout", "take": k, "start": start, "end": end, "outcome": "finished"},
                  {"e": "take", "take": k, "ending": "buffered"}, {"e": "buffered", "take": k, "outcome": "trained", "step": 0}]
    return [*lines, {"e": "step", "step": 0, "wait": [0.0, end], "train": [end, end + 1], "sync": [end + 1, end + 1]}]


def test_the_timeline_draws_a_bar_per_rollout_up_to_BARS_MAX_and_rates_and_in_flight_bands_past_it():
    small = Pipeline.of(rollouts(BARS_MAX))
    fig = small.draw(plt, None, "small")
    assert not small.aggregated(None) and len(fig.axes) == 2
    assert sum(len(c.get_paths()) for c in fig.axes[0].collections) == BARS_MAX  # one bar each
    plt.close(fig)
    large = Pipeline.of(rollouts(BARS_MAX + 1))
    fig = large.draw(plt, None, "large")
    assert large.aggregated(None) and len(fig.axes) == 3
    bands, rates = fig.axes[0], fig.axes[1]
    assert max(y for c in bands.collections for path in c.get_paths() for _, y in path.vertices) == pytest.approx(BARS_MAX + 1)
    assert rates.get_ylabel() == "rollouts per second"
    assert sorted(line.get_label().split(" ")[0] for line in rates.lines) == ["finished", "started"]  # failed, cancelled: 0
    plt.close(fig)
    assert not large.aggregated((20.0, 30.0))  # a window is judged by the rollouts in it


def test_plot_of_a_directory_without_metrics_says_what_to_pass(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "has no metrics.jsonl" in err and "simulate --output-dir" in err


def titles(fig):
    titles = [ax.get_title() for ax in fig.axes]
    plt.close(fig)
    return titles


def test_the_kl_panel_is_drawn_only_with_a_kl_term_and_distill_kl_mean_under_distill():
    """distill/kl_mean is the distillation's key metric: loss_kl.png has a panel for it (issue 20, item 7)."""
    notes: list[str] = []
    metrics = [{"step": s, "loss": 1.0 / (s + 1), "kl": 0.0, "distill/kl_mean": 2.0 / (s + 1)} for s in range(5)]
    fig = _loss_kl(plt, metrics, [], notes)
    assert list(fig.axes[1].lines[0].get_ydata()) == [m["distill/kl_mean"] for m in metrics]
    assert titles(fig) == ["loss", "distill/kl_mean"]
    assert notes == ["left out kl (0 at every step: the loss has no KL term, train.loss.kl_coef: 0)"]
    assert titles(_loss_kl(plt, [{"step": 0, "loss": 1.0, "kl": 0.01}], [], [])) == ["loss", "kl"]  # a KL term
    notes = []
    assert _loss_kl(plt, [{"step": 0, "loss": None, "kl": None}], [], notes) is None
    assert notes == ["left out loss (no value at any step)", "left out kl (no value at any step)", "not written: no panel left"]


def test_counters_that_stayed_zero_are_left_out_and_a_figure_without_any_is_not_drawn():
    zero = {"rollout/failed_total": 0, "rollout/stale_groups_total": 0, "rollout/dropped_groups_total": 0,
            "rollout/requeued_total": 0, "rollout/retries_total": 0}
    notes: list[str] = []
    assert _counters(plt, [{"step": s, **zero} for s in range(3)], [], notes) is None
    assert notes == ["not written: no rollout failed or was retried, and no group went stale, was dropped or requeued"]
    notes = []
    fig = _counters(plt, [{"step": s, **zero, "rollout/stale_groups_total": s} for s in range(3)], [], notes)
    assert [line.get_label() for line in fig.axes[0].lines] == ["stale_groups_total (2)"] and len(fig.axes) == 1
    plt.close(fig)
    assert notes == ["left out rollout/failed_total, rollout/dropped_groups_total, rollout/requeued_total (0 at every step)",
                     "left out rollout/retries_total (0 at every step)"]


def test_environment_and_distillation_panels_only_for_runs_that_have_them():
    plain = [{"step": s, "env/turns_mean": None, "reward/mean": 0.5, "reward/std": 0.1, "reward/coin": 0.5, "completion/len_mean": 9.0,
              "env/errors_total": 0, "env/abandoned_total": 0, "env/retokenization_drift_total": 0} for s in range(3)]
    assert _env(plt, plain, [], []) is None and _distill(plt, plain, [], []) is None
    env = [{**m, "env/turns_mean": 1.5, "reward/env": 0.1 * m["step"], "env/retokenization_drift_total": m["step"]} for m in plain]
    notes: list[str] = []
    assert titles(_env(plt, env, [], notes)) == ["env/turns_mean", "reward/coin", "reward/env", "env/retokenization_drift_total"]
    assert notes == ["left out env/errors_total, env/abandoned_total (0 at every step)"]
    distill = [{**m, "distill/kl_mean": 1.0 / (m["step"] + 1)} for m in plain]
    assert titles(_distill(plt, distill, [], [])) == ["distill/kl_mean", "completion/len_mean"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("recipe", "own"), [("recipes/calculator.yaml", "env.png"), ("recipes/distill_tiny.yaml", "distill.png")])
def test_an_environment_run_and_a_distillation_get_their_own_png(tmp_path, recipe, own):
    cfg = load_config(recipe, [f"run.output_dir={tmp_path}", "logging.progress=false", "train.max_steps=2", "eval.every_steps=0",
                               "checkpoint.every_steps=0", "rollout.groups_per_step=4"])
    assert asyncio.run(train(cfg)).result.outcome == "completed"
    assert main(["plot", str(tmp_path)]) == 0
    names = {p.name for p in (tmp_path / "plots").iterdir()}
    assert own in names and not ({"env.png", "distill.png"} - {own}) & names
    assert_pngs(tmp_path / "plots", {own, "rewards.png", "loss_kl.png"})


@pytest.mark.parametrize("content", ["not json\n", "not json"])
def test_plot_of_metrics_without_a_record_is_an_error_naming_the_file_not_empty_pngs(tmp_path, capsys, content):
    (tmp_path / "metrics.jsonl").write_text(content)
    assert main(["plot", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert str(tmp_path / "metrics.jsonl") in err and ("line 1, is not a JSON record" in err or "holds no step record" in err)
    assert not list(tmp_path.glob("plots/*.png"))
