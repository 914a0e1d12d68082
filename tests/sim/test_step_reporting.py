"""Every trained step is reported, whatever happens after its optimizer update: a failed or hung weight
sync, a stop request during the sync, an error while reporting. The records then match the weights."""

from __future__ import annotations

import asyncio

import pytest

from asyncgrpo.errors import PipelineError
from asyncgrpo.pipeline import run_pipeline
from asyncgrpo.training.stub import StubTrainer
from asyncgrpo.vtime import run_virtual
from tests.sim.fakes import ProgrammedGenerator, make_collector, recipe


class SyncFails(ProgrammedGenerator):
    """Publishing version `bad` raises, or never returns when `hang`."""

    def __init__(self, bad: int, *, hang: bool = False) -> None:
        super().__init__()
        self.bad, self.hang = bad, hang
        self.sync_cancelled = False
        self.hanging = asyncio.Event()

    async def load_weights(self, state, version):
        if version == self.bad:
            if not self.hang:
                raise OSError(28, "No space left on device")
            self.hanging.set()
            try:
                await asyncio.get_running_loop().create_future()
            except asyncio.CancelledError:
                self.sync_cancelled = True
                raise
        await super().load_weights(state, version)


def pipeline(cfg, generator, reported, on_step=None):
    async def record(step_record):
        reported.append(step_record.step)
        if on_step is not None:
            await on_step(step_record)

    collector = make_collector(cfg, generator)
    return run_pipeline(cfg, collector=collector, trainer=StubTrainer(cfg.simulate.step_time_s), generator=generator, on_step=record)


def test_a_failed_weight_sync_still_reports_the_step_that_trained_and_counts_it():
    cfg = recipe()
    reported: list[int] = []
    result = run_virtual(pipeline(cfg, SyncFails(bad=3), reported))
    assert result.outcome == "failed" and result.diagnostic.kind == "weight_sync"
    assert "Step 2 trained, then failed while publishing its weights" in result.diagnostic.message
    assert reported == [0, 1, 2] and result.steps == 3  # three optimizer updates, three metrics lines


def test_a_stop_during_a_hung_weight_sync_abandons_the_sync_and_reports_the_step():
    cfg = recipe(generation={"weight_sync_timeout_s": 1000.0})
    generator = SyncFails(bad=2, hang=True)
    reported: list[int] = []

    async def main():
        task = asyncio.create_task(pipeline(cfg, generator, reported))
        loop = asyncio.get_running_loop()
        await generator.hanging.wait()  # step 1 trained; publishing its weights hangs
        await asyncio.sleep(5.0)
        task.cancel()  # what a signal does
        stopped_at = loop.time()
        with pytest.raises(asyncio.CancelledError):
            await task
        return loop.time() - stopped_at

    took = run_virtual(main())
    assert generator.sync_cancelled and took < 1.0
    assert reported == [0, 1]  # step 1 trained before the stop: reported, not lost with the sync


def test_an_error_while_reporting_a_step_is_not_called_a_training_failure():
    cfg = recipe()

    async def disk_full(record):
        if record.step == 1:
            raise RuntimeError("metrics sink broke")

    result = run_virtual(pipeline(cfg, ProgrammedGenerator(), [], on_step=disk_full))
    d = result.diagnostic
    assert result.outcome == "failed" and d.kind == "step_report" and result.steps == 2
    assert "Step 1 trained, then failed while reporting it" in d.message and "Training step" not in d.message


def test_a_pipeline_error_raised_while_reporting_is_the_runs_diagnostic_unchanged():
    from asyncgrpo.errors import Diagnostic

    cfg = recipe()
    mine = Diagnostic(kind="disk", message="cannot write metrics.jsonl")

    async def report(record):
        raise PipelineError(mine)

    result = run_virtual(pipeline(cfg, ProgrammedGenerator(), [], on_step=report))
    assert result.diagnostic is mine and result.steps == 1
