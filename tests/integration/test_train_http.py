"""`asyncgrpo train` with the HTTP backend against two real `asyncgrpo serve` processes on loopback."""

from __future__ import annotations

import asyncio
import json

import pytest

from asyncgrpo.commands.train import train
from asyncgrpo.config import load_config
from tests.integration.servers import ServeProcess


@pytest.mark.timeout(300)
def test_a_short_training_run_generates_on_two_servers_and_publishes_every_version(tmp_path):
    servers = [ServeProcess("builtin:tiny", tmp_path).start() for _ in range(2)]
    try:
        for server in servers:
            server.wait_healthy()
        urls = "[" + ", ".join(s.url for s in servers) + "]"
        cfg = load_config(
            "recipes/demo.yaml",
            [f"run.output_dir={tmp_path / 'run'}", "logging.progress=false", "generation.backend=http",
             f"generation.http.base_urls={urls}", "train.max_steps=4", "rollout.groups_per_step=2",
             "rollout.group_size=4", "eval.every_steps=2", "eval.num_prompts=4", "checkpoint.every_steps=0"],
        )
        summary = asyncio.run(train(cfg))
        assert summary.result.outcome == "completed" and summary.result.steps == 4, summary.render()
        metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == [0, 1, 2, 3]
        assert all(m["rollout/failed_total"] == 0 and m["staleness/max"] <= 1 for m in metrics)
        assert all(m["time/weight_sync_s"] > 0 for m in metrics)
        # the HTTP generator's own totals reach every line (the local engine's runs write null there)
        assert all(m["generation/weight_sync_failures_total"] == 0 and m["generation/session_moves_total"] == 0 for m in metrics)
        for server in servers:
            assert server.stats()["serving_version"] == 4  # every step's weights reached both servers
    finally:
        for server in servers:
            server.stop()
