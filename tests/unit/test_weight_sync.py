"""`write_weights`: the directory layout servers reload from (no server needed)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from asyncgrpo.generation.weight_sync import VERSION_FILE, write_weights
from asyncgrpo.models.saving import save_model
from asyncgrpo.models.tiny import build_tiny

pytestmark = pytest.mark.timeout(60)


def test_a_version_is_a_loadable_model_directory_with_the_tied_head_written_out(tmp_path):
    model_dir = save_model(*build_tiny(0), tmp_path / "model")
    model = build_tiny(1)[0]
    state = model.state_dict()  # the tied head and the embedding are one tensor here
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    path = write_weights(state, tmp_path / "weights", 7, model_config=model_dir)
    assert path == tmp_path / "weights" / "v000007"
    assert sorted(p.name for p in path.iterdir()) == ["asyncgrpo_version.json", "config.json", "generation_config.json", "model.safetensors"]
    assert json.loads((path / VERSION_FILE).read_text()) == {"version": 7}
    tensors = load_file(str(path / "model.safetensors"))
    # vLLM's in-place reload leaves a tied head stale unless the file names it.
    assert torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    assert set(tensors) == set(state)
    reloaded = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    for name, tensor in state.items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_a_state_without_the_tied_head_gets_it_from_the_embedding(tmp_path):
    state = {k: v.clone() for k, v in build_tiny(0)[0].state_dict().items() if k != "lm_head.weight"}
    path = write_weights(state, tmp_path / "weights", 0, model_config={"tie_word_embeddings": True})
    tensors = load_file(str(path / "model.safetensors"))
    assert torch.equal(tensors["lm_head.weight"], state["model.embed_tokens.weight"])


def test_only_the_written_version_and_the_one_before_it_are_kept(tmp_path):
    root = tmp_path / "weights"
    state = {"w": torch.arange(4.0)}
    for version in (3, 4, 5, 6):  # an earlier run got to version 6
        write_weights(state, root, version)
    (root / ".tmp-v000009-1-deadbeef").mkdir()  # a write interrupted in an earlier process
    assert sorted(p.name for p in root.iterdir()) == [".tmp-v000009-1-deadbeef", "v000005", "v000006"]
    write_weights(state, root, 2)  # a run resumed at an older step: its version must survive
    assert sorted(p.name for p in root.iterdir()) == ["v000002"]
    write_weights({"w": torch.zeros(4)}, root, 3)
    write_weights({"w": torch.ones(4)}, root, 3)  # the same version again replaces it
    assert sorted(p.name for p in root.iterdir()) == ["v000002", "v000003"]
    assert torch.equal(load_file(str(root / "v000003" / "model.safetensors"))["w"], torch.ones(4))


def test_pruning_a_shared_weights_dir_never_touches_what_asyncgrpo_did_not_write(tmp_path):
    root = tmp_path / "weights"
    (root / "v000001").mkdir(parents=True)  # a user's folder that happens to look like a version
    (root / "v000001" / "notes.txt").write_text("mine")
    (root / ".tmp-scratch").mkdir()  # and one that starts like a temporary
    for version in (2, 3, 4):
        write_weights({"w": torch.arange(4.0)}, root, version)
    assert sorted(p.name for p in root.iterdir()) == [".tmp-scratch", "v000001", "v000003", "v000004"]
    assert (root / "v000001" / "notes.txt").read_text() == "mine"
