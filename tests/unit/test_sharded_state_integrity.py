"""A sharded trainer's optimizer state (`optimizer/`, training/sharded_state.py) is whole only as its manifest says:
the manifest (written last, by rank 0, once every rank's files are written) is there, and every file it lists has
the size it lists. A checkpoint without `optimizer/` (one process, DDP, or written before the sharded layout) has
nothing of the kind to check."""

from __future__ import annotations

import json

from asyncgrpo.training.integrity import OPTIMIZER_DIR, OPTIMIZER_MANIFEST, sharded_optimizer_problem


def write_state(path, sizes: dict[str, int]) -> None:
    directory = path / OPTIMIZER_DIR
    directory.mkdir(parents=True)
    for name, size in sizes.items():
        (directory / name).write_bytes(b"x" * size)
    (directory / OPTIMIZER_MANIFEST).write_text(json.dumps({"format": "torch.distributed.checkpoint", "world_size": 2,
                                                           "files": sizes}))


def test_the_manifest_and_the_sizes_it_lists_decide_whether_the_sharded_optimizer_state_is_whole(tmp_path):
    assert sharded_optimizer_problem(tmp_path) is None  # no optimizer/: the state is in trainer_state.pt
    write_state(tmp_path, {"__0_0.distcp": 40, "__1_0.distcp": 30, ".metadata": 10})
    assert sharded_optimizer_problem(tmp_path) is None

    shard = tmp_path / OPTIMIZER_DIR / "__1_0.distcp"
    shard.write_bytes(b"x" * 12)  # truncated (a partial copy, a disk error)
    assert sharded_optimizer_problem(tmp_path) == "optimizer/__1_0.distcp has 12 bytes, its manifest says 30"
    shard.unlink()  # a rank's file that never arrived
    assert sharded_optimizer_problem(tmp_path) == "optimizer/__1_0.distcp is missing"
    shard.write_bytes(b"x" * 30)
    (tmp_path / OPTIMIZER_DIR / OPTIMIZER_MANIFEST).unlink()  # the ranks' writes did not all finish
    assert sharded_optimizer_problem(tmp_path) == (
        "optimizer/manifest.json is missing (the ranks' writes of the optimizer state did not all finish)")
    (tmp_path / OPTIMIZER_DIR / OPTIMIZER_MANIFEST).write_text("{")
    assert sharded_optimizer_problem(tmp_path).startswith("optimizer/manifest.json is unreadable")
