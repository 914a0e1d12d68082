"""`model.path` as a Hugging Face Hub id, against a hub cache the test builds on disk (no network): the
layout models--org--name/snapshots/<rev>/ + refs/main holding a tiny model saved by transformers, with
HF_HUB_CACHE pointing at it and HF_HUB_OFFLINE=1. The id loads the same weights, `check` and `train` accept it,
and a missing id or a snapshot without weights is one paragraph naming the id, the cache and HF_HUB_OFFLINE."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncgrpo.commands.cli import main
from asyncgrpo.errors import ConfigError
from asyncgrpo.models.loading import check_model_path, load_model_and_tokenizer, model_directory
from asyncgrpo.models.saving import save_model
from asyncgrpo.models.tiny import build_tiny

REPO = "tinyorg/tiny-llm"
REVISION = "0123456789abcdef0123456789abcdef01234567"
ROOT = Path(__file__).resolve().parents[2]


def build_hub_cache(cache: Path, repo_id: str = REPO, *, weights: bool = True) -> Path:
    """A hub cache holding `repo_id` as huggingface_hub lays it out; returns the snapshot directory."""
    org, name = repo_id.split("/")
    storage = cache / f"models--{org}--{name}"
    snapshot = storage / "snapshots" / REVISION
    model, tokenizer = build_tiny(seed=3)
    save_model(model, tokenizer, snapshot)
    if not weights:
        (snapshot / "model.safetensors").unlink()
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """HF_HUB_CACHE at an empty cache under tmp_path, HF_HUB_OFFLINE=1 (huggingface_hub reads both at import: patched too)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_hub_id_loads_the_cached_snapshot(offline_cache):
    snapshot = build_hub_cache(offline_cache)
    model, tokenizer = load_model_and_tokenizer(REPO)
    expected, _ = build_tiny(seed=3)
    assert model_directory(REPO, weights=True) == snapshot
    for (name, got), want in zip(model.state_dict().items(), expected.state_dict().values()):
        assert torch.equal(got, want), name
    assert tokenizer("say a")["input_ids"] == build_tiny(seed=3)[1]("say a")["input_ids"]


def test_check_and_train_accept_a_hub_id(offline_cache, tmp_path, capsys):
    snapshot = build_hub_cache(offline_cache)
    args = ["recipes/demo.yaml", f"model.path={REPO}", f"run.output_dir={tmp_path / 'run'}", "train.max_steps=1",
            "rollout.groups_per_step=2", "rollout.group_size=2", "eval.every_steps=0", "logging.progress=false"]
    assert main(["check", *args]) == 0
    out = capsys.readouterr().out
    assert f"model.path '{REPO}' is a Hugging Face Hub id: snapshot {snapshot}" in out
    assert main(["train", *args]) == 0
    assert (tmp_path / "run" / "checkpoints" / "step_000001" / "model.safetensors").is_file()


def test_check_finds_a_hub_id_through_the_environment_alone(tmp_path):
    """The user's way: only HF_HUB_CACHE and HF_HUB_OFFLINE set, in a fresh process."""
    cache = tmp_path / "hub"
    snapshot = build_hub_cache(cache)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-m", "asyncgrpo.commands.cli", "check", "recipes/demo.yaml", f"model.path={REPO}",
                           f"run.output_dir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"snapshot {snapshot}" in done.stdout


def test_an_id_missing_offline_names_the_id_the_cache_and_hf_hub_offline(offline_cache):
    with pytest.raises(ConfigError) as err:
        check_model_path("nosuchorg/nosuch-model")
    message = str(err.value)
    assert "model.path = 'nosuchorg/nosuch-model' is no local directory (looked for " in message  # the path reading
    assert "read as a Hugging Face Hub id: it is not in the hub cache (" + str(offline_cache) + ")" in message
    assert "HF_HUB_OFFLINE=1 forbids the network" in message and "Fix:" in message


def test_a_snapshot_without_weights_is_refused_before_loading(offline_cache):
    build_hub_cache(offline_cache, weights=False)
    check_model_path(REPO)  # config and tokenizer are there: check passes
    with pytest.raises(ConfigError, match=r"the hub snapshot at .* holds no weights .*Fix: download the complete model"):
        load_model_and_tokenizer(REPO)


def test_a_local_directory_shaped_like_an_id_is_the_directory(offline_cache, tmp_path, monkeypatch):
    build_hub_cache(offline_cache)
    monkeypatch.chdir(tmp_path)
    model, tokenizer = build_tiny(seed=5)
    save_model(model, tokenizer, tmp_path / REPO)
    assert model_directory(REPO, weights=True) == Path(REPO)
