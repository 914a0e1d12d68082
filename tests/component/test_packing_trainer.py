"""Packed micro-batches (`train.micro_batch_tokens`, training/packing.py) train exactly as padded ones: on a fixed
batch, the loss, the statistics and each update's gradient agree to float32 tolerance, for every loss type and both
normalisations, with the sampling processing, decoupled proximal log-probs and a KL reference, with LoRA and with
gradient checkpointing, and on two data-parallel ranks; packed rows of an sdpa model (and of its KL reference) run
SDPA per sequence (training/varlen_attention.py), of an eager one under a block-diagonal mask. A model that attends
across packed sequences is refused with a ConfigError."""

from __future__ import annotations

import copy
import datetime
import multiprocessing
from types import SimpleNamespace

import pytest
import torch

from asyncgrpo.config import Config
from asyncgrpo.errors import ConfigError
from asyncgrpo.training.trainer import TorchTrainer
from asyncgrpo.training.varlen_attention import NAME as VARLEN_SDPA
from tests.component.test_trainer import TEMPERATURE, make_cfg, make_groups, tiny_model

pytestmark = pytest.mark.timeout(120)

BUDGET = 24  # tokens per packed row: the batch below needs several rows


def run_step(model, cfg, groups) -> tuple[dict[str, float], list[list[torch.Tensor]]]:
    """One train_step; its metrics and the (unclipped) gradient of each update as the optimizer saw it."""
    torch.manual_seed(0)  # LoRA's A matrices are drawn from the global generator
    trainer = TorchTrainer(copy.deepcopy(model), None, cfg)
    if cfg.train.micro_batch_tokens is not None and model.config._attn_implementation == "sdpa":  # packed: varlen SDPA
        assert {m.config._attn_implementation for m in (trainer.base_model, trainer.reference) if m is not None} == {VARLEN_SDPA}
    seen: list[list[torch.Tensor]] = []
    trainer.optimizer.register_step_pre_hook(
        lambda optimizer, args, kwargs: seen.append([p.grad.detach().clone() for p in trainer._params if p.grad is not None])
    )
    return trainer.train_step(groups), seen


def config(train: dict, generation: dict) -> Config:
    return Config.model_validate({"train": {"lr": 1e-2, **train}, "generation": {"temperature": TEMPERATURE, **generation}})


def assert_same_training(model, train: dict, groups, *, padded_micro: int = 5, budget: int = BUDGET, generation=None) -> None:
    base = {"max_grad_norm": 1e9, **train}  # no clipping: compare raw gradients
    padded_cfg = config({**base, "micro_batch_size": padded_micro}, generation or {})
    packed_cfg = config({**base, "micro_batch_tokens": budget}, generation or {})
    padded, padded_grads = run_step(model, padded_cfg, groups)
    packed, packed_grads = run_step(model, packed_cfg, groups)
    for key in ("loss", "grad_norm", "entropy", "kl", "clip_frac", "is_ratio/mean", "is_ratio/max"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-5, abs=1e-6), key
    assert len(packed_grads) == len(padded_grads) == train.get("updates_per_batch", 1)
    for update_packed, update_padded in zip(packed_grads, padded_grads, strict=True):
        assert len(update_packed) == len(update_padded) > 0
        for a, b in zip(update_packed, update_padded, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def model_and_groups():
    model = tiny_model()
    return model, make_groups(model, 4, seed=5, truncated_every=3)


@pytest.mark.parametrize("loss", [
    {"type": "dapo"},  # token normalisation
    {"type": "grpo"},  # sequence normalisation
    {"type": "dr_grpo"},
    {"type": "cispo"},
    {"type": "sapo"},
    {"type": "luspo"},
    {"type": "vespo"},
    {"type": "grpo", "importance_sampling_level": "sequence"},
])
def test_packed_equals_padded_for_each_loss_type(model_and_groups, loss):
    model, groups = model_and_groups
    assert_same_training(model, {"loss": loss}, groups)


def test_packed_equals_padded_for_bnpo_with_the_same_micro_batches(model_and_groups):
    # bnpo normalises by the number of micro-batches: equal when both cut the update into one.
    model, groups = model_and_groups
    assert_same_training(model, {"loss": {"type": "bnpo"}}, groups, padded_micro=64, budget=4096)


def test_packed_equals_padded_with_decoupled_updates_kl_and_sampling_processing(model_and_groups):
    # Two updates (the second's pi_prox comes from packed forwards too), the KL reference's packed forward, and the
    # repetition penalty's per-sequence context.
    model, groups = model_and_groups
    train = {"updates_per_batch": 2, "loss": {"objective": "decoupled", "kl_coef": 0.1}}
    assert_same_training(model, train, groups, generation={"repetition_penalty": 1.3})


def test_packed_equals_padded_with_lora(model_and_groups):
    model, groups = model_and_groups
    assert_same_training(model, {"lora": {"r": 4, "alpha": 8}, "loss": {"kl_coef": 0.05}}, groups)


def test_packed_equals_padded_with_gradient_checkpointing(model_and_groups):
    model, groups = model_and_groups
    assert_same_training(model, {"gradient_checkpointing": True}, groups)


def test_packed_equals_padded_with_eager_attention(model_and_groups):
    model, groups = model_and_groups
    eager = copy.deepcopy(model)
    eager.config._attn_implementation = "eager"
    assert_same_training(eager, {}, groups)


class CumulativeLM(torch.nn.Module):
    """A causal LM whose each position sees the mean of every embedding before it in the row: it cannot confine
    attention to a packed sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(vocab_size=32, _attn_implementation="cumulative-mean")
        self.embed = torch.nn.Embedding(32, 8)
        self.head = torch.nn.Linear(8, 32)

    def forward(self, input_ids, position_ids=None, attention_mask=None, use_cache=False):
        x = self.embed(input_ids)
        steps = torch.arange(1, x.shape[1] + 1, device=x.device).view(1, -1, 1)
        return SimpleNamespace(logits=self.head(x.cumsum(1) / steps))


def test_a_model_that_attends_across_packed_sequences_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        TorchTrainer(CumulativeLM(), None, make_cfg({"micro_batch_tokens": 64}))
    message = str(info.value)
    for part in ("train.micro_batch_tokens = 64", "CumulativeLM", "'cumulative-mean'", "Fix: unset train.micro_batch_tokens"):
        assert part in message
    TorchTrainer(CumulativeLM(), None, make_cfg())  # padded micro-batches need no confinement


class PositionlessLM(CumulativeLM):
    """A causal LM whose forward takes no position ids: packing cannot restart its positions per sequence."""

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        return super().forward(input_ids, attention_mask=attention_mask, use_cache=use_cache)


def test_a_model_whose_forward_takes_no_position_ids_is_a_config_error_not_a_type_error():
    with pytest.raises(ConfigError) as info:
        TorchTrainer(PositionlessLM(), None, make_cfg({"micro_batch_tokens": 64}))
    message = str(info.value)
    for part in ("train.micro_batch_tokens = 64", "PositionlessLM", "takes no position_ids", "Fix: unset train.micro_batch_tokens"):
        assert part in message


def train_as_rank(rank: int, init_file: str, out: str, model, groups, train: dict) -> None:
    """One of two data-parallel ranks (a forked child): one packed step; rank 0 saves its metrics and gradients."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # forked from a process whose OpenMP pool may be running: using it here would hang
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        trainer = TorchTrainer(copy.deepcopy(model), None, config({"max_grad_norm": 1e9, **train}, {}))
        trainer.join_data_parallel(rank, 2)
        seen: list[list[torch.Tensor]] = []
        trainer.optimizer.register_step_pre_hook(
            lambda optimizer, args, kwargs: seen.append([p.grad.detach().clone() for p in trainer._params if p.grad is not None])
        )
        metrics = trainer.train_step(groups)
        if rank == 0:
            torch.save({"metrics": metrics, "grads": seen}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])  # sequence and token normalisation
def test_two_packed_data_parallel_ranks_equal_one_padded_process(model_and_groups, tmp_path, loss_type):
    # The ranks are forked (gloo on CPU, no re-import): each packs its share of the groups; their summed gradient is
    # the single padded process's.
    model, groups = model_and_groups
    train = {"micro_batch_tokens": BUDGET, "loss": {"type": loss_type}}
    context = multiprocessing.get_context("fork")
    out = tmp_path / "rank0.pt"
    ranks = [context.Process(target=train_as_rank, args=(rank, str(tmp_path / "init"), str(out), model, groups, train))
             for rank in range(2)]
    try:
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(timeout=90)
        assert [process.exitcode for process in ranks] == [0, 0]
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
    parallel = torch.load(out)
    single, single_grads = run_step(model, config({"max_grad_norm": 1e9, "micro_batch_size": 5, "loss": {"type": loss_type}}, {}), groups)
    for key in ("loss", "grad_norm", "entropy", "clip_frac"):
        assert parallel["metrics"][key] == pytest.approx(single[key], rel=1e-5, abs=1e-6), key
    # the off-policy diagnostics are the whole batch's on every rank, not rank 0's share
    offpolicy = [key for key in single if key.startswith(("offpolicy/", "engine_mismatch/"))]
    assert single["offpolicy/s0/tokens"] > 0 and offpolicy
    for key in offpolicy:
        assert parallel["metrics"][key] == pytest.approx(single[key], rel=1e-5, abs=1e-6, nan_ok=True), key
    for a, b in zip(parallel["grads"][0], single_grads[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
