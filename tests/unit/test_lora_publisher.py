"""`LoraWeightPublisher` against a scripted control client: what it writes, what it asks a server to do, its fallback
to merged weights, and its bounds (real servers: tests/integration/test_lora_sync.py and test_vllm.py)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from asyncgrpo.config import validate_config
from asyncgrpo.errors import ConfigError
from asyncgrpo.generation.lora_adapter import PolicyWeights, with_adapter
from asyncgrpo.generation.lora_publisher import LoraWeightPublisher, StagedAdapter
from asyncgrpo.generation.weight_sync import VERSION_FILE, WeightSyncStepError
from asyncgrpo.training.trainer import TorchTrainer
from tests.component.test_trainer import make_cfg
from tests.tiny_models import tiny_llama

pytestmark = pytest.mark.timeout(60)
peft = pytest.importorskip("peft", reason="LoRA needs peft: pip install 'asyncgrpo[lora]'")

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


class ScriptedServer:
    """A `ControlClient` that records calls; `answers[path]` is an exception to raise there (or a callable)."""

    def __init__(self, url: str = "http://s1", answers: Mapping[str, Any] | None = None) -> None:
        self.url = url
        self.answers = dict(answers or {})
        self.calls: list[tuple[str, Any, float]] = []

    async def post(self, path: str, *, json_body: Any = None, params: Any = None, timeout_s: float) -> Any:
        self.calls.append((path, json_body, timeout_s))
        answer = self.answers.get(path)
        if callable(answer):
            return await answer(json_body, timeout_s)
        if answer is not None:
            raise answer
        return '{"results": [{"applied": true}]}' if path == "/collective_rpc" else "ok"

    def paths(self) -> list[str]:
        return [path for path, _, _ in self.calls]


def lora_trainer() -> TorchTrainer:
    trainer = TorchTrainer(tiny_llama(0), None, make_cfg({"lora": LORA}))
    with torch.no_grad():  # peft starts B at zero (adapter = no change): make the adapter matter
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return trainer


def test_the_trainer_s_weights_carry_an_adapter_that_peft_loads_into_the_merged_model(tmp_path):
    trainer = lora_trainer()
    state = trainer.generation_weights()
    assert isinstance(state, PolicyWeights) and state.adapter is not None
    publisher = LoraWeightPublisher(tmp_path / "weights")
    staged = asyncio.run(publisher.stage(state, 3))
    assert isinstance(staged, StagedAdapter) and staged.name == f"policy-v3-{publisher.run_id}"
    assert json.loads((staged.path / VERSION_FILE).read_text())["version"] == 3
    assert publisher.counters["weight_sync_bytes_staged"] == state.adapter.nbytes < sum(t.numel() * 4 for t in state.values()) / 10

    loaded = peft.PeftModel.from_pretrained(tiny_llama(0), str(staged.adapter)).merge_and_unload()
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=1e-6)
    # A copy: the next step does not change what was staged.
    before = {k: v.clone() for k, v in state.adapter.tensors.items()}
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_" in name:
                p.add_(1.0)
    assert all(torch.equal(before[k], v) for k, v in state.adapter.tensors.items())


def test_an_adapter_per_version_is_loaded_under_its_name_and_older_ones_unloaded_beyond_keep_loaded(tmp_path):
    trainer = lora_trainer()
    publisher = LoraWeightPublisher(tmp_path / "weights", keep_loaded=2)
    server = ScriptedServer(answers={"/v1/unload_lora_adapter": None})

    async def main():
        for version in (1, 2, 3, 3, 4):  # the same version again (a retried install) loads in place
            staged = await publisher.stage(trainer.generation_weights(), version)
            await publisher.install(server, staged, 5.0)
            assert publisher.model_for(server.url) == publisher.adapter_name(version)

    asyncio.run(main())
    loads = [body for path, body, _ in server.calls if path == "/v1/load_lora_adapter"]
    assert [b["lora_name"] for b in loads] == [publisher.adapter_name(v) for v in (1, 2, 3, 3, 4)]
    assert all(b["load_inplace"] is True and b["lora_path"].endswith("/adapter") for b in loads)
    unloads = [body["lora_name"] for path, body, _ in server.calls if path == "/v1/unload_lora_adapter"]
    assert unloads == [publisher.adapter_name(1), publisher.adapter_name(2)]
    assert "/pause" not in server.paths()  # in-flight requests keep their own adapter
    assert all(0 < timeout <= 5.0 for _, _, timeout in server.calls)
    assert publisher.counters["weight_sync_adapters"] == 5 and publisher.counters["weight_sync_full_loads"] == 0
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v000002", "v000003", "v000004"]  # keep_loaded + 1


def test_a_server_that_cannot_load_adapters_gets_the_merged_weights_from_then_on_logged_once(tmp_path, caplog):
    trainer = lora_trainer()
    publisher = LoraWeightPublisher(tmp_path / "weights")
    plain = ScriptedServer("http://plain", {"/v1/load_lora_adapter": WeightSyncStepError("HTTP 404: Not Found", status=404)})
    lora = ScriptedServer("http://lora")

    async def main():
        for version in (1, 2):
            staged = await publisher.stage(trainer.generation_weights(), version)
            await asyncio.gather(publisher.install(plain, staged, 5.0), publisher.install(lora, staged, 5.0))
        return staged

    with caplog.at_level(logging.WARNING, logger="asyncgrpo"):
        staged = asyncio.run(main())
    assert plain.paths() == ["/v1/load_lora_adapter", "/pause", "/collective_rpc", "/resume", "/pause", "/collective_rpc",
                             "/resume"]
    assert publisher.model_for(plain.url) is None and publisher.model_for(lora.url) == staged.name
    reloaded = plain.calls[-2][1]["kwargs"]["weights_path"]
    from safetensors.torch import load_file

    written = load_file(f"{reloaded}/model.safetensors")
    merged = trainer.generation_weights()
    assert all(torch.equal(written[k], merged[k]) for k in merged)
    assert [r for r in caplog.records if "cannot load LoRA adapters" in r.getMessage()].__len__() == 1
    assert "http://plain" in caplog.text and "--enable-lora" in caplog.text
    assert publisher.counters["weight_sync_lora_fallbacks"] == 1 and publisher.counters["weight_sync_full_loads"] == 2
    assert publisher.counters["weight_sync_adapters"] == 2


def test_a_server_that_does_not_answer_is_bounded_and_not_taken_for_one_without_lora(tmp_path):
    trainer = lora_trainer()
    publisher = LoraWeightPublisher(tmp_path / "weights")

    async def hang(body, timeout_s):
        async with asyncio.timeout(timeout_s):
            await asyncio.Event().wait()

    hung = ScriptedServer("http://hung", {"/v1/load_lora_adapter": hang})

    async def main():
        staged = await publisher.stage(trainer.generation_weights(), 1)
        await publisher.install(hung, staged, 0.2)

    with pytest.raises(TimeoutError):
        asyncio.run(main())
    assert publisher.counters["weight_sync_lora_fallbacks"] == 0 and publisher.model_for(hung.url) is None
    refused = ScriptedServer("http://down", {"/v1/load_lora_adapter": WeightSyncStepError("refused", unreachable=True)})
    with pytest.raises(WeightSyncStepError, match="refused"):
        asyncio.run(publisher.install(refused, asyncio.run(publisher.stage(trainer.generation_weights(), 2)), 1.0))
    assert publisher.counters["weight_sync_lora_fallbacks"] == 0 and "/pause" not in refused.paths()


def test_an_unload_the_server_cannot_do_fails_the_install_but_one_it_no_longer_holds_is_done(tmp_path):
    trainer = lora_trainer()
    publisher = LoraWeightPublisher(tmp_path / "weights", keep_loaded=1)
    server = ScriptedServer(answers={"/v1/unload_lora_adapter": WeightSyncStepError("HTTP 404: not found", status=404)})

    async def publish(version):
        await publisher.install(server, await publisher.stage(trainer.generation_weights(), version), 5.0)

    asyncio.run(publish(1))
    asyncio.run(publish(2))  # v1 is gone from the server (it restarted): done
    server.answers["/v1/unload_lora_adapter"] = WeightSyncStepError("HTTP 500: boom", status=500)
    with pytest.raises(WeightSyncStepError, match="could not unload policy-v2"):
        asyncio.run(publish(3))


def test_weights_without_an_adapter_are_published_whole(tmp_path, caplog):
    publisher = LoraWeightPublisher(tmp_path / "weights")
    server = ScriptedServer()
    state = {k: v.clone() for k, v in tiny_llama(0).state_dict().items()}
    with caplog.at_level(logging.WARNING, logger="asyncgrpo"):
        asyncio.run(publisher.install(server, asyncio.run(publisher.stage(state, 1)), 5.0))
    assert server.paths() == ["/pause", "/collective_rpc", "/resume"] and "carry no adapter" in caplog.text
    assert publisher.model_for(server.url) is None


def test_with_adapter_is_a_plain_mapping_of_the_merged_weights():
    model = peft.get_peft_model(tiny_llama(0), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    state = with_adapter({"a": torch.zeros(1)}, model)
    assert dict(state) == {"a": torch.zeros(1)} and state.adapter is not None
    assert set(state.adapter.config["target_modules"]) == {"q_proj"} and state.adapter.config["r"] == 2


def test_weight_sync_lora_without_train_lora_is_a_config_error():
    cfg = {"generation": {"backend": "http", "http": {"base_urls": ["http://x"], "weight_sync": "lora"}}}
    with pytest.raises(ConfigError) as error:
        validate_config(cfg)
    message = str(error.value)
    assert "generation.http.weight_sync = lora" in message and "train.lora" in message and "Fix:" in message
    validate_config({**cfg, "train": {"lora": LORA}})


def test_serve_s_merge_is_peft_s_and_refuses_what_it_does_not_implement(tmp_path):
    from asyncgrpo.generation.lora_serve import AdapterError, merge_adapter

    base = tiny_llama(0)
    model = peft.get_peft_model(tiny_llama(0), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    model.save_pretrained(str(tmp_path / "ok"))
    merged = merge_adapter(base.state_dict(), tmp_path / "ok")
    expected = model.merge_and_unload().state_dict()
    assert len(merged) == 4 and all(k.endswith(("q_proj.weight", "down_proj.weight")) for k in merged)
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6)

    config = json.loads((tmp_path / "ok" / "adapter_config.json").read_text())
    (tmp_path / "dora").mkdir()
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(AdapterError, match="use_dora"):
        merge_adapter(base.state_dict(), tmp_path / "dora")
    other = {k: (v[:, :16] if k.endswith("q_proj.weight") else v) for k, v in base.state_dict().items()}
    with pytest.raises(AdapterError, match="does not fit"):
        merge_adapter(other, tmp_path / "ok")
