"""`asyncgrpo serve`'s weights reading (serve_weights.py): regular files only, within a deadline (no server needed)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from asyncgrpo.generation import serve_weights
from asyncgrpo.generation.serve_weights import NotARegularFile, read_weights, read_weights_dir
from asyncgrpo.generation.weight_sync import VERSION_FILE, write_weights
from asyncgrpo.models.saving import save_model
from asyncgrpo.models.tiny import build_tiny

pytestmark = pytest.mark.timeout(60)


def test_a_published_directory_reads_back_with_its_version(tmp_path):
    model_dir = save_model(*build_tiny(0), tmp_path / "model")
    state = build_tiny(1)[0].state_dict()
    path = write_weights(state, tmp_path / "weights", 7, model_config=model_dir)
    weights, version = read_weights_dir(path)
    assert version == 7 and torch.equal(weights["model.norm.weight"], state["model.norm.weight"])
    (path / VERSION_FILE).unlink()
    assert read_weights_dir(path)[1] is None


def test_a_device_behind_a_symlink_is_refused_before_it_is_read(tmp_path):
    (tmp_path / "model.safetensors").symlink_to("/dev/null")
    with pytest.raises(NotARegularFile, match=r"model\.safetensors is not a regular file \(it is a character device\)"):
        read_weights_dir(tmp_path)


def test_a_read_past_the_deadline_is_abandoned_naming_the_option(tmp_path, monkeypatch):
    release = threading.Event()

    def stuck(directory):  # a read on a hung file system
        release.wait(30)
        return {}, None

    monkeypatch.setattr(serve_weights, "read_weights_dir", stuck)
    try:
        with pytest.raises(TimeoutError, match=r"--reload-timeout-s = 0\.2 s.*unchanged"):
            asyncio.run(read_weights(tmp_path, 0.2))
    finally:
        release.set()
