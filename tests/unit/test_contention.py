"""Generation and training sharing hardware: the simulator's fluid model (generation/contention.py) on virtual time, and
its fit (tuning/contention.py, fit_decode's and fit_trainer's use of it) on synthetic records whose truth is known."""

from __future__ import annotations

import asyncio
import random

import pytest

from asyncgrpo.commands.vtime import run_virtual
from asyncgrpo.generation.contention import SharedHardware, Side, Work
from asyncgrpo.tuning.contention import Overlap, busy_windows, fit_contended
from asyncgrpo.tuning.fit import fit_decode, fit_trainer


def test_work_runs_slower_exactly_while_the_other_side_is_busy():
    """Both start together: training (1 s of work, 2x slower) ends at 2.0 s; decoding (1.5 s of work, 3x slower) has done
    2/3 s of it by then and does the rest at full speed."""
    hardware = SharedHardware(decode_slowdown=3.0, train_slowdown=2.0)
    ends: dict[str, float] = {}

    async def side(name: Side, seconds: float) -> None:
        await hardware.perform(name, Work(seconds))
        ends[name] = asyncio.get_running_loop().time()

    async def main() -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(side("decode", 1.5))
            tg.create_task(side("train", 1.0))

    run_virtual(main())
    assert ends["train"] == pytest.approx(2.0, rel=1e-9)
    assert ends["decode"] == pytest.approx(2.0 + 1.5 - 2.0 / 3, rel=1e-9)
    assert not hardware.busy("decode") and not hardware.busy("train")


def test_work_cancelled_midway_says_how_much_it_did():
    hardware = SharedHardware(decode_slowdown=1.0, train_slowdown=4.0)
    work = Work(2.0)

    async def main() -> None:
        training = asyncio.create_task(hardware.perform("train", work))
        await asyncio.sleep(0.5)  # idle: 0.5 s of work
        decoding = asyncio.create_task(hardware.perform("decode", Work(10.0)))
        await asyncio.sleep(1.0)  # contended: 0.25 s of work
        training.cancel()
        with pytest.raises(asyncio.CancelledError):
            await training
        decoding.cancel()

    run_virtual(main())
    assert work.done_s == pytest.approx(0.75, rel=1e-9) and not hardware.busy("train")


def test_overlap_sums_the_busy_seconds_inside_a_span():
    windows = busy_windows([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)])
    assert windows == [(0.0, 2.0), (3.0, 4.0)]
    overlap = Overlap(windows)
    assert overlap(1.5, 3.5) == pytest.approx(1.0) and overlap(2.0, 3.0) == 0.0 and overlap(-1.0, 10.0) == pytest.approx(3.0)


def _steps(truth_factor: float, per_token: float, rng: random.Random, *, contended_share: tuple[float, float]):
    """Train spans from the fluid model: generation busy for the first v seconds of each, v a random share of the span."""
    steps, contended = [], []
    for _ in range(40):
        tokens = rng.randint(600, 1400)
        work = per_token * tokens
        v = rng.uniform(*contended_share) * work * truth_factor  # busy throughout v: v / factor of work done
        v = min(v, work * truth_factor)
        elapsed = v + (work - v / truth_factor)
        steps.append((elapsed * (1 + rng.gauss(0, 0.01)), tokens))
        contended.append(v)
    return steps, contended


def test_trainer_contention_is_recovered_from_steps_that_overlapped_generation_by_different_amounts():
    steps, contended = _steps(2.5, 0.0005, random.Random(3), contended_share=(0.0, 1.0))
    fit = fit_trainer(steps, contended)
    assert fit.contention == pytest.approx(2.5, rel=0.05) and fit.contention_se is not None
    assert fit.token_time_s == pytest.approx(0.0005, rel=0.03) and fit.overhead_s == 0.0
    assert fit_trainer(steps).contention == 1.0  # told nothing of the overlap: the time is all the trainer's own


def test_a_run_whose_steps_all_overlapped_generation_shows_no_contention():
    """Every span contended (an asynchronous run that always decodes): the slowdown and a slower trainer are one and the same."""
    steps, _ = _steps(2.5, 0.0005, random.Random(4), contended_share=(1.0, 1.0))
    fit = fit_trainer(steps, [s for s, _ in steps])
    assert fit.contention == 1.0 and fit.token_time_s == pytest.approx(sum(s for s, _ in steps[1:]) / sum(t for _, t in steps[1:]))


def test_no_contention_in_the_records_is_not_invented():
    rng = random.Random(5)
    steps = [(0.0005 * t * (1 + rng.gauss(0, 0.02)), t) for t in (rng.randint(600, 1400) for _ in range(40))]
    assert fit_trainer(steps, [rng.uniform(0, s) for s, _ in steps]).contention == 1.0


def test_decode_contention_is_recovered_from_rollouts_inside_and_outside_training():
    """One rollout at a time (no batch slowdown), training every other second: each rollout's end from the fluid model."""
    rng = random.Random(6)
    factor, per_token, prefill = 1.8, 0.002, 0.03
    training = [(2.0 * k, 2.0 * k + 1.0) for k in range(400)]
    spans, t = [], 0.05
    for _ in range(300):
        tokens = rng.randint(50, 400)
        work, now = prefill + per_token * tokens, t
        while work > 1e-12:  # step through the training windows
            k, into = divmod(now, 2.0)
            contended = into < 1.0
            edge = 2.0 * k + (1.0 if contended else 2.0)
            rate = 1 / factor if contended else 1.0
            step = min(edge - now, work / rate)
            now, work = now + step, work - step * rate
        spans.append({"start": t, "end": now, "tokens": tokens, "outcome": "finished"})
        t = now + rng.uniform(0.01, 0.7)
    fit = fit_decode(spans, training=training)
    assert fit.contention == pytest.approx(factor, rel=0.01)
    assert fit.decode_s_per_token == pytest.approx(per_token, rel=0.01) and fit.prefill_s == pytest.approx(prefill, abs=0.005)
    plain = fit_decode(spans)
    assert plain.contention == 1.0 and plain.decode_s_per_token > per_token * 1.2  # without it, the slowdown is in every token


def test_fit_contended_needs_both_sides_and_a_slowdown_beyond_the_tolerance():
    elapsed, contended = [1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]
    assert fit_contended([(e,) for e in elapsed], elapsed, contended) is None  # never contended
    assert fit_contended([(1.0,), (2.0,), (3.0,), (4.0,)], [1.0, 2.04, 3.0, 4.04], [0.0, 2.04, 0.0, 4.04]) is None  # 2 % slower: noise


def test_a_few_uncontended_steps_are_too_few_to_tell_a_slowdown_from_a_load():
    """Two steps of forty trained while nothing decoded, and ran faster (a quieter moment of a shared machine): under
    MIN_SHARE of the time on that side, so no contention is claimed from them."""
    rng = random.Random(7)
    steps = [(0.0009 * t * (1 + rng.gauss(0, 0.01)), t) for t in (rng.randint(600, 1400) for _ in range(40))]
    contended = [s for s, _ in steps]
    for i in (10, 20):
        steps[i] = (steps[i][0] * 0.6, steps[i][1])
        contended[i] = 0.0
    assert fit_trainer(steps, contended).contention == 1.0
