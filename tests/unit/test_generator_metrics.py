"""The generation backends' running totals reach metrics.jsonl as `generation/*` (metric_names.GENERATOR_COUNTERS).

Each numeric total an HTTP generator (with each weight publisher) or a Ray generator keeps has a metric name, so a
counter added to a backend cannot silently stay out of the run's metrics; a backend without a counter writes null.
"""

from __future__ import annotations

import numbers

import pytest

from asyncgrpo.config import validate_config
from asyncgrpo.generation.http import HttpGenerator
from asyncgrpo.generation.ray_pool import RayGenerator
from asyncgrpo.metric_names import GENERATOR_COUNTERS
from asyncgrpo.telemetry.metrics import generator_values, metric_keys

VIEWS = {"serving_version", "published_version"}  # versions, not totals


def http_config(weight_sync: str):
    return validate_config({
        "data": {"source": "builtin:repeat_letter"}, "reward": {"functions": ["builtin:repeat_letter"]},
        "train": {"lora": {"r": 4}} if weight_sync == "lora" else {},
        "generation": {"backend": "http", "http": {"base_urls": ["http://127.0.0.1:9"], "weight_sync": weight_sync}},
    })


def totals(stats: dict) -> set[str]:
    return {key for key, value in stats.items() if isinstance(value, numbers.Number) and key not in VIEWS}


@pytest.mark.parametrize("weight_sync", ["full", "delta", "lora", "nccl"])
def test_every_total_of_an_http_generator_and_its_publisher_has_a_metric_name(tmp_path, weight_sync):
    generator = HttpGenerator(http_config(weight_sync).generation, weights_dir=tmp_path, model_config={})
    stats = generator.stats()
    assert totals(stats) - set(GENERATOR_COUNTERS) == set()
    values = generator_values(stats)
    assert values["generation/session_moves_total"] == 0 and values["generation/weight_sync_failures_total"] == 0


def test_every_total_of_a_ray_generator_has_a_metric_name():
    cfg = validate_config({"data": {"source": "builtin:repeat_letter"}, "reward": {"functions": ["builtin:repeat_letter"]},
                           "runtime": "ray"})
    stats = RayGenerator(cfg, model=None, tokenizer=None).stats()  # not started: no Ray
    assert totals(stats) - set(GENERATOR_COUNTERS) == set()


def test_a_backend_without_counters_writes_null_for_each_generation_key_and_every_key_is_in_the_line():
    values = generator_values({})
    assert set(values) == set(GENERATOR_COUNTERS.values()) and set(values.values()) == {None}
    assert set(values) <= set(metric_keys(["r"], max_staleness=1))
    assert GENERATOR_COUNTERS["weight_sync_changed_fraction"] == "generation/weight_sync_changed_fraction"
