"""On-policy distillation (`algorithm: distill`): a teacher scores each sample's tokens (DESIGN.md §3 "Distillation").

- The unit is one sample (`rollout.group_size: 1` and `rollout.min_group_survivors: 1`, no zero-variance
  filter): a stale sample counts whether it finished or not. Not yet with an env: section (the teacher
  does not score episodes) nor with `rollout.on_stale: resume` (`config_problems`).
- The scorer is the teacher, built and started by the run in place of the reward functions
  (distill/teacher.py; distill/simulated.py on virtual time), its device and path checked before any
  model is loaded (distill/teacher_path.py).
- Judging (distill/judge.py `taught_rollouts`): one rollout per sample carrying the teacher's log-probs;
  no group advantages, no zero-variance filter, no no-signal watch.
- The trainer's advantage is per token, -(log pi_gen - log pi_teacher) (distill/loss.py); `advantage/*`
  describe those values, and every step reports `distill/kl_mean` (DISTILL_KEYS).
- Evaluation reports what GRPO's does (algorithms/grpo.py `reward_report`): the reward functions' scores of
  the held-out samples. (The teacher's KL on held-out prompts would be distillation's own measure; not built.)

Invariants: implements algorithms/base.py `Algorithm`; torch and the teacher's model code are imported only
inside `build_scorer` and `token_advantages`; a rollout without teacher log-probs reaching the trainer is a
bug, raised (a filler row, which has no rollout and no loss token, gets advantages 0).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from asyncgrpo.algorithms.grpo import reward_report
from asyncgrpo.config import Config, resume_unsupported
from asyncgrpo.distill.judge import kl_mean, taught_rollouts
from asyncgrpo.distill.simulated import SimulatedTeacher
from asyncgrpo.distill.teacher_path import check_teacher_path, teacher_seed
from asyncgrpo.metric_names import DISTILL_KEYS
from asyncgrpo.types import Completion, Drop, Group, Prompt, Rollout

if TYPE_CHECKING:
    from torch import Tensor

    from asyncgrpo.rewards.scoring import ScoredCompletion

log = logging.getLogger("asyncgrpo")


class Distill:
    per_sample = True
    watches_no_signal = False
    metric_keys: tuple[str, ...] = DISTILL_KEYS

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def config_problems(self) -> list[str]:
        r, problems = self.cfg.rollout, list[str]()
        wrong = [f"rollout.{key} = {getattr(r, key)}" for key in ("group_size", "min_group_survivors") if getattr(r, key) != 1]
        if r.filter_zero_variance:
            wrong.append("rollout.filter_zero_variance = true")
        if wrong:
            problems.append(
                f"algorithm = 'distill' makes each sample its own unit, but {', '.join(wrong)}. Fix: set "
                f"rollout.group_size: 1 and rollout.min_group_survivors: 1 (rollout.groups_per_step is then the samples per "
                f"step), and leave rollout.filter_zero_variance off (there are no rewards to compare)."
            )
        if self.cfg.env is not None:
            problems.append(
                "algorithm = 'distill' with an env: section: the teacher scores single completions, it does not score "
                "episodes yet (their environment tokens and per-turn prompts). Fix: remove the env: section, or use algorithm: grpo."
            )
        if r.on_stale == "resume":
            problems.append(resume_unsupported("algorithm", "distill"))
        return problems

    def build_scorer(self, tokenizer: Any) -> Any | None:
        from asyncgrpo.distill.teacher import build_teacher

        log.info("loading the teacher %s ...", self.cfg.distill.teacher)
        return build_teacher(self.cfg, tokenizer)

    def simulated_scorer(self) -> Any | None:
        return SimulatedTeacher(self.cfg.distill, self.cfg.simulate, seed=self.cfg.run.seed)

    def scoring_state(self, scorer: Any) -> str:
        return f" by the teacher ({scorer.state()})"

    def judge(self, prompt: Prompt, completions: Sequence[Completion], scored: Sequence[Any]) -> tuple[Rollout, ...] | Drop:
        return taught_rollouts(completions, scored)

    def token_advantages(self, rollouts: Sequence[Rollout | None], logp_gen: Tensor, mask: Tensor) -> Tensor:
        import torch

        from asyncgrpo.distill.loss import distill_advantages

        width = logp_gen.shape[1]
        rows = []
        for r in rollouts:
            if r is None:  # a filler (a data-parallel rank's empty share): no loss token, so no signal
                rows.append([0.0] * width)
                continue
            if r.teacher_logprobs is None:
                raise AssertionError("algorithm: distill, but a rollout carries no teacher log-probs")
            rows.append(list(r.teacher_logprobs) + [0.0] * (width - len(r.completion.token_ids)))
        return distill_advantages(logp_gen, torch.tensor(rows, dtype=torch.float32, device=logp_gen.device), mask)

    def advantage_values(self, rollouts: Sequence[Rollout]) -> list[float]:
        return [t - g for r in rollouts for g, t in zip(r.completion.logprobs, r.teacher_logprobs or ())] or [0.0]

    def step_metrics(self, groups: Sequence[Group]) -> dict[str, float]:
        return {"distill/kl_mean": kl_mean(groups)}

    def preflight(self) -> None:
        check_teacher_path(self.cfg)

    def devices(self) -> list[tuple[str, str]]:
        d = self.cfg.distill
        return [("distill.device", d.device if d.device != "auto" else self.cfg.train.device)]

    def describe_scoring(self) -> str:
        d = self.cfg.distill
        seed = f" (seed {teacher_seed(self.cfg)})" if d.teacher.startswith("builtin:") else ""
        return f"distill from teacher {d.teacher}{seed}, batches of {d.batch_size}, timeout {d.timeout_s:g} s (on error: {d.on_error})"

    def eval_metrics(self, per_prompt: Sequence[Sequence[ScoredCompletion]], terms: Sequence[str]) -> dict[str, float | None]:
        return reward_report(per_prompt, terms, success_threshold=self.cfg.eval.success_threshold)
