"""Resumable rollouts' pure arithmetic (rollout/resume.py): joining prefixes, resumed requests, per-token masks."""

from __future__ import annotations

import pytest

from asyncgrpo.rollout.resume import join, mask_stale, masked_share, partial, resumed_request, version_span
from asyncgrpo.rollout.stale_policy import ResumePolicy
from asyncgrpo.types import Completion, GenerationRequest, Group, Prompt, Rollout, SamplingParams, TokenSink
from tests.sim.fakes import recipe


def completion(ids: tuple[int, ...], versions: tuple[int, ...], finish: str = "stop") -> Completion:
    return Completion(token_ids=ids, logprobs=tuple(-i / 10 for i in ids), versions=versions, finish_reason=finish,  # type: ignore[arg-type]
                      dispatch_version=versions[-1] if versions else 0, text="t")


def group(*completions: Completion) -> Group:
    prompt = Prompt(id=0, text="p", token_ids=(1, 2))
    return Group(prompt=prompt, rollouts=tuple(Rollout(completion=c, reward=0.0, advantage=0.0) for c in completions), seq=1)


def test_join_keeps_every_token_of_prefix_and_continuation_in_order() -> None:
    sink = TokenSink()
    sink.extend((5, 6), (-0.5, -0.6), (0, 0))
    prefix = partial(sink, 0)
    joined = join(prefix, completion((7, 8, 9), (2, 2, 2), "length"))
    assert joined.token_ids == (5, 6, 7, 8, 9) and joined.versions == (0, 0, 2, 2, 2)
    assert joined.logprobs == (-0.5, -0.6, -0.7, -0.8, -0.9) and joined.finish_reason == "length" and joined.dispatch_version == 2
    assert join(None, joined) is joined and join(partial(TokenSink(), 0), joined) is joined


def test_a_resumed_request_carries_the_prefix_as_context_and_the_budget_left() -> None:
    request = GenerationRequest(request_id="3-0-0-1", prompt_id=3, prompt_token_ids=(1, 2), sampling=SamplingParams(max_new_tokens=5), seed=9)
    sink = TokenSink()
    first = resumed_request(request, None, sink)
    assert first.prompt_token_ids == (1, 2) and first.resumed_tokens == 0 and first.sink is sink
    again = resumed_request(request, completion((7, 8), (0, 0)), sink)
    assert again.prompt_token_ids == (1, 2, 7, 8) and again.resumed_tokens == 2 and again.sampling.max_new_tokens == 3
    assert again.request_id == request.request_id and again.seed == request.seed
    spent = resumed_request(request, completion((7, 8, 9, 10, 11), (0,) * 5), sink)
    assert spent.sampling.max_new_tokens == 0  # the backend answers with an empty continuation


def test_mask_stale_masks_exactly_the_tokens_older_than_the_bound_and_counts_them_once() -> None:
    g = group(completion((1, 2, 3, 4), (0, 1, 2, 3)), completion((5, 6), (3, 3)))
    masked = mask_stale(g, step=3, bound=1, prefix_bound=None, max_share=0.5)
    assert masked is not None
    again, added = masked
    assert added == 2 and again.rollouts[0].completion.loss_mask == (False, False, True, True)
    assert again.rollouts[1] is g.rollouts[1]  # untouched rollouts are kept as they are
    assert again.generation_version == 2  # the oldest trained token: within the bound at step 3
    assert mask_stale(again, step=3, bound=1, prefix_bound=None, max_share=0.5) == (again, 0)  # nothing masked twice
    assert masked_share(g.rollouts[0].completion, step=3, bound=1) == 0.5
    assert mask_stale(g, step=4, bound=1, prefix_bound=None, max_share=0.5) is None  # 3 of 4 would be masked: over the limit, stale
    assert version_span([again]) == 1 and version_span([g]) == 3


def test_a_fully_masked_rollout_does_not_hold_its_group_back() -> None:
    g = group(completion((1, 2), (0, 0)), completion((3, 4), (2, 2)))
    masked = mask_stale(g, step=2, bound=1, prefix_bound=None, max_share=1.0)
    assert masked is not None and masked[1] == 2 and masked[0].generation_version == 2


def test_the_resume_policy_refuses_a_group_resumed_too_often_or_with_a_finished_rollout_past_the_limit() -> None:
    policy = ResumePolicy(recipe(rollout={"on_stale": "resume", "max_resumptions": 2, "max_masked_share": 0.5}).rollout)
    fresh, old = completion((1, 2), (2, 2)), completion((1, 2), (0, 0))
    assert policy.may_resume([fresh, None], [0, 1], step=2)
    assert not policy.may_resume([fresh, None], [2], step=2)
    assert not policy.may_resume([old, None], [0], step=3)  # every token of `old` is past K = 1 at step 3
    assert policy.may_resume([old, None], [0], step=1)


@pytest.mark.parametrize("key, value", [("rollout.partial_groups", True), ("algorithm", "distill")])
def test_resume_refuses_what_it_is_not_built_for(key: str, value: object) -> None:
    from asyncgrpo.algorithms.registry import algorithm_for
    from asyncgrpo.config import load_config
    from asyncgrpo.errors import ConfigError

    overrides = ["rollout.on_stale=resume", f"{key}={str(value).lower()}"]
    with pytest.raises(ConfigError, match=rf"rollout.on_stale = 'resume' with {key}"):
        algorithm_for(load_config("recipes/simulate_nemo.yaml", overrides))  # an algorithm's refusal: when it is built


@pytest.mark.parametrize("recipe_path", ["recipes/agent_calculator.yaml", "recipes/agent_command_calculator.yaml"])
def test_resume_refuses_agents_naming_the_factory_kind_and_accepts_environments(recipe_path: str) -> None:
    from asyncgrpo.config import load_config
    from asyncgrpo.errors import ConfigError

    with pytest.raises(ConfigError, match=r"rollout.on_stale = 'resume' with env.factory = 'agent(-command)?:.*agents \(agent:, "
                       r"agent-command:\) do not.*Fix: choose another rollout.on_stale"):
        load_config(recipe_path, ["rollout.on_stale=resume"])
    cfg = load_config("recipes/calculator.yaml", ["rollout.on_stale=resume"])  # an environment (module:Class): resumed
    assert cfg.env is not None and cfg.rollout.on_stale == "resume"


def test_resume_is_accepted_on_ray_generator_actors_which_continue_rollouts_in_place() -> None:
    from asyncgrpo.config import load_config
    from asyncgrpo.generation.ray_pool import RayGenerator

    cfg = load_config("recipes/demo.yaml", ["rollout.on_stale=resume", "runtime=ray"])
    assert cfg.rollout.on_stale == "resume" and cfg.runtime == "ray"
    assert RayGenerator.continues_in_flight  # each actor's local engine stamps every token's version: nothing to interrupt


def test_resume_is_accepted_on_the_http_backend() -> None:
    from asyncgrpo.config import load_config

    cfg = load_config("recipes/simulate_nemo.yaml", ["rollout.on_stale=resume", "generation.backend=http",
                                                      "generation.http.base_urls=[http://localhost:1]"])
    assert cfg.rollout.on_stale == "resume" and cfg.generation.backend == "http"


@pytest.mark.parametrize("overrides", [["rollout.on_stale=resume", "rollout.max_staleness=2", "rollout.max_prefix_staleness=1"],
                                       ["rollout.on_stale=patience", "rollout.max_prefix_staleness=4"]])
def test_max_prefix_staleness_needs_resume_and_at_least_max_staleness(overrides: list[str]) -> None:
    from asyncgrpo.config import load_config
    from asyncgrpo.errors import ConfigError

    with pytest.raises(ConfigError, match=r"rollout.max_prefix_staleness = \d+ with rollout.on_stale"):
        load_config("recipes/simulate_nemo.yaml", overrides)


def test_a_resumed_groups_own_bound_masks_only_the_tokens_past_it() -> None:
    g = group(completion((1, 2, 3, 4), (0, 1, 2, 3)))
    resumed = Group(prompt=g.prompt, rollouts=g.rollouts, seq=1, max_staleness=2)
    policy = ResumePolicy(recipe(rollout={"on_stale": "resume", "max_staleness": 1, "max_prefix_staleness": 2}).rollout)
    masked = policy.mask(resumed, 3)
    assert masked is not None and masked[0].rollouts[0].completion.loss_mask == (False, True, True, True) and masked[1] == 1
    again = policy.mask(g, 3)  # the bound is the rollout's own (its tokens span versions), whatever the group says
    assert again is not None and again[0].rollouts == masked[0].rollouts
    assert policy.mask(group(completion((1, 2, 3, 4), (1, 1, 1, 1))), 3) is None  # one version: held to K, masked whole


def test_a_buffered_group_past_the_bound_at_a_take_is_masked_again_and_kept_if_that_brings_it_within() -> None:
    import asyncio

    from tests.sim.fakes import ProgrammedGenerator, make_collector

    cfg = recipe(rollout={"on_stale": "resume", "max_staleness": 1, "max_masked_share": 0.5})
    collector = make_collector(cfg, ProgrammedGenerator())
    kept, dropped = group(completion((1, 2, 3, 4), (1, 1, 2, 2))), group(completion((1, 2, 3, 4), (0, 1, 1, 2)))
    buffer = collector.batches.buffer
    for _ in range(2):  # two takes, buffered
        collector.books.take()
        collector.accounting.buffer()
    buffer.put(kept)
    buffer.put(dropped)

    async def at_step_3() -> None:
        collector.batches._drop_stale_buffered(3)

    asyncio.run(at_step_3())
    assert [g.rollouts[0].completion.loss_mask for g in buffer.groups()] == [(False, False, True, True)]
    assert collector.counters["rollout/masked_stale_tokens_total"] == 2 and collector.counters["rollout/dropped/stale"] == 1


def test_the_prefix_bound_is_a_resumed_rollouts_own_and_not_its_siblings() -> None:
    # rollout.max_prefix_staleness bounds a rollout with a resumed prefix (tokens of more than one version); a sibling that was
    # generated whole under one version keeps K, also in a group where another rollout was resumed.
    resumed, whole = completion((1, 2), (1, 3)), completion((5, 6), (1, 1))
    masked = mask_stale(group(resumed, whole), step=4, bound=1, prefix_bound=3, max_share=1.0)
    assert masked is not None and masked[1] == 2
    assert [r.completion.loss_mask for r in masked[0].rollouts] == [None, (False, False)]
    assert mask_stale(group(resumed, whole), step=4, bound=1, prefix_bound=3, max_share=0.5) is None  # `whole` all masked
    policy = ResumePolicy(recipe(rollout={"on_stale": "resume", "max_prefix_staleness": 3}).rollout)
    assert policy.may_resume([resumed, None], [0], step=4) and not policy.may_resume([whole, None], [0], step=4)
