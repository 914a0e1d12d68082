"""timeline.jsonl agrees with the accounting: every take ends once, every rollout span is inside the run,
and the step spans follow one another; beyond the span limit, rollouts are counted, not lost."""

from __future__ import annotations

from collections import Counter

from asyncgrpo.commands.simulate import simulate
from asyncgrpo.config import load_config
from asyncgrpo.telemetry.metrics import read_jsonl

FAULTY = [
    "train.max_steps=40",
    "simulate.faults=[{error: http_500, rate: 0.1}, {error: http_400, rate: 0.02}, {error: hang, rate: 0.01}]",
]


def run(tmp_path, *overrides):
    sim = simulate(load_config("recipes/simulate.yaml", [*FAULTY, *overrides]), output_dir=tmp_path)
    return sim, read_jsonl(tmp_path / "timeline.jsonl")


def test_every_take_appears_once_and_the_endings_match_the_accounting(tmp_path):
    sim, lines = run(tmp_path)
    acc = sim.collector.accounting
    takes = [line for line in lines if line["e"] == "take"]
    keys = Counter(line["take"] for line in takes)
    assert max(keys.values()) == 1 and len(keys) == acc.taken - acc.in_flight
    endings = Counter(line["ending"] for line in takes)
    left = Counter(line["outcome"] for line in lines if line["e"] == "buffered")
    assert endings["requeued"] == acc.requeued > 0
    assert left["trained"] == acc.trained == len(sim.trainer.trained_groups)
    assert endings["buffered"] == left["trained"] + left["stale"] + acc.buffered
    assert {r: endings[r] for r in acc.dropped if r != "stale"} == {r: n for r, n in acc.dropped.items() if r != "stale"}
    assert endings["stale"] + left["stale"] == acc.dropped["stale"]
    buffered_takes = {line["take"] for line in takes if line["ending"] == "buffered"}
    assert {line["take"] for line in lines if line["e"] == "buffered"} <= buffered_takes


def test_rollout_and_step_spans_are_ordered_and_counted(tmp_path):
    sim, lines = run(tmp_path)
    rollouts = [line for line in lines if line["e"] == "rollout"]
    outcomes = Counter(line["outcome"] for line in rollouts)
    assert outcomes["failed"] == sim.collector.counters["rollout/failed_total"] > 0
    assert sum(line["tokens"] for line in rollouts) == sim.collector.counters["rollout/generated_tokens_total"]
    assert all(0 <= line["start"] <= line["end"] <= sim.virtual_time_s + 1e-6 for line in rollouts)  # times rounded to the µs
    steps = [line for line in lines if line["e"] == "step"]
    assert [s["step"] for s in steps] == list(range(sim.result.steps))
    for before, after in zip(steps, steps[1:]):
        assert before["wait"][0] <= before["train"][0] <= before["sync"][0] <= before["sync"][1] <= after["wait"][0] + 1e-6
    assert all(abs((s["train"][1] - s["train"][0]) - sim.cfg.simulate.step_time_s) < 1e-6 for s in steps)
    busy = sum(line["end"] - line["start"] for line in rollouts)
    end = steps[-1]["sync"][1]
    timeline = sim.collector.books.observer
    assert abs(timeline.utilisation(timeline._t0 + end) - busy / (sim.cfg.generation.max_inflight * end)) < 1e-6


def test_beyond_the_limit_rollout_spans_are_counted_per_step(tmp_path):
    sim, lines = run(tmp_path, "logging.timeline_max_rollouts=100")
    rollouts = [line for line in lines if line["e"] == "rollout"]
    assert len(rollouts) == 100
    unrecorded = Counter()
    for line in lines:
        unrecorded.update(line.get("unrecorded", {}))
    written = Counter(line["outcome"] for line in rollouts)
    assert written["failed"] + unrecorded["failed"] == sim.collector.counters["rollout/failed_total"]
    tokens = sum(line["tokens"] for line in rollouts) + unrecorded["tokens"]
    assert tokens == sim.collector.counters["rollout/generated_tokens_total"]
    assert len([line for line in lines if line["e"] == "take"]) == sim.collector.accounting.taken - sim.collector.accounting.in_flight
