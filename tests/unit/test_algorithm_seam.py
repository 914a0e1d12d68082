"""Adding an algorithm is one module and one line in the registry's table (algorithms/names.py): `Toy`, defined
here and registered with that one line (monkeypatched), runs `asyncgrpo simulate` end to end with its own judging,
metrics and rules, and evaluation reports what it says, and no other module of the package knows it. The CLI and the Python API refuse a recipe its
algorithm refuses before anything else is checked or started."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import pytest
import yaml

from asyncgrpo.algorithms.grpo import reward_report
from asyncgrpo.algorithms.names import ALGORITHMS, AlgorithmName
from asyncgrpo.commands.cli import main
from asyncgrpo.config import Config, load_config
from asyncgrpo.errors import ConfigError
from asyncgrpo.evaluation import evaluate
from asyncgrpo.rewards.scoring import RewardScorer
from asyncgrpo.types import Completion, Drop, GenerationRequest, Group, Prompt, Rollout
from tests.unit.test_evaluation import correct


class Toy:
    """REINFORCE without a baseline: each member that got a reward trains with its reward as its advantage. It has no
    importance correction, so it is on-policy only (`rollout.max_staleness: 0`, its one rule on the recipe). Its
    evaluation reports pass@1 (the share of samples that pass) as `eval/pass_rate`, where GRPO's reports pass@k."""

    per_sample = False
    watches_no_signal = False
    metric_keys: tuple[str, ...] = ("toy/advantage_mean",)

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def config_problems(self) -> list[str]:
        staleness = self.cfg.rollout.max_staleness
        return [] if staleness == 0 else [
            f"algorithm = 'toy' is on-policy, but rollout.max_staleness = {staleness}. Fix: set rollout.max_staleness: 0."]

    def build_scorer(self, tokenizer: Any) -> Any | None:
        return None

    def simulated_scorer(self) -> Any | None:
        return None

    def scoring_state(self, scorer: Any) -> str:
        return ""

    def judge(self, prompt: Prompt, completions: Sequence[Completion], scored: Sequence[Any]) -> tuple[Rollout, ...] | Drop:
        kept = tuple(Rollout(c, float(s.reward), float(s.reward), reward_terms=dict(s.terms))
                     for c, s in zip(completions, scored) if s.reward is not None)
        return kept or Drop("too_few_survivors", None)

    def token_advantages(self, rollouts: Sequence[Rollout | None], logp_gen: Any, mask: Any) -> Any:
        import torch

        return torch.tensor([0.0 if r is None else r.advantage for r in rollouts], dtype=torch.float32, device=logp_gen.device)

    def advantage_values(self, rollouts: Sequence[Rollout]) -> list[float]:
        return [r.advantage for r in rollouts]

    def step_metrics(self, groups: Sequence[Group]) -> dict[str, float]:
        advantages = [r.advantage for g in groups for r in g.rollouts]
        return {"toy/advantage_mean": sum(advantages) / len(advantages)}

    def preflight(self) -> None:
        return None

    def devices(self) -> list[tuple[str, str]]:
        return []

    def describe_scoring(self) -> str:
        return f"reward: {', '.join(self.cfg.reward.functions)}"

    def eval_metrics(self, per_prompt: Sequence[Sequence[Any]], terms: Sequence[str]) -> dict[str, float | None]:
        threshold = self.cfg.eval.success_threshold
        passed = [s.reward is not None and s.reward >= threshold for scored in per_prompt for s in scored]
        return {**reward_report(per_prompt, terms, success_threshold=threshold),
                "eval/pass_rate": sum(passed) / len(passed) if passed else None}


@pytest.fixture
def toy(monkeypatch):
    """The one registry line."""
    monkeypatch.setitem(ALGORITHMS, "toy", AlgorithmName(f"{__name__}:Toy", "REINFORCE without a baseline, on-policy"))


@pytest.fixture
def toy_recipe(toy, tmp_path):
    """A small simulate recipe that names the toy."""
    recipe = tmp_path / "toy.yaml"
    recipe.write_text(yaml.safe_dump({
        "algorithm": "toy",
        "run": {"name": "toy", "seed": 0},
        "data": {"source": "builtin:repeat_letter", "builtin_size": 40},
        "reward": {"functions": ["builtin:coin"]},
        "generation": {"backend": "scripted", "request_timeout_s": 10.0, "rollout_deadline_s": 30.0},
        "rollout": {"group_size": 4, "groups_per_step": 2, "max_staleness": 0},
        "train": {"backend": "stub", "max_steps": 4},
        "simulate": {"step_time_s": 1.0},
    }))
    return recipe


def test_an_algorithm_added_as_one_module_and_one_registry_line_simulates_a_run(toy_recipe, tmp_path, capsys):
    out = tmp_path / "sim"
    assert main(["simulate", str(toy_recipe), "--json", "--output-dir", str(out)]) == 0, capsys.readouterr().err
    report = json.loads(capsys.readouterr().out)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert report["steps"] == 4 and len(lines) == 4
    # The toy judged every trained rollout (advantage = reward, where GRPO's advantages would average 0) and its
    # trainer metric is on every line.
    assert [line["toy/advantage_mean"] for line in lines] == [line["reward/mean"] for line in lines]
    assert any(line["reward/mean"] > 0 for line in lines)


def test_the_added_algorithms_rule_on_the_recipe_is_a_config_error(toy_recipe, capsys):
    assert main(["simulate", str(toy_recipe), "rollout.max_staleness=1"]) == 3
    err = capsys.readouterr().err
    assert "algorithm = 'toy' is on-policy, but rollout.max_staleness = 1. Fix: set rollout.max_staleness: 0." in err


def test_the_cli_and_the_api_check_the_algorithms_rules_before_anything_else(tmp_path, capsys):
    """The algorithm's rules (here distillation's: a sample per unit) come first, as when config checked them: before
    `check` reads the data (which here does not exist), and when the Python API's Trainer is made, not when it trains."""
    from asyncgrpo import Trainer

    recipe = tmp_path / "distill.yaml"
    recipe.write_text(yaml.safe_dump({"algorithm": "distill", "data": {"source": str(tmp_path / "missing.jsonl")},
                                      "generation": {"backend": "scripted"}, "train": {"backend": "stub"}}))
    assert main(["check", str(recipe)]) == 3
    assert "algorithm = 'distill' makes each sample its own unit" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="algorithm = 'distill' makes each sample its own unit"):
        Trainer(config=str(recipe))


class Alternating:
    """A generator answering "12" to a request with an even seed (a prompt's samples 0, 2, ...) and "no" otherwise."""

    name = "alternating"
    serving_version = 0

    async def generate(self, request: GenerationRequest) -> Completion:
        text = "12" if request.seed % 2 == 0 else "no"
        return Completion((1,) * len(text), (0.0,) * len(text), (0,) * len(text), "stop", 0, text=text)


@pytest.mark.parametrize(("algorithm", "pass_rate"), [("grpo", 1.0), ("toy", 0.5)])
def test_evaluation_reports_what_the_algorithm_makes_of_the_scores(toy, algorithm, pass_rate):
    """Every prompt has one passing sample of two: pass@k (GRPO's report) is 1, the toy's pass@1 is 0.5."""
    cfg = load_config(None, [f"algorithm={algorithm}", "rollout.max_staleness=0", "eval.samples_per_prompt=2"])
    prompts = [Prompt(i, f"question {i}", (1, 2, 3)) for i in range(3)]

    async def run():
        async with RewardScorer([("correct", correct)], [1.0]) as scorer:
            return await evaluate(cfg, Alternating(), scorer, prompts, (), step=0)  # type: ignore[arg-type]

    metrics = asyncio.run(run())
    assert metrics["eval/pass_rate"] == pass_rate and metrics["eval/reward_mean"] == 0.5 and metrics["eval/reward/correct"] == 0.5
