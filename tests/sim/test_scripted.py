"""The scripted backend's weight publication: takes virtual time, and can fail or hang as configured."""

from __future__ import annotations

import asyncio

from asyncgrpo.config import ScriptedConfig
from asyncgrpo.generation.scripted import ScriptedGenerator
from asyncgrpo.generation.weight_sync import WeightSyncError
from asyncgrpo.simulate import simulate
from asyncgrpo.vtime import run_virtual
from tests.sim.fakes import recipe


def scripted(**fields) -> ScriptedGenerator:
    return ScriptedGenerator(ScriptedConfig.model_validate(fields), seed=0, max_new_tokens=8)


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
    cfg = recipe(generation={"scripted": {"weight_sync_faults": [{"error": "fail", "from_s": 3.0}]}}, train={"max_steps": 10})
    sim = simulate(cfg)
    d = sim.result.diagnostic
    assert sim.result.outcome == "failed" and d.kind == "weight_sync" and isinstance(d.original, WeightSyncError)
    assert 1 <= sim.result.steps < 10


def test_a_hanging_publication_ends_at_the_weight_sync_deadline():
    cfg = recipe(
        generation={"weight_sync_timeout_s": 20.0, "scripted": {"weight_sync_faults": [{"error": "hang", "rate": 1.0}]}},
        train={"max_steps": 10},
    )
    sim = simulate(cfg)
    assert sim.result.outcome == "failed" and sim.result.diagnostic.kind == "weight_sync"
    assert sim.result.steps == 1 and 20.0 <= sim.virtual_time_s < 25.0  # step 0 trained; publishing version 1 hung


def test_publication_faults_are_seeded_per_version():
    def failing_versions(seed):
        gen = ScriptedGenerator(
            ScriptedConfig.model_validate({"weight_sync_faults": [{"error": "fail", "rate": 0.5}]}), seed=seed, max_new_tokens=8
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
    cfg = recipe(generation={"scripted": {"latency_s": {"dist": "const", "value": 0.0}}}, train={"max_steps": 5})
    sim = simulate(cfg)
    report = sim.report()
    assert sim.result.outcome == "completed" and sim.result.steps == 5
    assert report["capacity_bound_completions_per_s"] == 2.0  # groups_per_step 1 x group_size 2 / step_time_s 1
    assert 0.9 <= report["efficiency"] <= 1.0
