"""GRPO (`algorithm: grpo`, the default): reward functions score a group, advantages compare its members.

- The unit is a group of `rollout.group_size` completions of one prompt (at least 2, and as many survivors:
  its advantages compare them); the recipe's reward functions (and an environment's reward) score it.
- Judging (rollout/judge.py `scored_rollouts`): the members that got a reward, each with its
  group-relative advantage (rollout/advantages.py), or the drop (`too_few_survivors`, `filtered`).
- The trainer's advantage is per sequence: every loss token of a rollout carries `Rollout.advantage`.
- A run of groups whose rewards are all equal is warned about (rollout/no_signal.py) unless
  `rollout.filter_zero_variance` drops them.
- Evaluation reports the held-out samples' mean reward, each reward term's mean and pass@k (`reward_report`,
  which distillation reports too).

Invariants: implements algorithms/base.py `Algorithm`; pure apart from the trainer's tensor; adds no metric keys.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from asyncgrpo.config import Config
from asyncgrpo.rewards.scoring import ScoredCompletion
from asyncgrpo.rollout.judge import scored_rollouts
from asyncgrpo.types import Completion, Drop, Group, Prompt, Rollout

if TYPE_CHECKING:
    from torch import Tensor


class Grpo:
    per_sample = False
    watches_no_signal = True
    metric_keys: tuple[str, ...] = ()

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def config_problems(self) -> list[str]:
        r = self.cfg.rollout
        return [
            f"rollout.{key} = {getattr(r, key)}: GRPO compares the completions of a group, so it needs at least 2. Fix: set "
            f"rollout.{key} to 2 or more (a group size of 1 is for algorithm: distill)."
            for key in ("group_size", "min_group_survivors")
            if getattr(r, key) < 2
        ]

    def build_scorer(self, tokenizer: Any) -> Any | None:
        return None

    def simulated_scorer(self) -> Any | None:
        return None

    def scoring_state(self, scorer: Any) -> str:
        return ""

    def judge(self, prompt: Prompt, completions: Sequence[Completion], scored: Sequence[Any]) -> tuple[Rollout, ...] | Drop:
        r = self.cfg.rollout
        return scored_rollouts(prompt, completions, scored, min_survivors=r.min_group_survivors,
                               filter_zero_variance=r.filter_zero_variance, scale_by_std=self.cfg.train.loss.scale_by_std)

    def token_advantages(self, rollouts: Sequence[Rollout | None], logp_gen: Tensor, mask: Tensor) -> Tensor:
        import torch

        values = [0.0 if r is None else float(r.advantage) for r in rollouts]
        return torch.tensor(values, dtype=torch.float32, device=logp_gen.device)

    def advantage_values(self, rollouts: Sequence[Rollout]) -> list[float]:
        return [float(r.advantage) for r in rollouts]

    def step_metrics(self, groups: Sequence[Group]) -> dict[str, float]:
        return {}

    def preflight(self) -> None:
        return None

    def devices(self) -> list[tuple[str, str]]:
        return []

    def describe_scoring(self) -> str:
        cfg = self.cfg
        terms = [*cfg.reward.functions, *([f"the environment's x {cfg.env.reward_weight:g}"] if cfg.env is not None else [])]
        return f"reward: {', '.join(terms)} (on error: {cfg.reward.on_error})"

    def eval_metrics(self, per_prompt: Sequence[Sequence[ScoredCompletion]], terms: Sequence[str]) -> dict[str, float | None]:
        return reward_report(per_prompt, terms, success_threshold=self.cfg.eval.success_threshold)


def reward_report(per_prompt: Sequence[Sequence[ScoredCompletion]], terms: Sequence[str], *, success_threshold: float) -> dict[str, float | None]:
    """`eval/reward_mean` (the samples' mean reward), `eval/pass_rate` (the share of prompts with a sample reaching
    `success_threshold`: pass@k) and `eval/reward/<term>` (each term's mean)."""
    samples = [s for scored in per_prompt for s in scored]
    passed = [any(s.reward is not None and s.reward >= success_threshold for s in scored) for scored in per_prompt if scored]
    return {
        "eval/reward_mean": _mean([s.reward for s in samples]),
        "eval/pass_rate": sum(passed) / len(passed) if passed else None,
        **{f"eval/reward/{name}": _mean([s.terms.get(name) for s in samples]) for name in terms},
    }


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None
