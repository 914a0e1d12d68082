"""training/heap.py: the freed tensors' pages go back to the system after a CPU step."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from asyncgrpo.training import heap
from asyncgrpo.training.trainer import TorchTrainer
from tests.component.test_trainer import make_cfg, make_groups
from tests.tiny_models import tiny_llama


def resident_mb() -> float:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's (Linux)")
def test_freed_heap_blocks_are_returned_to_the_system():
    blocks = [torch.ones(16_384) for _ in range(3_000)]  # 64 KiB each: from glibc's heap, not mmap; 192 MB in all
    guard = torch.ones(16_384)  # above them, so freeing them leaves a hole glibc does not trim by itself
    del blocks
    kept = resident_mb()
    assert heap.release_freed_memory()
    assert resident_mb() < kept - 100
    del guard


def test_a_cpu_training_step_releases_the_freed_memory(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(heap, "release_freed_memory", lambda: calls.append(1) or True)
    model = tiny_llama(0)
    trainer = TorchTrainer(model, None, make_cfg({"device": "cpu"}))
    groups = make_groups(model, 1)
    trainer.train_step(groups)
    trainer.train_step(groups)
    assert calls == [1, 1]
