"""Where generated tokens and generator time end up: trained, or wasted by reason. Pure counting, no I/O.

The collector calls these on its running counters (names in metric_names.py, kept across a
resume) at the three places a completion's fate is sealed:

- `rollout_ended`: a rollout ended (finished, failed or cancelled); its time from start to end,
  retries included, is generator time (`rollout/generation_ms_total`).
- `group_wasted`: a group's finished completions were thrown away, by waste reason: `stale`
  (cancelled or dropped as stale), `filtered` (zero reward variance), `failed` (every other drop:
  failed, too few survivors, invalid prompt, reward error); also the completions of a trained
  group that got no reward.
- `masked` (`rollout.on_stale: resume`): tokens of a kept group masked out of the loss as older than the bound.
- `step_trained`: a step trained its groups; their completions' tokens (the model's only: an
  episode's environment tokens are not generated) and generator time are
  the useful part (`rollout/trained_tokens_total`, `rollout/trained_generation_ms_total`).

Derived (telemetry/metrics.py): goodput = trained generation time / generation time, the trained
completions' mean length beside the stale ones'. Tokens a cancelled request had generated are
unknown to a real run (servers do not report them), so waste counts finished completions only;
the simulator knows the rest (commands/simulate.py).
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping

from asyncgrpo.metric_names import WASTE_REASONS
from asyncgrpo.types import DropReason, Group


def waste_reason(reason: DropReason) -> str:
    """The waste bucket of a drop reason."""
    return reason if reason in WASTE_REASONS else "failed"


def rollout_ended(counters: MutableMapping[str, int], seconds: float) -> int:
    """Count a rollout's generator time; returns it in whole milliseconds (what `Group.generation_ms` sums)."""
    ms = round(seconds * 1000)
    counters["rollout/generation_ms_total"] += ms
    return ms


def group_wasted(counters: MutableMapping[str, int], reason: DropReason, tokens: int) -> None:
    counters[f"rollout/wasted_tokens/{waste_reason(reason)}"] += tokens


def masked(counters: MutableMapping[str, int], tokens: int) -> None:
    """`rollout.on_stale: resume`: tokens of a kept group masked out of the loss as older than the bound (in the context, not
    trained); counted once, when masked (a masked token stays masked), whatever becomes of the group."""
    counters["rollout/masked_stale_tokens_total"] += tokens


def step_trained(counters: MutableMapping[str, int], groups: Iterable[Group]) -> None:
    for group in groups:
        counters["rollout/trained_completions_total"] += len(group.rollouts)
        counters["rollout/trained_tokens_total"] += sum(r.completion.model_tokens for r in group.rollouts)
        counters["rollout/trained_generation_ms_total"] += group.generation_ms
