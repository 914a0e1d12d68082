"""The train: section: the optimizer, its schedule, precision and hardware, LoRA, and the loss (train.loss,
loss_config.py). The stub trainer of `asyncgrpo simulate` reads its step time from the simulate: section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from asyncgrpo.config.section import Device, Section
from asyncgrpo.loss_config import LossConfig


class LoraConfig(Section):
    """LoRA adapters via peft (extra asyncgrpo[lora]); the engine and checkpoints get the merged weights."""

    r: int = Field(16, ge=1, description="Rank of the adapters.")
    alpha: float = Field(32.0, gt=0, description="Scale numerator: the update is (alpha / r) * B @ A.")
    target_modules: list[str] | str = Field("all-linear", description="Module names to adapt (e.g. [q_proj, v_proj]), or all-linear.")
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Dropout on the adapter input, in the policy's training forward and backward passes only (pi_prox, "
        "the KL reference and generation run without it); 0: pi_theta of unchanged weights equals the generator's.",
    )


class TrainConfig(Section):
    """The trainer: optimizer, schedule, precision, device, LoRA, data parallelism and the loss (train.loss)."""

    backend: Literal["torch", "stub"] = Field(
        "torch", description="torch: train the model; stub: the simulator's stand-in, a step of virtual time (simulate.step_time_s).",
    )
    max_steps: int = Field(200, ge=1, description="Optimizer steps of the run (fewer if the data runs out first: data.num_epochs).")
    lr: float = Field(1e-4, gt=0, description="Peak learning rate of AdamW, reached at the end of warm-up.")
    warmup_steps: int = Field(0, ge=0, description="Steps over which the learning rate rises linearly to train.lr (0: none).")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="After warm-up: constant, linear decay to 0 at train.max_steps, or cosine decay to 0 at train.max_steps.",
    )
    device: Device = Field(
        "auto",
        description="auto (cuda, else mps, else cpu), cpu, cuda, cuda:N or mps; the model, its optimizer and every batch live there.",
    )
    precision: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Compute dtype of forward/backward: bfloat16/float16 run under autocast on float32 master weights (float16 with a gradient "
        "scaler).",
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in the backward pass: less memory, about a third more compute.")
    lora: LoraConfig | None = Field(None, description="Train LoRA adapters instead of every weight (needs peft: pip install 'asyncgrpo[lora]').")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay.")
    optimizer_state_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="dtype of AdamW's two moments: float32 (torch.optim.AdamW, 8 bytes/parameter) or bfloat16 (4 bytes/parameter; "
        "updates computed in float32, moments stored with stochastic rounding seeded by run.seed).",
    )
    max_grad_norm: float = Field(1.0, gt=0, description="Gradients are clipped to this global L2 norm before each optimizer update.")
    micro_batch_size: int = Field(
        32, ge=1, description="Sequences per forward/backward (padded micro-batches); gradients accumulate across micro-batches. "
        "Not used when train.micro_batch_tokens is set.")
    micro_batch_tokens: int | None = Field(
        None, ge=1,
        description="Pack each micro-batch without padding: sequences (prompt + completion) back to back in one row of at most "
        "this many tokens, attention confined to each sequence (the model is checked at start); replaces "
        "train.micro_batch_size. A longer sequence trains alone in a micro-batch of its own. null: padded micro-batches.")
    updates_per_batch: int = Field(1, ge=1, description="Optimizer updates per step, each on a slice of the step's batch.")
    world_size: int = Field(
        1, ge=1, description="Trainer ranks: above 1 (runtime: ray), Ray actors that train data-parallel (DDP) on shares of each "
        "step's groups, with the loss normalised over the whole batch; 1: the trainer runs in the driver.")
    sharding: Literal["ddp", "fsdp"] = Field(
        "ddp", description="How the train.world_size ranks hold the model: ddp, a full copy of the weights, gradients and AdamW "
        "state on every rank; fsdp, each rank 1/world_size of them (FSDP2 fully_shard, one group per decoder layer; gathered "
        "for rank 0 when the generators or a checkpoint need the full weights; with train.lora, the frozen base weights and "
        "the adapters alike). Needs train.world_size > 1.")
    loss: LossConfig = Field(default_factory=LossConfig)

    @model_validator(mode="after")
    def _shardable(self) -> TrainConfig:
        if self.sharding != "fsdp":
            return self
        if self.world_size < 2:
            raise ValueError("train.sharding = fsdp shards the model across the trainer ranks, but train.world_size = 1: one "
                             "process has nothing to shard with. Fix: set train.world_size >= 2 (runtime: ray), or train.sharding: ddp.")
        return self

