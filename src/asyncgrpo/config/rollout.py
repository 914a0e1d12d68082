"""The rollout: section: groups, the staleness bound and policy, and the failure budget."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from asyncgrpo.config.section import Section


class RolloutConfig(Section):
    """Groups and steps, the staleness bound and its policy, and the failure budget (docs/concepts.md)."""

    group_size: int = Field(
        8, ge=1, description="Completions per prompt; GRPO compares completions within a group, so at least 2 (algorithm: distill: 1).",
    )
    groups_per_step: int = Field(16, ge=1, description="Groups trained per optimizer step.")
    max_staleness: int = Field(
        1, ge=0,
        description="K: most steps between the version that generated a group and the step that trains it; 0 = synchronous on-policy.",
    )
    on_stale: Literal["requeue", "drop", "wait", "patience", "resume"] = Field(
        "patience",
        description="The staleness policy (rollout/stale_policy.py; docs/benchmarks.md, 'Staleness policies'). requeue: a group cancelled "
        "as stale has its prompt generated again later; drop: it is dropped (dropped/stale); wait: each group targets a step and "
        "that step waits for its own groups (no waste, no length bias, less throughput); patience: requeue, but a ready batch waits "
        "up to rollout.patience_share of a step for groups the next step would cancel; resume: a rollout the next step would leave "
        "behind is interrupted and continued under the newest weights from the tokens it has (generation.backend scripted, local or http, "
        "runtime local or ray: local and Ray actors continue rollouts in place; "
        "http streams the requests, so an interruption keeps every token received; an env: episode keeps its finished turns "
        "and resumes the turn in progress, never interrupted in an environment call; agents are refused), "
        "tokens older than the bound masked out of the loss (rollout.max_masked_share, rollout.max_resumptions).",
    )
    max_masked_share: float = Field(
        0.5, ge=0, le=1,
        description="on_stale: resume: a group in which one rollout would have more than this share of its tokens masked as older "
        "than the bound is stale as a whole (its prompt requeued, as requeue does). Measured on the demo with stale groups "
        "(docs/benchmarks.md, bench/staleness_learning.py): with the bound at max_staleness for every token, 0 learned as well "
        "as patience per trained token and 0.5 worse (a rollout's masked first tokens can be the ones that decided its reward); "
        "with max_prefix_staleness 4 x max_staleness, 1 learned at least as well as patience.",
    )
    max_prefix_staleness: int | None = Field(
        None, ge=0,
        description="on_stale: resume: the bound for the tokens of a rollout with a resumed prefix (at least max_staleness): one whose "
        "tokens span versions, because it was interrupted and continued or, where rollouts continue in place (the local engine, Ray "
        "actors), went on under newer weights. Its tokens up to this many steps old stay in the loss, importance-weighted with their "
        "own behaviour logprobs (truncated as the loss does); older ones are masked. Every other rollout, in any group, keeps "
        "max_staleness. Unset: max_staleness, for every token. With max_masked_share 1 and max_resumptions 8, 4 x max_staleness "
        "met issue 23's goals on the simulated frontier (docs/concepts.md).",
    )
    max_resumptions: int = Field(
        4, ge=0,
        description="on_stale: resume: times one rollout may be interrupted and resumed; the group of a rollout left behind once more "
        "is stale as a whole (its prompt requeued, as requeue does).",
    )
    over_admit_groups: int = Field(
        0, ge=0,
        description="Opt-in: admit this many groups beyond the staleness capacity; they race for the steps within the bound and the "
        "slowest are cancelled as stale (more throughput at K=1, more waste and length bias; not with on_stale: wait).",
    )
    partial_groups: bool = Field(
        False,
        description="Opt-in: when a batch is ready, a group the next step would cancel as stale that has at least min_group_survivors "
        "finished members ends with them (the others cancelled) and is trained now: less waste, more length bias (not with on_stale: wait).",
    )
    patience_share: float = Field(
        1.0, ge=0, description="on_stale: patience: longest wait for stragglers, as a share of the last step's training time.",
    )
    max_requeues: int = Field(2, ge=0, description="Times one prompt may be requeued as stale; after that it is dropped as stale.")
    min_group_survivors: int = Field(
        2, ge=1, description="A group with fewer surviving rollouts is dropped (GRPO's advantages need 2; algorithm: distill: 1).",
    )
    max_generation_failures: int = Field(0, ge=0, description="Consecutive all-failed groups tolerated; one more fails the run.")
    drop_window: int = Field(64, ge=1, description="Groups in the window of the drop-fraction rules (they apply once this many finished).")
    max_drop_fraction: float = Field(
        0.5, gt=0, le=1,
        description="More than this fraction of the window dropped (failed, too few survivors, invalid prompt, reward error) fails the run; "
        "1.0 turns the rule off.",
    )
    max_filtered_fraction: float = Field(
        0.9, gt=0, le=1, description="More than this fraction of the window filtered (zero reward variance) fails the run; 1.0 turns the rule off.",
    )
    filter_zero_variance: bool = Field(
        False, description="Drop groups whose rewards are all equal (their advantages are all 0: nothing to learn), counted as filtered.",
    )
    mask_truncated: bool = Field(False, description="Mask completions cut at max_new_tokens out of the loss.")
    stall_timeout_s: float | None = Field(
        None, gt=0,
        description="No rollout (or episode turn) finished and no step trained for this long raises StallError (default: rollout deadline "
        "(with an env: + 2 x env.step_timeout_s + env.cancel_grace_s, a turn's longest wait) + reward time limit of every function "
        "(distill: distill.timeout_s) + probe interval + 60 s; `asyncgrpo check` prints it).",
    )

    @property
    def trained_staleness_bound(self) -> int:
        """The oldest a trained token may be, in steps: max_prefix_staleness under resume when set, else max_staleness."""
        return self.max_staleness if self.max_prefix_staleness is None else self.max_prefix_staleness
