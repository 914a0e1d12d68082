"""GRPO (`algorithm: grpo`, the default): reward functions score a group, advantages compare its members.

- The unit is a group of `rollout.group_size` completions of one prompt; the recipe's reward functions
  (and an environment's reward) score it.
- Judging (rollout/judge.py `scored_rollouts`): the members that got a reward, each with its
  group-relative advantage (rollout/advantages.py), or the drop (`too_few_survivors`, `filtered`).
- The trainer's advantage is per sequence: every loss token of a rollout carries `Rollout.advantage`.
- A run of groups whose rewards are all equal is warned about (rollout/no_signal.py) unless
  `rollout.filter_zero_variance` drops them.

Invariants: implements algorithms/base.py `Algorithm`; pure apart from the trainer's tensor; adds no metric keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from asyncgrpo.config import Config
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
