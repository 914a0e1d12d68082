"""weight_delta.py: deltas reproduce the new weights bit for bit, pick the smaller encoding, refuse what does not fit,
and leave the served tensors as they were when the check fails."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncgrpo.generation.weight_delta import (
    FORMAT,
    DeltaError,
    checksum,
    decode_gaps,
    dtype_names,
    encode_delta,
    encode_gaps,
    load_delta,
    prepare_delta,
    save_delta,
    state_nbytes,
)


def states(dtype: torch.dtype, changed: float, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    base = {"a": torch.randn(256, 64, generator=g).to(dtype), "b": torch.randn(2000, generator=g).to(dtype),
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


def manifest_of(new: dict[str, torch.Tensor], base_id: str = "run-v1") -> dict:
    return {"format": FORMAT, "base": base_id, "weights_id": "run-v2", "version": 2, "checksum": checksum(new),
            "dtypes": dtype_names(new)}


def applied(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`base` (copied) with the delta from it to `new` written in place, as a server does."""
    delta = encode_delta(base, new)
    assert delta is not None
    served = {k: v.clone() for k, v in base.items()}
    prepare_delta(served, "run-v1", delta.entries, manifest_of(new)).apply(served)
    return served


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("changed, kind", [(0.0005, "index"), (0.05, "gaps"), (0.4, "gaps")])
def test_a_delta_applied_to_its_base_gives_the_new_weights_bit_for_bit(dtype, changed, kind):
    base, new = states(dtype, changed)
    delta = encode_delta(base, new)
    assert delta is not None and delta.nbytes < state_nbytes(new)
    assert {key.partition("/")[0] for key in delta.entries} == {kind, "values"}
    assert "c" not in {key.partition("/")[2] for key in delta.entries}  # unchanged tensors are not sent
    served = applied(base, new)
    assert all(bits_equal(served[k], new[k]) for k in new)
    assert checksum(served) == checksum(new) != checksum(base)
    delta.apply_to(base)  # the publisher's own copy, patched
    assert all(bits_equal(base[k], new[k]) for k in new)


def test_gap_codes_round_trip_across_skips_of_every_length():
    g = torch.Generator().manual_seed(0)
    gaps = torch.randint(1, 2000, (5000,), generator=g).numpy()
    gaps[:6] = [1, 255, 256, 510, 511, 766]  # one code, one code, a skip then 1, one skip then 255, ...
    positions = gaps.cumsum() - 1
    codes = encode_gaps(positions)
    assert codes.dtype.name == "uint8" and (codes == 0).sum() == ((gaps - 1) // 255).sum()
    assert (decode_gaps(codes) == positions).all()
    assert (decode_gaps(encode_gaps(positions[:0])) == positions[:0]).all()


def test_signed_zero_and_nan_payloads_count_as_changes_bitwise():
    base = {"w": torch.tensor([0.0, 1.0, float("nan"), 2.0])}
    new = {"w": torch.tensor([-0.0, 1.0, float("nan"), 2.0])}
    delta = encode_delta(base, new)
    assert delta is not None and delta.changed == 1
    assert torch.equal(applied(base, new)["w"].view(torch.int32), new["w"].view(torch.int32))
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
    manifest = manifest_of(new)
    save_delta(tmp_path / "d", delta, manifest)
    entries, loaded = load_delta((tmp_path / "d").read_bytes())
    assert loaded == manifest and entries.keys() == delta.entries.keys()
    with pytest.raises(DeltaError, match="not an asyncgrpo weight delta"):
        load_delta(b"\x00" * 32)


def test_a_delta_applies_only_on_its_base_in_its_format_and_when_the_checksum_matches():
    base, new = states(torch.bfloat16, 0.05)
    delta = encode_delta(base, new)
    assert delta is not None
    manifest = manifest_of(new)
    served = {k: v.float() for k, v in base.items()}  # a server that keeps the weights in float32
    c = served["c"]
    prepare_delta(served, "run-v1", delta.entries, manifest).apply(served)
    assert checksum(served, manifest["dtypes"]) == checksum(new) and served["c"] is c  # written in place
    with pytest.raises(DeltaError, match="against weights run-v1, this server holds weights of no asyncgrpo version"):
        prepare_delta(served, None, delta.entries, manifest)
    with pytest.raises(DeltaError, match="of format 1, this reader takes format 2"):
        prepare_delta(served, "run-v1", delta.entries, {**manifest, "format": 1})  # an older publisher's delta
    with pytest.raises(DeltaError, match="does not have|do not fit|not have"):
        prepare_delta({"a": base["a"]}, "run-v1", delta.entries, manifest)
    codes = delta.entries["gaps/a"].clone()
    codes[-1] = 255  # the last position pushed past the tensor's end
    with pytest.raises(DeltaError, match="positions for 'a' do not fit its 16384 elements"):
        prepare_delta(served, "run-v1", {**delta.entries, "gaps/a": torch.cat([codes, torch.full((100,), 255, dtype=torch.uint8)])},
                      manifest)


def test_a_failed_check_leaves_every_served_tensor_bit_for_bit_as_it_was_tied_ones_included():
    base, new = states(torch.bfloat16, 0.05)
    base["tied"], new["tied"] = base["a"], new["a"].clone()  # one tensor under two names, as a tied LM head is served
    delta = encode_delta(base, new)
    assert delta is not None and {"gaps/a", "gaps/tied"} <= delta.entries.keys()
    served = {k: v.clone() for k, v in base.items() if k != "tied"}
    served["tied"] = served["a"]
    served["c"] += 1.0  # drifted behind the publisher's back: the check fails after every change was written
    before = {k: v.clone() for k, v in served.items()}
    patches = prepare_delta(served, "run-v1", delta.entries, manifest_of(new))
    with pytest.raises(DeltaError, match="checksum .* the 3 tensors it changed were restored"):
        patches.apply(served)
    assert all(bits_equal(served[k], before[k]) for k in served) and served["tied"] is served["a"]

    short = {**served, "b": served["b"][:10].clone()}  # a write that raises midway (IndexError) is undone the same way
    with pytest.raises(IndexError):
        patches.apply(short)
    assert all(bits_equal(short[k], before[k]) for k in served if k != "b")


def test_a_tied_tensor_is_encoded_once_and_reaches_servers_that_hold_it_tied_or_as_a_copy():
    base, new = states(torch.bfloat16, 0.05)
    base["tied"], new["tied"] = base["a"], new["a"]  # one tensor under two names on both sides, as a tied LM head
    delta = encode_delta(base, new)
    assert delta is not None and delta.aliases == {"tied": "a"} and not any(k.endswith("/tied") for k in delta.entries)
    manifest = {**manifest_of(new), "aliases": delta.aliases}
    tied = {k: v.clone() for k, v in base.items() if k != "tied"}
    tied["tied"] = tied["a"]  # asyncgrpo serve: the engine's tied parameters
    copied = {k: v.clone() for k, v in base.items()}  # the vLLM extension: the file's layout, one tensor per name
    for served in (tied, copied):
        patches = prepare_delta(served, "run-v1", delta.entries, manifest)
        assert patches.names.count("a") == 1 and patches.names.count("tied") == (served is copied)
        patches.apply(served)
        assert all(bits_equal(served[k], new[k]) for k in new)
    delta.apply_to(base)
    assert base["tied"] is base["a"] and bits_equal(base["a"], new["a"])


def test_the_publisher_patches_one_base_and_writes_a_delta_versions_full_weights_only_while_it_is_the_latest(tmp_path):
    from safetensors.torch import load_file

    from asyncgrpo.generation.delta_publisher import DeltaWeightPublisher
    from asyncgrpo.generation.weight_sync import WeightSyncStepError

    publisher = DeltaWeightPublisher(tmp_path, keep_last=5)
    base, v1 = states(torch.bfloat16, 0.05, seed=1)
    _, v2 = states(torch.bfloat16, 0.05, seed=2)
    v2 = {k: v1[k] + (v2[k] != base[k]).to(torch.bfloat16) for k in v1}  # sparse changes again

    async def main():
        await publisher.stage(base, 0)  # whole
        first = await publisher.stage(v1, 1)
        assert first.delta is not None
        await publisher.full_path(first)  # a fallback while v1 is the latest: written from the base
        second = await publisher.stage(v2, 2)
        third = await publisher.stage(v1, 3)
        full_first = await publisher.full_path(first)  # written before it was superseded: still on disk
        with pytest.raises(WeightSyncStepError, match="full weights v2 were needed after a later version was staged"):
            await publisher.full_path(second)  # the base is v3's now: never written as v2
        return full_first, await publisher.full_path(third)

    full_first, full_third = asyncio.run(main())
    for path, want in ((full_first, v1), (full_third, v1)):
        written = load_file(str(path / "model.safetensors"))
        assert all(bits_equal(written[k], want[k]) for k in want)
    assert all(bits_equal(publisher._base[k], v1[k]) for k in v1)  # the base patched to the latest, bit for bit
