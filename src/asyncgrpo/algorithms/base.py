"""The algorithm seam: what one training algorithm decides, as the protocol its module implements.

An algorithm (the recipe's `algorithm:`, one of algorithms/names.py's names, built by algorithms/registry.py;
those two are the only places that read the name; DESIGN.md §3 "Algorithms") decides:
- **what it asks of the recipe** (`config_problems`): the rules its settings must keep (the registry checks
  them whenever it builds the algorithm, so no run starts on a recipe its algorithm refuses);
- **the unit** (`per_sample`): a group of `rollout.group_size` samples compared with each other, or each
  sample its own unit of admission, staleness, cancellation and accounting;
- **what scores it**: the recipe's reward functions, or a scorer of its own that the run builds, starts
  and closes (`build_scorer` for `train`, `simulated_scorer` for `simulate`); `scoring_state` describes
  it in the collector's stall diagnostic;
- **how a scored unit is judged** (`judge`): its trainable rollouts or the drop, and whether the no-signal
  watch (a window of groups whose rewards are all equal, rollout/no_signal.py) applies (`watches_no_signal`);
- **the trainer's advantage per token** (`token_advantages`), what `advantage/mean` and `advantage/std`
  describe (`advantage_values`), and the metrics its trainers add to every step (`metric_keys`,
  `step_metrics`);
- **what is checked before a model is loaded** (`preflight`, `devices`: `asyncgrpo check` and `train`)
  and `check`'s line about the scoring (`describe_scoring`);
- **what evaluation reports** (`eval_metrics`): evaluation.py samples the held-out prompts and scores them
  with the reward functions (and an environment's reward) for every algorithm; the algorithm turns those
  scores into the `eval/*` values (GRPO's: the mean reward, each term's mean and pass@k; distillation
  reports the same for now).

Invariants: an implementation is built from the recipe alone (`Algorithm(cfg)`) and holds no run state;
it imports torch and the teacher only inside the hooks that need them, so the collector, `check` and the
simulator never import torch through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from asyncgrpo.config import Config
from asyncgrpo.types import Completion, Drop, Group, Prompt, Rollout

if TYPE_CHECKING:
    from torch import Tensor

    from asyncgrpo.rewards.scoring import ScoredCompletion


class Algorithm(Protocol):
    per_sample: bool
    """True: each sample is its own unit (`rollout.group_size: 1`), and a stale one counts whether it finished or
    not; False: the group is the unit, and its stale samples are its finished members."""
    watches_no_signal: bool
    """Whether a run of groups whose rewards are all equal is warned about (unless rollout.filter_zero_variance)."""
    metric_keys: tuple[str, ...]
    """The keys `step_metrics` adds to every training step's metrics (metric_names.py)."""

    def __init__(self, cfg: Config) -> None: ...

    # -- the recipe
    def config_problems(self) -> list[str]:
        """What is wrong with the recipe for this algorithm, one message per broken rule naming the dotted keys, their
        values and the fix (as config's own rules do); [] when it suits. Pure: reads the recipe only."""

    # -- the scoring stage
    def build_scorer(self, tokenizer: Any) -> Any | None:
        """What scores the samples of `train` in place of the reward functions (the run starts it with
        `await start()` and stops it with `await aclose()`), or None: the reward functions."""

    def simulated_scorer(self) -> Any | None:
        """The scorer of `simulate` in place of the reward functions, on virtual time, or None."""

    def scoring_state(self, scorer: Any) -> str:
        """Appended to the stall diagnostic's "N being scored": what the scorer is doing ("" to add nothing)."""

    # -- judging a unit
    def judge(self, prompt: Prompt, completions: Sequence[Completion], scored: Sequence[Any]) -> tuple[Rollout, ...] | Drop:
        """The trainable rollouts of the scored survivors `completions` (`scored`: the scorer's answers, one
        each, in order), or the drop."""

    # -- the trainer
    def token_advantages(self, rollouts: Sequence[Rollout | None], logp_gen: Tensor, mask: Tensor) -> Tensor:
        """The advantages of a micro-batch: `[B]` (one per sequence) or `[B, C]` (one per token), for the rows of
        `logp_gen` and `mask` `[B, C]`; a None row is a filler without loss tokens."""

    def advantage_values(self, rollouts: Sequence[Rollout]) -> list[float]:
        """The values `advantage/mean` and `advantage/std` describe for a step's rollouts (at least one)."""

    def step_metrics(self, groups: Sequence[Group]) -> dict[str, float]:
        """The values of `metric_keys` for a trained batch."""

    # -- before a model is loaded
    def preflight(self) -> None:
        """ConfigError for a mistake of this algorithm's settings found without loading a model."""

    def devices(self) -> list[tuple[str, str]]:
        """(key, device) of every device this algorithm adds to the run's (checked by `train`)."""

    def describe_scoring(self) -> str:
        """`asyncgrpo check`'s line about what scores the samples."""

    # -- evaluation
    def eval_metrics(self, per_prompt: Sequence[Sequence[ScoredCompletion]], terms: Sequence[str]) -> dict[str, float | None]:
        """The `eval/*` values (`eval/failed_requests` aside, which evaluation counts) of held-out samples: `per_prompt`
        holds each prompt's scored samples (its failed ones left out; a prompt none of whose samples was scored is
        absent), `terms` the reward terms (`eval/reward/<term>`). None: a value there is nothing to compute from."""
