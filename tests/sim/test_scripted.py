"""The scripted backend's weight publication: takes virtual time, and can fail or hang as configured."""

from __future__ import annotations

import asyncio

from asyncgrpo.commands.simulate import simulate
from asyncgrpo.commands.vtime import run_virtual
from asyncgrpo.config import SimulateConfig
from asyncgrpo.generation.scripted import ScriptedGenerator
from asyncgrpo.generation.weight_sync import WeightSyncError
from tests.sim.fakes import recipe


def scripted(**fields) -> ScriptedGenerator:
    return ScriptedGenerator(SimulateConfig.model_validate(fields), seed=0, max_new_tokens=8)


def test_a_publication_serves_the_old_version_until_it_has_taken_its_time():
    gen = scripted(weight_sync_s={"dist": "const", "value": 2.5})

    async def main():
        loop = asyncio.get_running_loop()
        publication = asyncio.create_task(gen.load_weights(None, 1))
        await asyncio.sleep(2.4)
        assert gen.serving_version == 0
        await publication
        return loop.time(), gen.serving_version

    assert run_virtual(main()) == (2.5, 1)


def test_a_failing_publication_fails_the_run_as_weight_sync():
    cfg = recipe(simulate={"weight_sync_faults": [{"error": "fail", "from_s": 3.0}]}, train={"max_steps": 10})
    sim = simulate(cfg)
    d = sim.result.diagnostic
    assert sim.result.outcome == "failed" and d.kind == "weight_sync" and isinstance(d.original, WeightSyncError)
    assert 1 <= sim.result.steps < 10


def test_a_hanging_publication_ends_at_the_weight_sync_deadline():
    cfg = recipe(
        generation={"weight_sync_timeout_s": 20.0}, simulate={"weight_sync_faults": [{"error": "hang", "rate": 1.0}]},
        train={"max_steps": 10},
    )
    sim = simulate(cfg)
    assert sim.result.outcome == "failed" and sim.result.diagnostic.kind == "weight_sync"
    assert sim.result.steps == 1 and 20.0 <= sim.virtual_time_s < 25.0  # step 0 trained; publishing version 1 hung


def test_publication_faults_are_seeded_per_version():
    def failing_versions(seed):
        gen = ScriptedGenerator(
            SimulateConfig.model_validate({"weight_sync_faults": [{"error": "fail", "rate": 0.5}]}), seed=seed, max_new_tokens=8
        )

        async def main():
            failed = []
            for version in range(1, 30):
                try:
                    await gen.load_weights(None, version)
                except WeightSyncError:
                    failed.append(version)
            return failed

        return run_virtual(main())

    assert failing_versions(0) == failing_versions(0) and 5 < len(failing_versions(0)) < 25
    assert failing_versions(0) != failing_versions(1)


def test_a_zero_latency_runs_with_the_trainer_as_the_bound():
    # const 0 is a valid latency (generation costs nothing); it used to divide by zero in the report's
    # generation capacity, then was refused. The bound is then the training capacity alone.
    cfg = recipe(simulate={"latency_s": {"dist": "const", "value": 0.0}}, train={"max_steps": 5})
    sim = simulate(cfg)
    report = sim.report()
    assert sim.result.outcome == "completed" and sim.result.steps == 5
    assert report["capacity_bound_completions_per_s"] == 2.0  # groups_per_step 1 x group_size 2 / simulate.step_time_s 1
    assert 0.9 <= report["efficiency"] <= 1.0


def _request(prompt_id: int, take: int, member: int, max_new_tokens: int = 4096):
    from asyncgrpo.types import GenerationRequest, SamplingParams

    return GenerationRequest(
        request_id=f"{prompt_id}-0-{take}-{member}", prompt_id=prompt_id, prompt_token_ids=(1,),
        sampling=SamplingParams(max_new_tokens=max_new_tokens), seed=0,
    )


TOKEN_MODEL = {"tokens": {"dist": "lognormal", "median": 200, "sigma": 1.0},
               "token_model": {"rollout_sigma": 0.0, "prefill_s": 0.5, "decode_s_per_token": 0.01, "batch_knee": 2}}


def test_token_model_lengths_belong_to_the_prompt_across_members_and_requeues():
    gen = ScriptedGenerator(SimulateConfig.model_validate(TOKEN_MODEL), seed=3, max_new_tokens=4096)

    async def lengths(prompt_id):
        return [len((await gen.generate(_request(prompt_id, take, member))).token_ids) for take in range(3) for member in range(2)]

    per_prompt = [run_virtual(lengths(p)) for p in range(6)]
    assert all(len(set(ls)) == 1 for ls in per_prompt)  # no rollout spread: every take and member of a prompt alike
    assert len({ls[0] for ls in per_prompt}) == 6  # prompts differ
    assert gen.drawn_lengths == {p: ls for p, ls in enumerate(per_prompt)}
    again = ScriptedGenerator(SimulateConfig.model_validate(TOKEN_MODEL), seed=3, max_new_tokens=4096)
    assert [run_virtual(again.generate(_request(p, 5, 9))).token_ids.__len__() for p in range(6)] == [ls[0] for ls in per_prompt]


def test_token_model_latency_is_prefill_plus_decode_slowed_past_the_knee():
    gen = ScriptedGenerator(SimulateConfig.model_validate(TOKEN_MODEL), seed=0, max_new_tokens=4096)

    async def finish_times(n):
        loop = asyncio.get_running_loop()
        start = loop.time()
        ends = []

        async def one(member):
            completion = await gen.generate(_request(0, 0, member))
            ends.append((loop.time() - start, len(completion.token_ids)))

        async with asyncio.TaskGroup() as tg:
            for member in range(n):
                tg.create_task(one(member))
        return ends

    (alone, tokens), = run_virtual(finish_times(1))
    assert alone == 0.5 + tokens * 0.01
    # Four at once on a knee of 2: the later dispatches see 3 and 4 open, so decode at 1.5x and 2x.
    assert sorted(t for t, _ in run_virtual(finish_times(4))) == [0.5 + tokens * 0.01 * s for s in (1, 1, 1.5, 2)]


def test_the_stub_trainer_takes_time_per_trained_token():
    cfg = recipe(simulate={"tokens": {"dist": "const", "value": 25}, "token_time_s": 0.02}, train={"max_steps": 3})
    sim = simulate(cfg)
    assert [r.step_s for r in sim.records] == [1.0, 1.0, 1.0]  # 1 group x 2 completions x 25 tokens x 20 ms
    report = sim.report()
    assert report["trained_tokens"] == 150 and report["capacity_tokens_per_s"]["training"] == 50.0


def test_interleaved_attempts_draw_their_own_streams_from_one_random(monkeypatch):
    """Every attempt's outcome is that of a fresh `Random((run seed, request id, attempt))`, however attempts
    interleave, and no attempt allocates a `Random` of its own (issue 22: 2.5 KB per attempt in flight)."""
    import random

    from asyncgrpo.distributions import sample
    from asyncgrpo.generation import scripted as module
    from asyncgrpo.types import GenerationRequest, SamplingParams

    latency = {"dist": "lognormal", "median": 1.0, "sigma": 1.0}
    tokens = {"dist": "uniform", "low": 1, "high": 8}
    gen = ScriptedGenerator(SimulateConfig.model_validate({"latency_s": latency, "tokens": tokens}), seed=5, max_new_tokens=8)
    made = []

    class Counted(random.Random):
        def __init__(self, *seed: object) -> None:
            made.append(seed)
            super().__init__(*seed)

    real = random.Random
    monkeypatch.setattr(random, "Random", Counted)  # the module the backend reads it from
    requests = [GenerationRequest(f"r{i}", i, (1,), SamplingParams(max_new_tokens=8), seed=i) for i in range(6)]

    async def main():
        return await asyncio.gather(*(gen.generate(r) for r in requests + requests[:2]))  # r0, r1: a second attempt each

    completions = run_virtual(main())
    assert made == []
    cfg = gen.cfg
    for n, (request, completion) in enumerate(zip(requests + requests[:2], completions)):
        rng = real(module._stream_seed(5, request.request_id, 1 + (n >= len(requests))))
        sample(cfg.latency_s, rng)
        length = max(1, min(8, round(sample(cfg.tokens, rng))))
        start = rng.randrange(len(gen._token_pool) - length + 1)
        assert completion.token_ids == gen._token_pool[start : start + length]
        assert completion.text == f"{request.request_id}:{rng.getrandbits(32)}"


def test_an_attempt_in_flight_is_one_coroutine_of_the_backend_over_its_sleep():
    # Issue 22: an attempt's decode wait was a coroutine of its own, one more frame for every attempt in flight.
    from asyncgrpo.types import GenerationRequest, SamplingParams

    gen = scripted(latency_s={"dist": "const", "value": 1.0})
    request = GenerationRequest("r0", 0, (1,), SamplingParams(max_new_tokens=8), seed=0)

    async def main():
        coro = gen.generate(request)
        task = asyncio.ensure_future(coro)
        await asyncio.sleep(0.5)
        chain, link = [], coro
        while hasattr(link, "cr_code"):
            chain.append(link.cr_code.co_name)
            link = link.cr_await
        await task
        return chain

    assert run_virtual(main()) == ["generate", "sleep"]
