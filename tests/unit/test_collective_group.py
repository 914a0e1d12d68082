"""collective_group.py's wire format: both ends cut the same layout, every dtype round-trips as bytes, and a
metadata message that does not describe the data is refused with a message naming what is wrong."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncgrpo.generation.collective_group import ALIGN, chunks, flatten, parse_update_info, unflatten, update_info
from asyncgrpo.generation.collective_publisher import CollectiveWeightPublisher
from asyncgrpo.generation.weight_sync import WeightSyncError


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3, 5, generator=g).to(torch.bfloat16), "b": torch.randn(7, generator=g),
            "c": torch.arange(5, dtype=torch.int64), "empty": torch.zeros(0, 4)}


def test_a_state_round_trips_through_the_flat_buffer_and_the_receivers_layout_is_the_senders():
    original = state()
    flat = flatten(original)
    original["a"].add_(1)  # the flat copy is the staged version: later training does not reach it
    metas, total, chunk_bytes = parse_update_info(update_info(flat, 16, version=3))
    assert metas == flat.metas and total == flat.nbytes and chunk_bytes == 16
    assert all(m.offset % ALIGN == 0 for m in metas)
    back = unflatten(flat)
    for name, tensor in state().items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_chunks_cover_the_buffer_once_in_order():
    assert chunks(10, 4) == [(0, 4), (4, 8), (8, 10)] and chunks(0, 4) == []
    with pytest.raises(ValueError, match="chunk_bytes must be >= 1"):
        chunks(10, 0)


@pytest.mark.parametrize("change,message", [
    (lambda i: i.pop("shapes"), "lacks or has a bad 'shapes'"),
    (lambda i: i.update(total_bytes=1), "says 1 bytes, its layout needs"),
    (lambda i: i.update(dtype_names=["bfloat16"]), "4 names, 1 dtype_names and 4 shapes"),
    (lambda i: i.update(dtype_names=["bfloat16", "float32", "int64", "nope"]), "'empty' has dtype 'nope'"),
])
def test_metadata_that_does_not_describe_the_data_is_refused_by_name(change, message):
    info = update_info(flatten(state()), 16, version=1)
    change(info)
    with pytest.raises(ValueError, match=message):
        parse_update_info(info)


def test_nccl_asked_for_with_weights_off_the_gpu_is_a_misconfiguration_naming_the_key(tmp_path):
    publisher = CollectiveWeightPublisher(tmp_path, backend="nccl")
    with pytest.raises(WeightSyncError, match="generation.http.collective.backend is nccl") as caught:
        asyncio.run(publisher.stage(state(), 1))
    assert caught.value.kind == "misconfigured_backend"
