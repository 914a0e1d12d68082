"""Checkpoints: round trip, pruning, temp dirs ignored, standard save_pretrained layout."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerFast

from asyncgrpo.config import Config
from asyncgrpo.training.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from asyncgrpo.training.trainer import TorchTrainer
from asyncgrpo.types import Completion, Group, Prompt, Rollout
from tests.tiny_models import tiny_llama

pytestmark = pytest.mark.timeout(60)


def tiny_model(seed: int = 0, tie: bool = False) -> LlamaForCausalLM:
    return tiny_llama(seed, tie)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {chr(ord("a") + i): 3 + i for i in range(26)} | {"0": 29, "1": 30, "<unk>": 31}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def make_cfg(keep_last: int = 2, state_dtype: str = "float32") -> Config:
    return Config.model_validate(
        {"train": {"lr": 1e-2, "warmup_steps": 3, "optimizer_state_dtype": state_dtype}, "checkpoint": {"keep_last": keep_last}}
    )


def a_group() -> Group:
    rollouts = []
    for k, (tokens, adv) in enumerate([((5, 6, 7), 1.0), ((8, 9), -1.0), ((10,), 0.5), ((11, 12, 13, 2), -0.5)]):
        comp = Completion(tokens, (-3.0,) * len(tokens), (0,) * len(tokens), "stop", 0)
        rollouts.append(Rollout(comp, reward=float(k), advantage=adv))
    return Group(Prompt(id=0, text="a b", token_ids=(1, 3, 4)), tuple(rollouts), seq=0)


def trained_trainer(steps: int = 2, tie: bool = False, state_dtype: str = "float32") -> TorchTrainer:
    trainer = TorchTrainer(tiny_model(tie=tie), tiny_tokenizer(), make_cfg(state_dtype=state_dtype))
    for _ in range(steps):
        trainer.train_step([a_group()])
    return trainer


@pytest.mark.parametrize("tie, state_dtype", [(False, "float32"), (True, "float32"), (False, "bfloat16")])
def test_round_trip_restores_weights_optimizer_scheduler_and_version(tmp_path, tie, state_dtype):
    trainer = trained_trainer(tie=tie, state_dtype=state_dtype)
    path = save_checkpoint(tmp_path, 2, trainer, "run: {name: t}\n", {"cursor": 7})
    assert path == tmp_path / "checkpoints" / "step_000002"
    assert json.loads((path / "state.json").read_text()) == {"step": 2, "version": 2, "extra": {"cursor": 7}}
    assert (path / "run_config.yaml").read_text() == "run: {name: t}\n"

    fresh = TorchTrainer(tiny_model(seed=1, tie=tie), tiny_tokenizer(), make_cfg(state_dtype=state_dtype))
    state = load_checkpoint(path, fresh)
    assert state["extra"] == {"cursor": 7}
    assert fresh.version == 2
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(tensor, fresh.model.state_dict()[name]), name
    assert fresh.lr == pytest.approx(trainer.lr)
    assert_same_optimizer_state(trainer, fresh, state_dtype)
    # Both continue identically (same weights, moments, LR schedule, and bfloat16 moments' rounding noise).
    m1, m2 = trainer.train_step([a_group()]), fresh.train_step([a_group()])
    assert m1 == pytest.approx(m2, nan_ok=True)  # offpolicy rows of absent staleness values are NaN
    for name, tensor in trainer.model.state_dict().items():
        torch.testing.assert_close(tensor, fresh.model.state_dict()[name])
    assert_same_optimizer_state(trainer, fresh, state_dtype)


def assert_same_optimizer_state(trainer: TorchTrainer, other: TorchTrainer, dtype: str) -> None:
    mine, theirs = trainer.optimizer.state_dict(), other.optimizer.state_dict()
    for key, st in mine["state"].items():
        assert st["exp_avg"].dtype == getattr(torch, dtype)
        for field in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(st[field], theirs["state"][key][field])


def test_saved_dir_loads_with_transformers(tmp_path):
    trainer = trained_trainer(steps=1)
    path = save_checkpoint(tmp_path, 1, trainer, "", {})
    model = AutoModelForCausalLM.from_pretrained(path)
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer("a b c")["input_ids"] == [3, 4, 5]


def test_keep_last_prunes_oldest(tmp_path):
    trainer = trained_trainer(steps=0)
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, trainer, "", {"step": step})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000003", "step_000004"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000003", "step_000004"]
    # Re-saving an existing step replaces it.
    save_checkpoint(tmp_path, 4, trainer, "", {"again": True})
    assert json.loads((tmp_path / "checkpoints" / "step_000004" / "state.json").read_text())["extra"] == {"again": True}


def test_latest_ignores_temp_and_incomplete_dirs(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    trainer = trained_trainer(steps=0)
    save_checkpoint(tmp_path, 1, trainer, "", {})
    ckpts = tmp_path / "checkpoints"
    # A save killed mid-way leaves a temp dir (even one holding state.json) ...
    leftover = ckpts / ".tmp-step_000009-123-abcd1234"
    leftover.mkdir()
    (leftover / "state.json").write_text(json.dumps({"step": 9, "version": 9, "extra": {}}))
    # ... and a step dir without state.json is not complete either.
    (ckpts / "step_000005").mkdir()
    assert latest_checkpoint(tmp_path) == ckpts / "step_000001"
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        load_checkpoint(ckpts / "step_000005", trainer)
    # The next save cleans the temp leftovers.
    save_checkpoint(tmp_path, 2, trainer, "", {})
    assert not leftover.exists()
    assert latest_checkpoint(tmp_path) == ckpts / "step_000002"


def test_failed_save_leaves_no_checkpoint(tmp_path, monkeypatch):
    trainer = trained_trainer(steps=0)

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 1, trainer, "", {})
    assert latest_checkpoint(tmp_path) is None
    assert list((tmp_path / "checkpoints").iterdir()) == []
