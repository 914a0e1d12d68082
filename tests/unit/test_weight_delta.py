"""weight_delta.py: deltas reproduce the new weights bit for bit, pick the smaller encoding, and refuse what does not fit."""

from __future__ import annotations

import pytest
import torch

from asyncgrpo.generation.weight_delta import (
    DeltaError,
    apply_delta,
    checksum,
    dtype_names,
    encode_delta,
    load_delta,
    merge_delta,
    save_delta,
    state_nbytes,
)


def states(dtype: torch.dtype, changed: float, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    base = {"a": torch.randn(64, 32, generator=g).to(dtype), "b": torch.randn(200, generator=g).to(dtype),
            "c": torch.zeros(7, dtype=dtype)}
    new = {k: v.clone() for k, v in base.items()}
    for t in (new["a"], new["b"]):
        flat = t.view(-1)
        picked = torch.rand(flat.numel(), generator=g) < changed
        flat[picked] += 1.0
    return base, new


def bits_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    ints = {2: torch.int16, 4: torch.int32}
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(ints[x.element_size()]),
                                                                     y.view(ints[y.element_size()]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("changed, kind", [(0.01, "index"), (0.4, "mask")])
def test_a_delta_applied_to_its_base_gives_the_new_weights_bit_for_bit(dtype, changed, kind):
    base, new = states(dtype, changed)
    delta = encode_delta(base, new)
    assert delta is not None and delta.nbytes < state_nbytes(new)
    assert {key.partition("/")[0] for key in delta.entries} == {kind, "values"}
    assert "c" not in {key.partition("/")[2] for key in delta.entries}  # unchanged tensors are not sent
    out = apply_delta(base, delta.entries)
    assert set(out) == {"a", "b"}
    merged = {**base, **out}
    assert all(bits_equal(merged[k], new[k]) for k in new)
    assert checksum(merged) == checksum(new) != checksum(base)


def test_signed_zero_and_nan_payloads_count_as_changes_bitwise():
    base = {"w": torch.tensor([0.0, 1.0, float("nan"), 2.0])}
    new = {"w": torch.tensor([-0.0, 1.0, float("nan"), 2.0])}
    delta = encode_delta(base, new)
    assert delta is not None and delta.changed == 1
    assert torch.equal(apply_delta(base, delta.entries)["w"][:1].view(torch.int32), new["w"][:1].view(torch.int32))
    assert encode_delta(new, {"w": new["w"].clone()}) is not None and encode_delta(new, {"w": new["w"].clone()}).changed == 0


def test_a_delta_no_smaller_than_a_full_copy_or_over_other_names_is_none():
    base, new = states(torch.float32, 1.0)  # every element of a and b changed: each would go whole
    new["c"] += 1
    assert encode_delta(base, new) is None
    assert encode_delta({**base, "extra": torch.zeros(1)}, new) is None


def test_a_tensor_of_a_new_shape_goes_whole():
    base, new = states(torch.bfloat16, 0.01)
    new["c"] = torch.ones(9, dtype=torch.bfloat16)
    delta = encode_delta(base, new)
    assert delta is not None and torch.equal(delta.entries["full/c"], new["c"])


def test_checksum_sees_one_element_and_casts_to_the_published_dtype():
    _, new = states(torch.bfloat16, 0.0)
    wide = {k: v.float() for k, v in new.items()}
    assert checksum(wide, dtype_names(new)) == checksum(new) != checksum(wide)
    wide["b"][3] += 1.0
    assert checksum(wide, dtype_names(new)) != checksum(new)


def test_saved_deltas_load_with_their_manifest_and_other_files_are_refused(tmp_path):
    base, new = states(torch.bfloat16, 0.05)
    delta = encode_delta(base, new)
    assert delta is not None
    manifest = {"base": "run-v1", "weights_id": "run-v2", "version": 2, "checksum": checksum(new), "dtypes": dtype_names(new)}
    save_delta(tmp_path / "d", delta, manifest)
    entries, loaded = load_delta((tmp_path / "d").read_bytes())
    assert loaded == manifest and entries.keys() == delta.entries.keys()
    with pytest.raises(DeltaError, match="not an asyncgrpo weight delta"):
        load_delta(b"\x00" * 32)


def test_merge_applies_only_on_its_base_and_only_when_the_checksum_matches():
    base, new = states(torch.bfloat16, 0.05)
    delta = encode_delta(base, new)
    assert delta is not None
    manifest = {"base": "run-v1", "weights_id": "run-v2", "checksum": checksum(new), "dtypes": dtype_names(new)}
    served = {k: v.float() for k, v in base.items()}  # a server that keeps the weights in float32
    merged = merge_delta(served, "run-v1", delta.entries, manifest)
    assert checksum(merged, manifest["dtypes"]) == checksum(new)
    assert merged["c"] is served["c"]  # unchanged tensors are the served ones, not copies
    with pytest.raises(DeltaError, match="against weights run-v1, this server holds weights of no asyncgrpo version"):
        merge_delta(served, None, delta.entries, manifest)
    with pytest.raises(DeltaError, match="checksum"):
        merge_delta({**served, "b": served["b"] + 1}, "run-v1", delta.entries, manifest)  # a base that drifted
    with pytest.raises(DeltaError, match="does not have|do not fit|not have"):
        apply_delta({"a": base["a"]}, delta.entries)
