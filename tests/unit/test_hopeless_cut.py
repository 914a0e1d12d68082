"""`resume`'s early cut (rollout/stale_policy.py `masked_past_limit`, `ResumePolicy.hopeless`; rollout/resumption.py
`Progress`): a running rollout whose tokens already masked make `rollout.max_masked_share` unreachable, whatever it still
generates, is cut; one that could still end at or under the limit never is."""

from __future__ import annotations

import itertools

from asyncgrpo.rollout.books import Books
from asyncgrpo.rollout.failures import FailurePolicy
from asyncgrpo.rollout.in_flight import InFlightGroup
from asyncgrpo.rollout.resume import masked_share
from asyncgrpo.rollout.resumption import Progress, Resuming, runner_for
from asyncgrpo.rollout.stale_policy import masked_past_limit, stale_policy
from asyncgrpo.types import Completion, Prompt, TokenSink
from tests.sim.fakes import recipe


def test_the_cut_is_never_premature_and_never_late_against_every_ending_within_the_budget() -> None:
    # Exhaustively: versions so far over 0..3, the step 2..4, K 0..1, budgets up to 6, shares 0..1. Every way the rollout can
    # still end (any count of further tokens within the budget, each of a version >= the serving one, so unmasked at `step`
    # and masked at no step before the one that masks the tokens so far): cut exactly when every one of them is past the limit.
    for n, step, bound, budget, share in itertools.product(range(5), (2, 3, 4), (0, 1), range(7), (0.0, 0.25, 0.5, 0.75, 1.0)):
        if n > budget:
            continue
        for versions in itertools.product(range(4), repeat=n):
            endings = [Completion(token_ids=(0,) * (n + more), logprobs=(0.0,) * (n + more), versions=versions + (step,) * more,
                                  finish_reason="stop", dispatch_version=0) for more in range(budget - n + 1)]
            doomed = all(masked_share(c, step=step, bound=bound) > share for c in endings)
            assert masked_past_limit(versions, step=step, bound=bound, budget=budget, max_share=share) == doomed, (
                versions, step, bound, budget, share)


def test_the_policy_cuts_a_group_when_one_running_rollout_is_doomed_under_the_widest_bound_and_no_other_policy_cuts() -> None:
    policy = stale_policy(recipe(rollout={"on_stale": "resume", "max_masked_share": 0.5}).rollout)  # K = 1
    doomed = ((0,) * 5, 8)  # 5 tokens of version 0, masked from step 2: 5 of at most 8 > 0.5
    hopeful = ((0,) * 4, 8)  # 4 of 8: it may still end at exactly the limit
    assert policy.hopeless([hopeful, doomed], step=2) and not policy.hopeless([hopeful], step=2)
    assert not policy.hopeless([doomed], step=1)  # at step 1 version 0 is within K = 1: nothing masked yet
    wide = stale_policy(recipe(rollout={"on_stale": "resume", "max_masked_share": 0.5, "max_prefix_staleness": 2}).rollout)
    assert not wide.hopeless([doomed], step=2) and wide.hopeless([doomed], step=3)  # a resumed group may keep 2-step-old tokens
    for other in ("patience", "requeue", "drop", "wait"):
        assert not stale_policy(recipe(rollout={"on_stale": other}).rollout).hopeless([doomed], step=9)


def test_progress_counts_an_episodes_finished_turns_its_turns_prefix_and_the_attempt_in_flight() -> None:
    sink = TokenSink()
    progress = Progress(64, (0, 0), sink)
    sink.extend([5, 6], [0.0, 0.0], [1, 1])
    assert progress.versions() == (0, 0, 1, 1)
    progress.prefix = Completion(token_ids=(5, 6), logprobs=(0.0, 0.0), versions=(1, 1), finish_reason="length", dispatch_version=1)
    sink.token_ids.clear(), sink.logprobs.clear(), sink.versions.clear()
    sink.extend([7], [0.0], [2])
    assert progress.versions() == (0, 0, 1, 1, 2)
    progress.turn_done(Completion(token_ids=(5, 6, 7), logprobs=(0.0,) * 3, versions=(1, 1, 2), finish_reason="stop", dispatch_version=2))
    assert progress.versions() == (0, 0, 1, 1, 2) and progress.prefix is None and progress.sink is None and progress.budget == 64


def test_a_publication_returns_the_doomed_group_to_be_cut_judging_only_members_awaiting_a_request() -> None:
    r = recipe(rollout={"on_stale": "resume", "max_masked_share": 0.5}).rollout  # K = 1
    runner = runner_for(stale_policy(r), Books(FailurePolicy.from_rollout(r)), continues_in_flight=False)
    assert isinstance(runner, Resuming)
    doomed, fine = (InFlightGroup(key=key, prompt=Prompt(id=key, text="p", token_ids=(1,)), size=1) for key in (1, 2))
    for group, versions in ((doomed, [0] * 5), (fine, [0] * 4)):
        sink = TokenSink()
        sink.extend([0] * len(versions), [0.0] * len(versions), versions)
        runner._progress[(group.key, 0)] = Progress(8, (), sink)
        group.dispatch_versions[0] = 2  # of the version now served: nothing to interrupt
    doomed.generating[0] = False  # in an environment call: its record may be of an episode it has given up
    assert list(runner.weights_published([doomed, fine], version=2, step=2)) == []
    doomed.generating[0] = fine.generating[0] = True
    assert list(runner.weights_published([doomed, fine], version=2, step=2)) == [doomed]
    assert list(runner.weights_published([fine], version=2, step=2)) == [] and set(runner._progress) == {(2, 0)}  # ended groups' go


def test_a_finished_member_masked_past_the_limit_dooms_its_group_while_the_others_still_generate() -> None:
    r = recipe(rollout={"on_stale": "resume", "max_masked_share": 0.5}).rollout  # K = 1
    runner = runner_for(stale_policy(r), Books(FailurePolicy.from_rollout(r)), continues_in_flight=False)
    assert isinstance(runner, Resuming)
    group = InFlightGroup(key=1, prompt=Prompt(id=0, text="p", token_ids=(1,)), size=2)
    group.completions[0] = Completion(token_ids=(0,) * 3, logprobs=(0.0,) * 3, versions=(0, 0, 1), finish_reason="stop",
                                      dispatch_version=0)  # 2 of its 3 tokens masked from step 2
    sink = TokenSink()
    sink.extend([0], [0.0], [2])
    runner._progress[(1, 1)] = Progress(8, (), sink)
    group.generating[1], group.dispatch_versions[1] = True, 2
    assert list(runner.weights_published([group], version=2, step=1)) == []  # at step 1 nothing is masked yet
    assert list(runner.weights_published([group], version=2, step=2)) == [group]
