"""`train.sharding: fsdp` on two CPU ranks (torch.multiprocessing, gloo; what a Ray rank runs, without Ray): a step
of the two sharded ranks equals the single-process step on the same batch (loss, gradient norm, weights, AdamW's
moments), each rank holds about half the parameters and optimizer state (measured: the bytes of its shards), and
checkpoints cross world sizes both ways: the ranks resume a checkpoint one process wrote, and one process resumes
the checkpoint the ranks wrote (the single-process layout: the gathered full weights and optimizer state). The same
holds with LoRA (frozen base weights and adapters sharded alike; the generators get the merged weights; the checkpoint
holds the merged model and peft's adapter), with the KL term on, whose reference is the sharded model, adapters off.

The batch makes the ranks unequal (as tests/integration/test_ray_trainer.py): 4 groups in 3 updates (2, 1 and 1
groups), micro-batches of 3 sequences, so rank 1 has no sequence in two updates and fewer forward passes in each;
the decoupled objective adds the pi_prox passes of each rank's share. FSDP all-gathers in every forward pass, so a
rank that made fewer would wait forever: the test ends in its timeout instead.

Tolerance: the ranks add the same gradients in another order (each rank its sequences, then the reduce-scatter).
As in test_ray_trainer.py, the bound on the weights and moments is the single process's own float32 noise,
measured: how far its results move when only its micro-batch size changes.
"""

from __future__ import annotations

import copy
import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from asyncgrpo.config import load_config
from asyncgrpo.models.loading import load_model_and_tokenizer
from asyncgrpo.training.bf16_adamw import local
from asyncgrpo.training.checkpoint import checkpoint_dir, load_checkpoint, save_checkpoint
from asyncgrpo.training.integrity import TRAINER_STATE_FILE
from asyncgrpo.training.lora import adapter_state
from asyncgrpo.training.sharded_state import read_shards
from asyncgrpo.training.trainer import TorchTrainer
from tests.component.test_trainer import TEMPERATURE, make_groups

pytestmark = pytest.mark.timeout(300)

WORLD = 2
LOW = ("train.precision=bfloat16", "train.optimizer_state_dtype=bfloat16")
# The KL term: its reference is sharded too (a frozen copy; with LoRA the sharded model, adapters off).
KL = "train.loss.kl_coef=0.1"
LORA = ("train.lora.r=4", KL)
HALF = "train.precision=float16"


def config(*overrides: str):
    return load_config(None, ["model.path=builtin:tiny", f"generation.temperature={TEMPERATURE}", "train.lr=1e-2",
                              "train.updates_per_batch=3", "train.micro_batch_size=3", "train.device=cpu",
                              "rollout.group_size=4", "rollout.mask_truncated=true", "train.loss.objective=decoupled",
                              *overrides])


def parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of the parameters `module` holds now (a rank's shards when sharded and not gathered)."""
    return sum(local(p).numel() * p.element_size() for p in module.parameters())


def held_bytes(trainer: TorchTrainer) -> int:
    """Bytes of this process's parameters and optimizer state tensors (a rank's shards when sharded)."""
    params = parameter_bytes(trainer.model)
    state = sum(local(t).numel() * t.element_size() for s in trainer.optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0)
    return params + state


def rank_main(rank: int, port: int, directory: str, first_checkpoint: str, lora_checkpoint: str) -> None:
    torch.set_num_threads(1)  # forked: no OpenMP pool of the parent's in this process (and two ranks on two cores)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    try:
        torch.manual_seed(0)
        model, tokenizer = load_model_and_tokenizer("builtin:tiny", "float32", 0)
        groups = make_groups(model, 4, seed=6, truncated_every=3)  # the log-probs of the initial model, as the test's
        initial = copy.deepcopy(model)
        cfg = config(KL, "runtime=ray", f"train.world_size={WORLD}", "train.sharding=fsdp")
        trainer = TorchTrainer(model, tokenizer, cfg)
        load_checkpoint(first_checkpoint, trainer)  # as a Ray rank does: before joining, into the unsharded model
        assert trainer.reference is not None
        unsharded, reference = held_bytes(trainer), [parameter_bytes(trainer.reference)]
        trainer.join_data_parallel(rank, WORLD)
        sharded = held_bytes(trainer)
        metrics = trainer.train_step(groups)
        reference.append(parameter_bytes(trainer.reference))  # after its forwards: resharded, the root group's too
        weights = trainer.generation_weights()  # every rank takes part; rank 0 gets them
        written = save_together(trainer, rank, directory, 2, cfg)
        # Two ranks resume the checkpoint the ranks wrote: each rank's shards are the ones it saved, to the bit.
        again = resume_sharded(initial, tokenizer, cfg, written, rank)
        resumed_at_2 = [(again.version, again.scheduler.last_epoch == trainer.scheduler.last_epoch, shard_difference(again, trainer))]
        # bfloat16 through FSDP2's mixed precision, AdamW's moments in bfloat16 (sharded like the parameters).
        low = TorchTrainer(copy.deepcopy(initial), tokenizer, config(*LOW, "runtime=ray", f"train.world_size={WORLD}", "train.sharding=fsdp"))
        low.join_data_parallel(rank, WORLD)
        low_metrics = low.train_step(groups)
        assert all(local(p).dtype == torch.float32 for p in low.model.parameters())  # the master weights
        low_written = save_together(low, rank, os.path.join(directory, "low"), 1, cfg)
        low_again = resume_sharded(initial, tokenizer, low.cfg, low_written, rank)  # its bfloat16 moments, read as such
        resumed_at_2.append((low_again.version, True, shard_difference(low_again, low)))
        low_generators = low.optimizer.state_dict()["rounding_generators"]  # each rank its own; rank 0's are saved
        # float16 with its loss scaler; rank 1 alone sees an overflow (in one gradient shard) in the last update.
        half = low_loss_scale(TorchTrainer(copy.deepcopy(initial), tokenizer,
                                           config(HALF, "runtime=ray", f"train.world_size={WORLD}", "train.sharding=fsdp")))
        half.join_data_parallel(rank, WORLD)
        if rank == 1:
            overflow_at_unscale(half, 3)
        half_metrics = half.train_step(groups)
        assert half.scaler is not None
        half_state = (half.scaler.get_scale(), max(int(s["step"]) for s in half.optimizer.state.values()))
        # LoRA: frozen base weights and trainable adapters sharded alike, resumed from (and saved into) checkpoints.
        lora_cfg = config(*LORA, "runtime=ray", f"train.world_size={WORLD}", "train.sharding=fsdp")
        adapted = TorchTrainer(copy.deepcopy(initial), tokenizer, lora_cfg)
        load_checkpoint(lora_checkpoint, adapted)
        lora_unsharded = held_bytes(adapted)
        adapted.join_data_parallel(rank, WORLD)
        lora_sharded = held_bytes(adapted)
        lora_metrics = adapted.train_step(groups)
        lora_weights = adapted.generation_weights()
        save_together(adapted, rank, os.path.join(directory, "lora"), 2, lora_cfg)
        torch.save({"metrics": metrics, "weights": weights, "unsharded": unsharded, "sharded": sharded,
                    "low_metrics": low_metrics, "low_generators": low_generators, "lora_metrics": lora_metrics,
                    "lora_weights": lora_weights, "lora_held": (lora_unsharded, lora_sharded), "reference": reference,
                    "half": (half_metrics, half_state), "resumed_at_2": resumed_at_2},
                   os.path.join(directory, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def save_together(trainer: TorchTrainer, rank: int, directory: str, step: int, cfg, *, elsewhere: bool = False) -> Path:
    """What the driver's `save_checkpoint` asks of every rank (training/ray_trainer.py): rank 0 runs it, the other ranks
    take part in its calls, in its temporary directory (`elsewhere`: one the other ranks do not see). Returns the
    checkpoint once it is in place."""
    if rank == 0:
        save_pretrained = trainer.save_pretrained

        def announced(tmp: Any) -> None:
            dist.broadcast_object_list([str(tmp)], src=0)
            save_pretrained(tmp)

        trainer.save_pretrained = announced  # type: ignore[method-assign]
        try:
            save_checkpoint(directory, step, trainer, cfg.model_dump_json(), {})
        finally:
            del trainer.save_pretrained
    else:
        tmp: list[Any] = [None]
        dist.broadcast_object_list(tmp, src=0)
        seen = Path(tmp[0] + "-elsewhere" if elsewhere else tmp[0])
        trainer.save_pretrained(seen)
        trainer.save_trainer_state(seen / TRAINER_STATE_FILE)
    dist.barrier()  # rank 0 renamed it into place
    return checkpoint_dir(Path(directory), step)


def resume_sharded(initial: torch.nn.Module, tokenizer: Any, cfg, checkpoint: Path, rank: int) -> TorchTrainer:
    """A rank resumed from `checkpoint` as a Ray rank resumes (training/ray_trainer.py `TrainerRank`): the checkpoint
    without the optimizer's shards, then joined, then (every rank together) its own shards."""
    trainer = TorchTrainer(copy.deepcopy(initial), tokenizer, cfg)
    load_checkpoint(checkpoint, trainer, shards_after_join=True)
    trainer.join_data_parallel(rank, WORLD)
    read_shards(checkpoint, trainer.optimizer, trainer.model)
    return trainer


def shard_difference(a: TorchTrainer, b: TorchTrainer) -> float:
    """The largest difference of what two sharded trainers hold on this rank (their parameters' and optimizer state's
    shards), matched by parameter name."""
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    pairs = [(local(pa[n]), local(pb[n])) for n in pa]
    for name, param in pa.items():
        mine, theirs = a.optimizer.state.get(param, {}), b.optimizer.state.get(pb[name], {})
        assert mine.keys() == theirs.keys(), name
        pairs += [(local(mine[k]), local(theirs[k])) for k in mine]
    return max(float((x.detach().float() - y.detach().float()).abs().max()) if x.numel() else 0.0 for x, y in pairs)


def low_loss_scale(trainer: TorchTrainer) -> TorchTrainer:
    """`trainer` with its float16 loss scale at 1024, not 65536: FSDP2's float16 gradients (of float16 weights) overflow
    at 65536 in another update than autocast's (of float32 weights) do, and each skips its own; at 1024 neither does."""
    assert trainer.scaler is not None
    trainer.scaler.load_state_dict({**trainer.scaler.state_dict(), "scale": 1024.0})
    return trainer


def overflow_at_unscale(trainer: TorchTrainer, update: int) -> None:
    """At the `update`-th update's unscaling, an inf in this rank's shard of one gradient: an overflow no other rank sees."""
    assert trainer.scaler is not None
    unscale, calls = trainer.scaler.unscale_, []

    def unscale_(optimizer: torch.optim.Optimizer) -> None:
        calls.append(optimizer)
        if len(calls) == update:
            local(next(p.grad for p in optimizer.param_groups[0]["params"] if p.grad is not None)).fill_(float("inf"))
        unscale(optimizer)

    trainer.scaler.unscale_ = unscale_  # type: ignore[method-assign]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def single(model, tokenizer, *overrides: str) -> TorchTrainer:
    return TorchTrainer(copy.deepcopy(model), tokenizer, config(*overrides))


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], *, relative: bool = False) -> float:
    """The largest elementwise difference of two state dicts (`relative`: each tensor's over its largest magnitude)."""
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max() / (b[k].abs().max() if relative else 1)) for k in a)


def moments(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    state = trainer.optimizer.state_dict()["state"]
    return {f"{key}.{name}": value for key, entry in state.items() for name, value in entry.items() if name != "step"}


def test_two_sharded_ranks_make_the_single_process_step_on_half_the_bytes_and_checkpoints_cross_world_sizes(tmp_path):
    model, tokenizer = load_model_and_tokenizer("builtin:tiny", "float32", 0)
    # One process trains step 1 and writes its checkpoint; the ranks resume it for step 2.
    first = single(model, tokenizer)
    first.train_step(make_groups(model, 4, seed=5, truncated_every=3))
    first_checkpoint = save_checkpoint(tmp_path, 1, first, "", {})
    first_lora = single(model, tokenizer, *LORA)
    first_lora.train_step(make_groups(model, 4, seed=5, truncated_every=3))
    lora_checkpoint = save_checkpoint(tmp_path / "lora", 1, first_lora, "", {})
    mp.start_processes(rank_main, args=(free_port(), str(tmp_path), str(first_checkpoint), str(lora_checkpoint)),
                       nprocs=WORLD, join=True, start_method="fork")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]

    groups = make_groups(model, 4, seed=6, truncated_every=3)
    expected, regrouped = single(model, tokenizer, KL), single(model, tokenizer, KL, "train.micro_batch_size=1")
    for trainer in (expected, regrouped):
        load_checkpoint(first_checkpoint, trainer)
    expected_metrics = expected.train_step(groups)
    regrouped.train_step(groups)
    weight_noise = largest_difference(regrouped.generation_weights(), expected.generation_weights())
    moment_noise = largest_difference(moments(regrouped), moments(expected), relative=True)
    assert 0 < weight_noise < 1e-3 and 0 < moment_noise < 1e-4

    for key in ("loss", "grad_norm", "kl", "clip_frac", "is_ratio/mean", "entropy"):
        assert ranks[0]["metrics"][key] == pytest.approx(expected_metrics[key], rel=1e-5, abs=1e-9), key
    assert ranks[1]["weights"] == {}
    # The ranks sum in a third order: their distance from the single process is of the regrouped process's order, not
    # under it (1.28x it in one run of make test); 4x bounds it, far below what a wrong sum or a lost shard would move.
    assert largest_difference(ranks[0]["weights"], expected.generation_weights()) <= 4 * weight_noise

    # Each rank holds its half (torch.chunk along the first dimension: a first dimension of odd length splits unevenly).
    assert sum(r["sharded"] for r in ranks) == ranks[0]["unsharded"] == held_bytes(expected)
    assert all(0.45 < r["sharded"] / r["unsharded"] < 0.55 for r in ranks), [r["sharded"] for r in ranks]
    # So does the KL reference's frozen copy, after its forward passes as before them.
    assert expected_metrics["kl"] > 0 and sum(r["reference"][1] for r in ranks) == ranks[0]["reference"][0]
    assert all(0.45 < part / whole < 0.55 for r in ranks for whole, part in [r["reference"]]), [r["reference"] for r in ranks]

    # One process resumes the ranks' checkpoint: the full weights and AdamW state, in the single-process layout.
    written = tmp_path / "checkpoints" / "step_000002"
    assert sorted(p.name for p in (written / "optimizer").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"]
    resumed = single(model, tokenizer)
    state = load_checkpoint(written, resumed)
    assert state["step"] == 2 and resumed.version == 2
    assert largest_difference(resumed.generation_weights(), expected.generation_weights()) <= 4 * weight_noise
    # The moments (running averages of the gradients) carry the summation order more directly than the weights: the
    # ranks' largest difference measured 2.3x the regrouped process's (1.3e-8 against 5.6e-9, absolute); 10x bounds it.
    assert largest_difference(moments(resumed), moments(expected), relative=True) <= 10 * moment_noise
    assert resumed.optimizer.state_dict()["param_groups"] == expected.optimizer.state_dict()["param_groups"]
    # Two ranks resume it too, each with exactly the shards it saved (weights and AdamW state), at the same schedule.
    assert [r["resumed_at_2"] for r in ranks] == [[(2, True, 0.0), (1, True, 0.0)]] * WORLD  # float32, bfloat16 moments
    assert not (first_checkpoint / "optimizer").exists()  # one process keeps the whole state in trainer_state.pt

    # bfloat16 compute and moments: the same update to bfloat16's precision. FSDP2 casts the weights where the single
    # process autocasts the matrix products, and the moments are rounded stochastically, each rank its shard: the bound
    # is bfloat16's own noise, measured as the distance of the single process's first moments from float32's.
    low, plain = single(model, tokenizer, *LOW), single(model, tokenizer)
    low_metrics = low.train_step(groups)
    plain.train_step(groups)
    assert ranks[0]["low_metrics"]["loss"] == pytest.approx(low_metrics["loss"], rel=2e-2)
    assert ranks[0]["low_metrics"]["grad_norm"] == pytest.approx(low_metrics["grad_norm"], rel=2e-2)
    low_resumed = single(model, tokenizer, *LOW)  # one process reads the ranks' shards of the bfloat16 moments
    load_checkpoint(tmp_path / "low" / "checkpoints" / "step_000001", low_resumed)
    sharded_moments = moments(low_resumed)
    assert sharded_moments.keys() == moments(low).keys()
    generators = low_resumed.optimizer.state_dict()["rounding_generators"]
    assert generators.keys() == ranks[0]["low_generators"].keys()
    assert all(torch.equal(generators[d], ranks[0]["low_generators"][d]) for d in generators)
    assert all(v.dtype == torch.bfloat16 for v in sharded_moments.values())
    bfloat16_noise = first_moment_distance(moments(low), moments(plain))
    assert 0 < bfloat16_noise < 0.2
    assert first_moment_distance(sharded_moments, moments(low)) <= 2 * bfloat16_noise

    # float16: the ranks compute the single process's losses; the overflow one rank saw in the last update made both skip
    # it (one AdamW step fewer than the single process, every rank) and halve their loss scale alike.
    half = low_loss_scale(single(model, tokenizer, HALF))
    half_metrics = half.train_step(groups)
    assert half.scaler is not None
    steps = max(int(s["step"]) for s in half.optimizer.state.values())
    assert ranks[0]["half"][0]["loss"] == pytest.approx(half_metrics["loss"], rel=2e-2)
    assert [r["half"][1] for r in ranks] == [(half.scaler.get_scale() / 2, steps - 1)] * WORLD

    # LoRA: the ranks' step is the single process's, the generators get the merged weights, each rank holds half of the
    # (mostly frozen) parameters, and the checkpoint they wrote resumes in one process (the adapter in peft's layout,
    # the merged model in save_pretrained's).
    expected, regrouped = single(model, tokenizer, *LORA), single(model, tokenizer, *LORA, "train.micro_batch_size=1")
    for trainer in (expected, regrouped):
        load_checkpoint(lora_checkpoint, trainer)
    expected_metrics = expected.train_step(groups)
    regrouped.train_step(groups)
    weight_noise = largest_difference(regrouped.generation_weights(), expected.generation_weights())
    adapter_noise = largest_difference(adapter_state(regrouped.model), adapter_state(expected.model))
    assert 0 < weight_noise < 1e-3 and 0 < adapter_noise < 1e-3
    for key in ("loss", "grad_norm", "kl", "clip_frac", "is_ratio/mean", "entropy"):
        assert ranks[0]["lora_metrics"][key] == pytest.approx(expected_metrics[key], rel=1e-5, abs=1e-9), key
    assert expected_metrics["kl"] > 0
    assert ranks[1]["lora_weights"] == {}
    assert largest_difference(ranks[0]["lora_weights"], expected.generation_weights()) <= 4 * weight_noise
    (unsharded, _), shards = ranks[0]["lora_held"], [r["lora_held"][1] for r in ranks]
    assert sum(shards) == unsharded == held_bytes(expected) and all(0.45 < s / unsharded < 0.55 for s in shards), shards
    written = tmp_path / "lora" / "checkpoints" / "step_000002"
    saved = load_file(str(written / "model.safetensors"))
    assert largest_difference(saved, {k: v for k, v in expected.generation_weights().items() if k in saved}) <= 4 * weight_noise
    resumed = single(model, tokenizer, *LORA)
    assert load_checkpoint(written, resumed)["step"] == 2
    assert largest_difference(adapter_state(resumed.model), adapter_state(expected.model)) <= 4 * adapter_noise
    # The adapters' AdamW state only (the base weights are frozen), read from the ranks' shards.
    lora_moment_noise = largest_difference(moments(regrouped), moments(expected), relative=True)
    assert moments(resumed).keys() == moments(expected).keys() and len(resumed.optimizer.state) == len(resumed._params)
    assert largest_difference(moments(resumed), moments(expected), relative=True) <= 10 * lora_moment_noise
    assert largest_difference(resumed.generation_weights(), expected.generation_weights()) <= 4 * weight_noise
    assert resumed.optimizer.state_dict()["param_groups"] == expected.optimizer.state_dict()["param_groups"]


def first_moment_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over every parameter's first moment (AdamW's running mean of the gradient)."""
    keys = [k for k in b if k.endswith(".exp_avg")]
    return float(torch.cat([(a[k].float() - b[k].float()).flatten() for k in keys]).norm() / torch.cat([b[k].float().flatten() for k in keys]).norm())
