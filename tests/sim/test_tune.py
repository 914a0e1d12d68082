"""`asyncgrpo tune` against a known truth: a simulated run with known models is calibrated from its own
timeline; the fits recover the models, the replay is within tolerance, and a swept config's prediction
holds when the truth simulator runs that config (the simulator's side of "checked against reality")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from asyncgrpo.commands.cli import main
from asyncgrpo.commands.sim_metrics import population_length
from asyncgrpo.commands.simulate import simulate
from asyncgrpo.commands.tune import observe_simulation
from asyncgrpo.config import load_config
from asyncgrpo.rundir import CONFIG_FILE, MARKER
from asyncgrpo.tuning.calibrate import calibrate, recipe_config, with_overrides
from asyncgrpo.tuning.observe import TOKENS_PER_S_TOLERANCE, WAIT_SHARE_TOLERANCE, compare, observe_run
from asyncgrpo.tuning.records import CalibrationError, load_run
from asyncgrpo.tuning.sweep import KEYS

TRUTH = [
    "data.builtin_size=256", "generation.max_inflight=24", "generation.max_new_tokens=512", "rollout.group_size=4", "rollout.groups_per_step=4",
    "rollout.max_staleness=1", "train.max_steps=30", "simulate.faults=[]", "simulate.token_time_s=0.0001",
    "simulate.tokens={dist: lognormal, median: 100, sigma: 0.3}",
    "simulate.token_model={rollout_sigma: 0.2, prefill_s: 0.01, decode_s_per_token: 0.002, batch_knee: 8}",
    "simulate.weight_sync_s={dist: const, value: 0.05}", "simulate.step_overhead_s=0.3", "eval.every_steps=5", "simulate.eval_s=0.4",
]


def truth_run(run_dir: Path, *extra: str):
    """Simulate the truth into `run_dir` and make it a run directory (config.yaml and the marker), as a training run leaves one:
    its config has no simulate: section (calibration must fit every model, not inherit the truth's)."""
    cfg = load_config("recipes/simulate.yaml", [*TRUTH, *extra])
    sim = simulate(cfg, output_dir=run_dir)
    recorded = {k: v for k, v in cfg.model_dump(mode="json").items() if k != "simulate"}
    (run_dir / CONFIG_FILE).write_text(yaml.safe_dump(recorded), encoding="utf-8")
    (run_dir / MARKER).write_text("{}", encoding="utf-8")
    return cfg, sim


def test_calibration_recovers_the_truth_models(tmp_path):
    truth_run(tmp_path)
    c = calibrate(load_run(tmp_path))
    assert c.trainer.token_time_s == pytest.approx(1e-4, rel=1e-6) and c.trainer.overhead_s == pytest.approx(0.3, rel=1e-4)
    assert c.eval_s == pytest.approx(0.4, rel=1e-6)
    assert c.weight_sync_s == pytest.approx(0.05, rel=1e-6)
    assert c.decode.batch_knee == 8
    assert c.decode.decode_s_per_token == pytest.approx(0.002, rel=0.1)  # dispatch order within an instant is not recorded
    assert c.decode.prefill_s == pytest.approx(0.01, abs=0.005)
    assert c.lengths.median == pytest.approx(100, rel=0.15)
    assert c.lengths.rollout_sigma == pytest.approx(0.2, rel=0.25)
    assert c.faults == []


def test_lengths_the_budget_cut_are_calibrated_censored_and_the_replay_generates_as_much(tmp_path):
    """generation.max_new_tokens cuts about 40 % of the truth's rollouts: calibration recovers the lognormal before the cut
    (the simulator cuts its draws at the budget as the run was cut), so the replay's rollouts are as long as the run's."""
    truth_run(tmp_path, "generation.max_new_tokens=110")
    records = load_run(tmp_path)
    c = calibrate(records)
    assert c.lengths.censored and 0.3 < c.lengths.truncated_share < 0.55
    assert c.lengths.median == pytest.approx(100, rel=0.08) and c.lengths.rollout_sigma == pytest.approx(0.2, rel=0.25)
    replay = simulate(recipe_config(c.recipe))
    assert population_length(replay.generator.drawn_lengths) == pytest.approx(c.lengths.mean, rel=0.02)
    assert compare(observe_run(records), observe_simulation(replay)).ok


@pytest.mark.parametrize("change", [{}, {"generation.max_inflight": 48}, {"rollout.max_staleness": 2, "rollout.on_stale": "drop"},
                                    {"rollout.groups_per_step": 8, "rollout.on_stale": "wait"}])
def test_predictions_of_the_calibrated_simulator_hold_on_the_truth(tmp_path, change):
    """The run's own config (the replay) and configs the sweep tries: predicted within the validation tolerance of the truth."""
    cfg, _ = truth_run(tmp_path)
    recipe = calibrate(load_run(tmp_path)).recipe
    predicted = observe_simulation(simulate(with_overrides(recipe, change)))
    truth = observe_simulation(simulate(with_overrides(cfg.model_dump(mode="json"), change)))
    assert abs(predicted.tokens_per_s / truth.tokens_per_s - 1) <= TOKENS_PER_S_TOLERANCE, (predicted, truth)
    assert abs(predicted.wait_share - truth.wait_share) <= WAIT_SHARE_TOLERANCE, (predicted, truth)


RAY_RUNS = {
    "generator actors and trainer ranks": {"runtime": "ray", "generation": {"backend": "local"}, "train": {"world_size": 2}},
    "sharded trainer ranks": {"runtime": "ray", "generation": {"backend": "local"}, "train": {"world_size": 2, "sharding": "fsdp"}},
    "launched servers": {"runtime": "ray", "generation": {"backend": "http", "http": {"launch": {"count": 2}}}},
}


def merged(base: dict, changes: dict) -> dict:
    """`base` with `changes` merged in, section by section."""
    return {**base, **{k: merged(base.get(k) or {}, v) if isinstance(v, dict) else v for k, v in changes.items()}}


@pytest.mark.parametrize("recorded", list(RAY_RUNS.values()), ids=list(RAY_RUNS))
def test_a_ray_run_is_calibrated_into_a_recipe_the_one_process_simulator_runs(tmp_path, capsys, recorded):
    """A run recorded with runtime: ray (its generators Ray actors or servers it launched, its trainer ranks actors) is
    calibrated and replayed like a local one: the fitted times are the actors' already, and the simulator is one process."""
    truth_run(tmp_path)
    config = merged(yaml.safe_load((tmp_path / CONFIG_FILE).read_text()), recorded)
    (tmp_path / CONFIG_FILE).write_text(yaml.safe_dump(config), encoding="utf-8")
    assert main(["tune", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["validation"]["ok"], report["validation"]["reasons"]
    tuned = yaml.safe_load((tmp_path / "tuned.yaml").read_text())
    assert tuned["runtime"] == "local" and tuned["train"]["world_size"] == 1 and tuned["generation"]["http"]["launch"] is None


def test_a_replay_that_misses_the_run_refuses_to_advise(tmp_path, capsys):
    truth_run(tmp_path)
    timeline = tmp_path / "timeline.jsonl"
    lines = [json.loads(line) for line in timeline.read_text().splitlines()]
    for line in lines:  # the trainer's spans recorded 3x longer than the tokens it trained explain: the fit disagrees
        if line["e"] == "step":
            line["wait"] = [line["wait"][0], line["wait"][0] + 3 * (line["wait"][1] - line["wait"][0])]
    timeline.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["tune", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "no recommendation" in out and "MISS" in out and "recommended" not in out


def test_tune_prints_one_json_object_with_the_frontier_and_dotted_overrides_and_draws_the_plot(tmp_path, capsys):
    """...and what it predicts for its recommendation is what `asyncgrpo simulate RUN_DIR/tuned.yaml OVERRIDES` gives."""
    truth_run(tmp_path, "train.max_steps=6", "rollout.max_staleness=0")
    assert main(["tune", str(tmp_path), "--json", "--plot", "--max-staleness", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["validation"]["ok"]
    assert 40 <= len(report["sweep"]) <= 70 and report["frontier"]
    overrides = report["recommendation"]["overrides"]
    assert overrides and all(key in (*KEYS, "eval.every_steps") for key in overrides)
    assert report["recommendation"]["predicted"]["overrides"]["rollout.max_staleness"] <= 2
    assert (tmp_path / "tune.png").stat().st_size > 0 and (tmp_path / "tuned.yaml").exists()
    pasted = load_config(str(tmp_path / "tuned.yaml"), [f"{k}={v}" for k, v in overrides.items()])
    assert observe_simulation(simulate(pasted)).tokens_per_s == report["recommendation"]["predicted"]["observed"]["tokens_per_s"]


EPISODES = ["env={factory: 'simulated:env', max_turns: 4, max_tokens: 4096}",
            "simulate.env={call_s: {dist: lognormal, median: 0.3, sigma: 0.4}, done_prob: 0.35, reward_prob: 0.3, observation_chars: 30}"]


@pytest.mark.parametrize("budget", [[], ["generation.max_new_tokens=120", "env.max_tokens=300"]], ids=["uncut", "cut"])
def test_an_episode_run_calibrates_its_environment_and_turns_and_replays_within_tolerance(tmp_path, budget):
    """...also with turns cut at max_new_tokens and at what env.max_tokens left of the episode (a turn's `limit`): both censored."""
    truth_run(tmp_path, *EPISODES, *budget)
    records = load_run(tmp_path)
    c = calibrate(records)
    assert c.lengths.censored == bool(budget)
    assert c.env is not None and c.env.call_median_s == pytest.approx(0.3, rel=0.1) and c.env.call_sigma == pytest.approx(0.4, rel=0.15)
    assert c.env.done_prob == pytest.approx(0.35, abs=0.05) and c.env.reward_prob == pytest.approx(0.3, abs=0.05)
    assert c.env.observation_chars == 30 and c.recipe["simulate"]["env"]["done_prob"] == round(c.env.done_prob, 6)
    assert c.trainer.token_time_s == pytest.approx(1e-4, rel=1e-6)  # per completion token, the environment's too, as the truth's
    assert c.lengths.median == pytest.approx(100, rel=0.15)  # per turn, not per episode
    assert c.decode.decode_s_per_token == pytest.approx(0.002, rel=0.15) and c.decode.batch_knee == 8
    comparison = compare(observe_run(records), observe_simulation(simulate(recipe_config(c.recipe))))
    assert comparison.ok, comparison.reasons


def second_turn_share(run_dir: Path) -> float:
    """Of the episodes in run_dir's timeline, the share that took a second turn."""
    turns: dict[tuple[int, int], int] = {}
    for line in map(json.loads, (run_dir / "timeline.jsonl").read_text().splitlines()):
        if line["e"] == "turn":
            turns[line["take"], line["member"]] = turns.get((line["take"], line["member"]), 0) + 1
    return sum(n >= 2 for n in turns.values()) / len(turns)


def test_an_environment_whose_first_steps_end_more_episodes_than_later_ones_is_fitted_per_step_index(tmp_path):
    """The truth's first steps end 70 % of the episodes, later ones 20 %: the calibration recovers both, and its replay's
    episodes take a second turn as often as the run's (33 %); one probability for every step (48 % pooled) gave 57 %."""
    truth_run(tmp_path / "run", *EPISODES, "simulate.env.done_probs=[0.7, 0.2]")
    c = calibrate(load_run(tmp_path / "run"))
    assert c.env is not None and c.env.done_probs[0] == pytest.approx(0.7, abs=0.05)
    assert len(c.env.done_probs) >= 2 and all(p == pytest.approx(0.2, abs=0.08) for p in c.env.done_probs[1:])
    simulate(recipe_config(c.recipe), output_dir=tmp_path / "replay")
    assert second_turn_share(tmp_path / "replay") == pytest.approx(second_turn_share(tmp_path / "run"), abs=0.06)


def test_an_episode_run_with_environment_errors_fits_their_rates_apart_from_the_generation_faults(tmp_path):
    """Both kinds count in rollout/retries_total and rollout/failed_total: the environment's go to simulate.env, none to the
    generation's faults (the truth has none)."""
    truth_run(tmp_path, EPISODES[0], EPISODES[1][:-1] + ", error_prob: 0.02, transient_prob: 0.06}")
    c = calibrate(load_run(tmp_path))
    assert c.env is not None and c.env.errors is not None
    assert c.env.errors.error_prob == pytest.approx(0.02, abs=0.01) and c.env.errors.transient_prob == pytest.approx(0.06, abs=0.015)
    assert c.faults == [] and c.recipe["simulate"]["env"]["transient_prob"] == round(c.env.errors.transient_prob, 6)


def test_an_episode_run_that_does_not_replay_prints_the_fitted_environment_model(tmp_path, capsys):
    truth_run(tmp_path, "train.max_steps=6", *EPISODES)
    timeline = tmp_path / "timeline.jsonl"
    lines = [json.loads(line) for line in timeline.read_text().splitlines()]
    for line in lines:  # the trainer's waits recorded 3x longer than the fitted models explain
        if line["e"] == "step":
            line["wait"] = [line["wait"][0], line["wait"][0] + 3 * (line["wait"][1] - line["wait"][0])]
    timeline.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["tune", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "MISS" in out and "plays episodes (env:)" in out and '"done_prob": ' in out and "recommended" not in out


def test_an_episode_run_without_turn_and_environment_lines_is_refused_naming_them(tmp_path):
    truth_run(tmp_path, "train.max_steps=6", *EPISODES)
    timeline = tmp_path / "timeline.jsonl"
    kept = [line for line in timeline.read_text().splitlines() if json.loads(line)["e"] not in ("turn", "env")]
    timeline.write_text("".join(line + "\n" for line in kept))
    with pytest.raises(CalibrationError, match="no episode turns and environment steps"):
        load_run(tmp_path)


CONTENDED = "simulate.contention={decode: 1.8, train: 2.5}"  # the local engine and the trainer on shared cores


def test_contention_is_recovered_from_pooled_runs_and_predicts_the_synchronous_config(tmp_path):
    """A K=1 run alone shows the trainer's slowdown (its steps overlapped generation by different amounts) but not decode's
    (nearly every rollout overlapped training); pooled with the K=0 run (no rollout did), both are recovered, and the K=0
    config's prediction holds on the truth, where independent resources would predict it far too slow."""
    cfg, _ = truth_run(tmp_path / "k1", CONTENDED)
    truth_run(tmp_path / "k0", CONTENDED, "rollout.max_staleness=0")
    alone = calibrate(load_run(tmp_path / "k1"))
    assert alone.trainer.contention == pytest.approx(2.5, rel=1e-6) and alone.decode.contention == 1.0
    pooled = calibrate(load_run(tmp_path / "k1"), [load_run(tmp_path / "k0")])
    assert pooled.decode.contention == pytest.approx(1.8, rel=0.02) and pooled.trainer.contention == pytest.approx(2.5, rel=1e-6)
    assert pooled.trainer.token_time_s == pytest.approx(1e-4, rel=1e-6) and pooled.trainer.overhead_s == pytest.approx(0.3, rel=1e-4)
    assert pooled.recipe["simulate"]["contention"] == {"decode": round(pooled.decode.contention, 4), "train": 2.5}
    synchronous = {"rollout.max_staleness": 0}
    truth = observe_simulation(simulate(with_overrides(cfg.model_dump(mode="json"), synchronous)))
    predicted = observe_simulation(simulate(with_overrides(pooled.recipe, synchronous)))
    assert abs(predicted.tokens_per_s / truth.tokens_per_s - 1) <= TOKENS_PER_S_TOLERANCE, (predicted, truth)
    assert abs(predicted.wait_share - truth.wait_share) <= WAIT_SHARE_TOLERANCE, (predicted, truth)
    independent = observe_simulation(simulate(with_overrides(alone.recipe, synchronous)))
    assert independent.tokens_per_s / truth.tokens_per_s - 1 < -TOKENS_PER_S_TOLERANCE  # what pooling fixes


def test_a_pooled_run_that_does_not_replay_stops_the_advice(tmp_path, capsys):
    """The pooled run's times join the fits, so it is replayed too: one at another load (here: a trainer 3x slower) does not
    replay, and tune says which run missed instead of advising from the blend."""
    truth_run(tmp_path / "k1", "train.max_steps=10")
    truth_run(tmp_path / "other", "train.max_steps=10", "simulate.token_time_s=0.0003", "simulate.step_overhead_s=0.9")
    assert main(["tune", str(tmp_path / "k1"), "--pool", str(tmp_path / "other")]) == 1
    out = capsys.readouterr().out
    assert "other: trained tokens/s" in out and "pooled run other: trained tokens/s" in out and "recommended" not in out
    assert "Fix: pool only runs made on this machine at the same load" in out


def test_a_run_of_another_model_is_not_pooled(tmp_path, capsys):
    truth_run(tmp_path / "k1", "train.max_steps=6")
    truth_run(tmp_path / "other", "train.max_steps=6", "model.path=builtin:tiny-other")
    assert main(["tune", str(tmp_path / "k1"), "--pool", str(tmp_path / "other")]) == 1
    err = capsys.readouterr().err
    assert "cannot be pooled" in err and "model.path" in err and "--pool" in err
