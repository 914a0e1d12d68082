"""generation.http.weight_sync = lora against `asyncgrpo serve`: the adapter of each version loaded under its name and
merged into the base, requests naming it; a server hung while it loads an adapter is bounded and skipped.

The first test serves builtin:tiny in this process (aiohttp on a real socket) to compare the engine's weights with the
trainer's merged weights; the second runs two `asyncgrpo serve` processes and stops one of them (SIGSTOP: it neither
answers nor refuses) while the adapter is on its way. A refused connection is the unit tests' (test_lora_publisher.py;
the installer's handling of a killed server is shared with every publisher: test_weight_delta_sync.py). vLLM:
tests/integration/vllm/test_vllm.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import pytest
import torch

from asyncgrpo.generation.http import HttpGenerator
from asyncgrpo.generation.lora_publisher import LoraWeightPublisher
from asyncgrpo.models.saving import save_model
from asyncgrpo.models.tiny import build_tiny
from asyncgrpo.training.trainer import TorchTrainer
from asyncgrpo.types import GenerationRequest, SamplingParams
from tests.component.test_trainer import make_cfg
from tests.integration.servers import ServeProcess, http
from tests.integration.test_weight_delta_sync import generation_cfg, served_tiny

pytestmark = pytest.mark.timeout(120)
peft = pytest.importorskip("peft", reason="LoRA needs peft: pip install 'asyncgrpo[lora]'")

LORA = {"r": 4, "alpha": 8, "target_modules": "all-linear"}


def lora_cfg(*urls: str, **generation: Any):
    cfg = generation_cfg(*urls, **generation)
    return cfg.model_copy(update={"http": cfg.http.model_copy(update={"weight_sync": "lora"})})


def adapter_step(trainer: TorchTrainer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if ".lora_" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


def test_serve_merges_each_adapter_into_its_base_and_requests_name_the_version(tmp_path):
    trainer = TorchTrainer(build_tiny(0)[0], None, make_cfg({"lora": LORA}))

    async def main():
        async with served_tiny() as (url, state):
            gen = HttpGenerator(lora_cfg(url), weights_dir=tmp_path / "weights", model_config=build_tiny(0)[0].config.to_dict())
            await gen.start()
            try:
                for version in (1, 2, 3):
                    adapter_step(trainer, version)
                    await gen.load_weights(trainer.generation_weights(), version)
                    merged, served = trainer.generation_weights(), state.engine.weights()
                    for name, tensor in merged.items():  # merged into the base each time, never into the previous merge
                        torch.testing.assert_close(served[name], tensor, rtol=0, atol=1e-6)
                    assert state.engine.serving_version == version
                    completion = await gen.generate(GenerationRequest(f"r{version}", 0, (1, 5, 6, 7),
                                                                      SamplingParams(max_new_tokens=4, temperature=1.0), seed=0))
                    assert completion.versions == (version,) * len(completion.token_ids)
                    assert gen._probes.last_payload["model"] == f"policy-v{version}-{gen._weights.publisher.run_id}"
                publisher = gen._weights.publisher
                assert isinstance(publisher, LoraWeightPublisher)
                assert list(state.adapters.loaded) == [publisher.adapter_name(2), publisher.adapter_name(3)]
                status, models = await asyncio.to_thread(http, "GET", f"{url}/v1/models", None, 10.0)
                assert [m["id"] for m in models["data"]] == ["tiny", *state.adapters.loaded]
                return gen.stats(), dict(state.counters)
            finally:
                await gen.aclose()

    stats, counters = asyncio.run(main())
    assert stats["weight_sync_adapters"] == 3 and stats["weight_sync_full_loads"] == 0, stats
    assert stats["weight_sync_lora_fallbacks"] == 0 and stats["weight_sync_failures"] == 0
    assert counters["adapters_loaded"] == 3 and counters["requests_completed"] == 3


def test_a_server_hung_mid_adapter_load_is_bounded_skipped_and_named_while_the_other_is_updated(
        tmp_path, monkeypatch, caplog):
    model_dir = save_model(*build_tiny(0), tmp_path / "tiny")
    servers = [ServeProcess(model_dir, tmp_path, extra=("--served-model-name", "tiny")).start() for _ in range(2)]
    hung, survivor = servers
    trainer = TorchTrainer(build_tiny(0)[0], None, make_cfg({"lora": LORA}))
    real_load = LoraWeightPublisher._load_adapter

    async def faulty_load(self, server, staged, left):
        if server.url == hung.url and staged.version == 2:  # the adapter on its way: now the server hangs
            assert hung.proc is not None
            os.kill(hung.proc.pid, signal.SIGSTOP)
        return await real_load(self, server, staged, left)

    monkeypatch.setattr(LoraWeightPublisher, "_load_adapter", faulty_load)

    async def main():
        gen = HttpGenerator(lora_cfg(*(s.url for s in servers), weight_sync_timeout_s=4.0),
                            weights_dir=tmp_path / "weights", model_config=model_dir)
        await gen.start()
        try:
            adapter_step(trainer, 1)
            await gen.load_weights(trainer.generation_weights(), 1)
            adapter_step(trainer, 2)
            async with asyncio.timeout(30):  # the test's own guard; the bound under test is weight_sync_timeout_s
                await gen.load_weights(trainer.generation_weights(), 2)
            return gen.stats(), gen._weights.publisher
        finally:
            await gen.aclose()

    try:
        for s in servers:
            s.wait_healthy()
        stats, publisher = asyncio.run(main())
        by_url = {s["url"]: s for s in stats["servers"]}
        assert by_url[survivor.url]["version"] == 2 and by_url[survivor.url]["healthy"]
        assert survivor.stats()["adapters_loaded"] == 2 and stats["weight_sync_adapters"] == 3
        assert stats["weight_sync_lora_fallbacks"] == 0  # a server that did not answer is not one without LoRA
        assert publisher.model_for(survivor.url) == publisher.adapter_name(2)
        seen = by_url[hung.url]
        assert seen["version"] == 1 and (not seen["healthy"] or seen["excluded"]), seen
        named = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and hung.url in r.getMessage()]
        assert any("weight install" in m or "weights v2" in m for m in named), named  # the diagnostic names the server
    finally:
        if hung.proc is not None and hung.proc.poll() is None:
            os.kill(hung.proc.pid, signal.SIGCONT)
        for s in servers:
            s.kill()
