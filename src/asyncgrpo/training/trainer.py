"""The torch GRPO trainer: one blocking `train_step` per batch of groups (DESIGN.md §3 "Training").

The caller (the run loop) runs `train_step` in a worker thread it owns; this module starts
no threads and does no I/O.

One training step on a batch of groups:
1. Each rollout becomes one sequence: prompt token ids + completion token ids, its
   advantage (`Rollout.advantage`) and its generation log-probs (`Completion.logprobs`).
   Loss tokens are the completion tokens; a truncated completion has none when
   `rollout.mask_truncated` is on. An episode's completion (rollout/episode.py) trains the
   model's tokens only: its environment tokens are context, masked out by `loss_mask`, and
   its prompt is `Completion.prompt_token_ids` when its reset observation joined the prompt.
2. `decoupled`: the proximal log-probs pi_prox are those of the weights at the start of
   the step (computed once, without grad).
3. The groups are split into `train.updates_per_batch` mini-batches (whole groups, in
   order); each is one optimizer update whose gradient accumulates over micro-batches of
   `train.micro_batch_size` sequences (padded, sorted by length), or of at most `train.micro_batch_tokens`
   tokens packed without padding (training/packing.py), normalised by the loss tokens (or sequences) of the
   whole mini-batch, then clipped to `train.max_grad_norm`.
4. The LR scheduler steps once, and `version` advances by exactly 1.

Hardware (models/device.py): the model, its optimizer state and every batch live on
`train.device`. The trainer's weights are float32 master weights whatever `model.dtype` says;
`train.precision` bfloat16/float16 runs forward and backward under autocast (float16 with a
gradient scaler). `train.gradient_checkpointing` recomputes each decoder layer's activations in
the backward pass. `train.lora` trains peft adapters on frozen base weights (training/lora.py).
`train.optimizer_state_dtype: bfloat16` keeps AdamW's moments in bfloat16 (training/bf16_adamw.py).
On the CPU each step ends by handing its freed memory back to the system (training/heap.py).
The LR schedule (`train.lr_schedule`): linear warm-up over `train.warmup_steps` steps, then
constant, or linear or cosine decay to 0 at `train.max_steps`.

Invariants:
- Policy version = number of training steps applied: step s starts at version s and ends
  at s + 1, whatever `updates_per_batch` is.
- pi_theta is the distribution the generator samples from: at `generation.temperature`, after
  `generation.repetition_penalty`, renormalised over the support `generation.top_k` / `top_p` / `min_p`
  keep of the trainer's own logits (sampling.py; DESIGN.md §3 "Which distribution is optimised").
  The KL reference is scored over the whole vocabulary at the temperature.
- The model stays in eval mode (its own dropouts off), so pi_theta of unchanged weights equals the
  generator's pi_gen up to numerics. (Gradient checkpointing sets only the decoder layers'
  own `training` flag, which transformers reads to checkpoint; their submodules stay in eval.)
  The one exception is `train.lora.dropout`: the adapters' dropout applies to the policy's
  forward and backward passes of an update (training/lora.py `adapter_dropout`), and then every
  update's pi_prox is computed without it, like the KL reference: both stay deterministic.
- Every trainable parameter is float32, before and after any step, at any precision.
- A non-finite loss or gradient norm raises `NonFiniteLossError` before the optimizer
  applies it; weights are never updated with NaN/inf.
- Every metric key in `TRAIN_KEYS` and in the algorithm's `metric_keys` is returned every
  step, as a finite float; so is every key of `offpolicy_keys(rollout.trained_staleness_bound)` (training/offpolicy.py),
  except NaN for a staleness value the step has no token of.
- The algorithm (algorithms/, from `algorithm:`) gives the advantages: per sequence (GRPO's `Rollout.advantage`)
  or per token (distillation's -(log pi_gen - log pi_teacher)), with the same importance correction against pi_gen.

Split by job: sequences and their collation in training/batch.py, packed micro-batches in training/packing.py,
the LR schedule in training/schedule.py, gradient checkpointing in training/checkpointing.py.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from asyncgrpo.algorithms.registry import algorithm_for
from asyncgrpo.config import Config
from asyncgrpo.errors import AsyncGRPOError
from asyncgrpo.generation.lora_adapter import with_adapter
from asyncgrpo.metric_names import TRAIN_KEYS
from asyncgrpo.models.device import autocast, check_precision, resolve_device
from asyncgrpo.sampling import Processing, sampled_logprobs, token_logprobs
from asyncgrpo.training import heap, packing, sharded_state
from asyncgrpo.training import lora as lora_adapters
from asyncgrpo.training.batch import MicroBatch, TrainSequence, by_length, chunks, collate, filler, pad_id_of, sequences, split_even
from asyncgrpo.training.bf16_adamw import Bf16StateAdamW
from asyncgrpo.training.checkpointing import enable_gradient_checkpointing
from asyncgrpo.training.loss import LossStats, grpo_loss
from asyncgrpo.training.losses.aggregation import update_normalizer
from asyncgrpo.training.losses.plugin import resolve_loss_plugin
from asyncgrpo.training.offpolicy import OffPolicyStats
from asyncgrpo.training.schedule import apply_hyperparameters, lr_factor
from asyncgrpo.types import Group

if TYPE_CHECKING:
    from asyncgrpo.training.data_parallel import DataParallel
    from asyncgrpo.training.sharding import FullySharded


class NonFiniteLossError(AsyncGRPOError):
    """The loss or the gradient norm of an update is NaN or infinite; the update was not applied."""


class TorchTrainer:
    """GRPO on a Hugging Face causal LM with AdamW (float32 or bfloat16 moments), an LR schedule and gradient accumulation.

    `model`: a causal LM; it is moved to `train.device` and to float32 (the master weights), and
    wrapped in LoRA adapters when `train.lora` is set. `tokenizer`: used only for its pad id
    (None: pad with 0) and saved with checkpoints. With `train.loss.kl_coef > 0` a frozen copy
    of `model` as passed here is the KL reference (with LoRA: the base model, adapters off), so on
    resume build the trainer from the initial model and then load the checkpoint.
    """

    def __init__(self, model: Any, tokenizer: Any, cfg: Config, *, version: int = 0) -> None:
        t = cfg.train
        self.cfg = cfg
        self.algorithm = algorithm_for(cfg)  # the advantages and the algorithm's own metrics (algorithms/)
        self.tokenizer = tokenizer
        self.version = version
        # Held by train_step, generation_weights, state_dict and load_state_dict; hold it to
        # read or write the model consistently from another thread (checkpoints do).
        self.lock = threading.RLock()
        self._device = resolve_device(t.device)
        check_precision(self._device, t.precision)
        model = model.to(device=self._device, dtype=torch.float32)
        # The KL reference: a frozen copy of the initial model; with LoRA the base model itself, its adapters switched
        # off for the reference's forward pass (no copy: the base weights are frozen anyway).
        self.reference: torch.nn.Module | None = None
        if t.loss.kl_coef > 0 and t.lora is None:
            self.reference = copy.deepcopy(model).eval()
            self.reference.requires_grad_(False)
        self.model = lora_adapters.wrap(model, t.lora, cfg.run.seed) if t.lora is not None else model
        self.model.eval()
        self._adapter_dropout = t.lora is not None and t.lora.dropout > 0
        if t.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        if t.micro_batch_tokens is not None:
            packing.prefer_varlen(self._device, self.base_model, self.reference)
            packing.check_confinement(self.base_model, budget=t.micro_batch_tokens, model_path=cfg.model.path, device=self._device)
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        if not self._params:
            raise ValueError("the model has no trainable parameters (every parameter has requires_grad=False)")
        self.optimizer: torch.optim.Optimizer
        if t.optimizer_state_dtype == "bfloat16":
            self.optimizer = Bf16StateAdamW(self._params, lr=t.lr, weight_decay=t.weight_decay, seed=cfg.run.seed)
        else:
            self.optimizer = torch.optim.AdamW(self._params, lr=t.lr, weight_decay=t.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        # float16 gradients underflow without loss scaling; bfloat16 has float32's range and needs none.
        self.scaler = torch.amp.GradScaler(self._device.type) if t.precision == "float16" else None
        self.pad_id = pad_id_of(tokenizer)
        self._keeps_logits = "logits_to_keep" in inspect.signature(self.base_model.forward).parameters
        self._parallel: DataParallel | FullySharded | None = None
        self._sharded: FullySharded | None = None  # the same object, when it shards (train.sharding: fsdp)
        self._offpolicy = OffPolicyStats(cfg.rollout.trained_staleness_bound, clip_low=t.loss.clip_low, clip_high=t.loss.clip_high)
        g = cfg.generation  # the distribution the generators sample from (sampling.py); pi_theta is scored under it
        self.processing = Processing(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p, min_p=g.min_p,
                                     repetition_penalty=g.repetition_penalty)
        self._loss_plugin = resolve_loss_plugin(t.loss.type) if t.loss.plugin else None

    # ---------------------------------------------------------------------------------
    # Public API

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def lora(self) -> bool:
        return self.cfg.train.lora is not None

    @property
    def base_model(self) -> Any:
        """The transformers model (inside the LoRA wrapper when there is one): its config, its save layout."""
        return lora_adapters.base_model(self.model) if self.lora else self.model

    def join_data_parallel(self, rank: int, world_size: int) -> None:
        """From now on train as rank `rank` of `world_size` in the initialised torch.distributed group: each update
        runs this rank's share of the batch and sums the gradients over the ranks (training/data_parallel.py; sharded:
        training/sharding.py)."""
        from asyncgrpo.training.sharding import FullySharded, join

        with self.lock:
            self._parallel = join(self.model, self.optimizer, self.cfg.train, rank=rank, world_size=world_size, device=self._device,
                                  reference=self.reference)
            self._sharded = self._parallel if isinstance(self._parallel, FullySharded) else None
            self._params = [p for p in self.model.parameters() if p.requires_grad]  # sharded: the sharded ones now

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer update will use."""
        return float(self.optimizer.param_groups[0]["lr"])

    def train_step(self, groups: Sequence[Group]) -> dict[str, float]:
        """Train one step on `groups` (whole groups; at least one). Advances `version` by 1.

        Returns every key of `TRAIN_KEYS`, of the algorithm's `metric_keys` and of `offpolicy_keys` as a float.
        """
        with self.lock:
            metrics = self._train_step(groups)
        if self._device.type == "cpu":
            heap.release_freed_memory()  # the step's freed activations and gradients, kept by glibc otherwise
        return metrics

    def generation_weights(self) -> dict[str, Tensor]:
        """The weights a generator serves, under the base model's names, without copying them.

        The tensors are the live (detached) parameters, so they are valid until the next
        `train_step` or `load_state_dict`: the caller must have installed them by then (the
        pipeline awaits each weight sync before training the next step; the local engine copies
        them into its own weights, in its serving dtype). With LoRA, adapted linears are merged
        into fresh tensors and every other weight is still the live one (training/lora.py)."""
        with self.lock, torch.no_grad():
            weights = lora_adapters.merged_state(self.model) if self.lora else self.model.state_dict()
            if self._sharded is not None:  # gathered: rank 0 gets full copies, the other ranks {}
                return self._sharded.full_weights(weights)
            if self.lora:  # the merged weights, carrying the adapter for weight_sync: lora (lora_adapter.py)
                return with_adapter(weights, self.model)
            return {name: tensor.detach() for name, tensor in weights.items()}

    def save_pretrained(self, directory: Any) -> None:
        """The model in the save_pretrained layout (merged, with LoRA: plus the adapter in lora.ADAPTER_DIR). Sharded,
        every rank takes part in the gathers and rank 0 writes."""
        with self.lock:
            if self._sharded is None and not self.lora:
                self.base_model.save_pretrained(directory)
                return
            with torch.no_grad():
                weights = self.generation_weights()
                adapter = lora_adapters.adapter_state(self.model) if self.lora else {}
                if self._sharded is not None:
                    adapter = self._sharded.full_weights(adapter)
            if self._sharded is None or self._sharded.rank == 0:
                self.base_model.save_pretrained(directory, state_dict=weights)
                if self.lora:
                    lora_adapters.save_adapter(self.model, directory, adapter)

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, scheduler, version and torch RNG state (not the weights: those go through save_pretrained).
        Sharded, the optimizer's state is this rank's shards (DTensors)."""
        with self.lock:
            rng = {"torch": torch.get_rng_state(), **({"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_available() else {})}
            return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(), "version": self.version,
                    "rng": rng, **({"scaler": self.scaler.state_dict()} if self.scaler is not None else {})}

    def save_trainer_state(self, path: Path) -> None:
        """Write `state_dict()` to `path` (a checkpoint's trainer_state.pt). Sharded, every rank first writes its shards
        of the optimizer state beside it, and rank 0 writes `path`, naming them (training/sharded_state.py)."""
        with self.lock:
            state = self.state_dict()
            if self._sharded is not None:
                state["optimizer"] = sharded_state.save(self.optimizer, self.model, Path(path).parent, self._sharded)
            if self._sharded is None or self._sharded.rank == 0:
                torch.save(state, path)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.lock:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            apply_hyperparameters(self.cfg.train, self.optimizer, self.scheduler)
            if self.scaler is not None and "scaler" in state:
                self.scaler.load_state_dict(state["scaler"])
            self.version = int(state["version"])
            rng = state.get("rng", {})
            if "torch" in rng:
                torch.set_rng_state(rng["torch"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])

    def _lr_factor(self, step: int) -> float:
        return lr_factor(self.cfg.train, step)  # the scheduler's function (training/schedule.py)

    # ---------------------------------------------------------------------------------
    # The step

    def _train_step(self, groups: Sequence[Group]) -> dict[str, float]:
        if not groups:
            raise ValueError("train_step needs at least one group, got an empty batch")
        cfg_t, cfg_l = self.cfg.train, self.cfg.train.loss
        per_group = [sequences(g, mask_truncated=self.cfg.rollout.mask_truncated) for g in groups]
        rollouts = [r for g in groups for r in g.rollouts]

        minibatches = split_even(per_group, min(cfg_t.updates_per_batch, len(per_group)))  # each: its groups' sequences
        # The first update starts from the step's weights, so its pi_prox is its own detached pi_theta;
        # later updates need pi_prox of the weights as they were. Under adapter dropout pi_theta is one
        # dropout draw, so every update's pi_prox is computed (without dropout).
        own_prox = not self._adapter_dropout
        if cfg_l.objective == "decoupled":
            for update_groups in minibatches[1 if own_prox else 0 :]:
                self._fill_proximal([s for seqs in self._share(update_groups) for s in seqs if s.loss_tokens])

        lr = self.lr
        self._offpolicy = OffPolicyStats(self.cfg.rollout.trained_staleness_bound, clip_low=cfg_l.clip_low, clip_high=cfg_l.clip_high)
        stats = LossStats.zeros(self.device)
        losses: list[float] = []
        grad_norms: list[float] = []
        for index, update_groups in enumerate(minibatches):
            loss, grad_norm, update_stats = self._update(update_groups, first=index == 0 and own_prox)
            if loss is not None:
                losses.append(loss)
                grad_norms.append(grad_norm)
                stats = stats + update_stats
        self.scheduler.step()
        self.version += 1

        advantages = self.algorithm.advantage_values(rollouts)
        lengths = [len(r.completion.token_ids) for r in rollouts]
        adv_mean = sum(advantages) / len(advantages)
        adv_std = math.sqrt(sum((a - adv_mean) ** 2 for a in advantages) / len(advantages))
        metrics = {
            "loss": sum(losses) / len(losses) if losses else 0.0,
            "kl": stats.kl_mean,
            "clip_frac": stats.clip_frac,
            "is_ratio/mean": stats.is_ratio_mean,
            "is_ratio/max": stats.is_ratio_max,
            "entropy": stats.entropy_mean,
            "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
            "lr": lr,
            "advantage/mean": adv_mean,
            "advantage/std": adv_std,
            "completion/len_mean": sum(lengths) / len(lengths),
            "completion/len_max": float(max(lengths)),
            "completion/truncated_frac": sum(r.completion.truncated for r in rollouts) / len(rollouts),
        }
        metrics.update(self.algorithm.step_metrics(groups))
        return {**{key: float(metrics[key]) for key in (*TRAIN_KEYS, *self.algorithm.metric_keys)}, **self._offpolicy.metrics(
            None if self._parallel is None else self._parallel.gather_rows)}

    def _update(self, groups: list[list[TrainSequence]], *, first: bool) -> tuple[float | None, float, LossStats]:
        """One optimizer update over the sequences of `groups`; (None, 0, zeros) when they hold no loss token.

        Data-parallel, this rank trains its share of `groups`, and the normaliser, the loss and the
        statistics are those of all of them (training/data_parallel.py)."""
        cfg_t, cfg_l = self.cfg.train, self.cfg.train.loss
        stats = LossStats.zeros(self.device)
        active = [s for seqs in groups for s in seqs if s.loss_tokens]
        mine = [s for seqs in self._share(groups) for s in seqs if s.loss_tokens]
        # A rank without a sequence of this update still makes its one backward pass (zero loss) that sums the gradients.
        micro = self._micro_batches(mine) or [[]]
        world = 1 if self._parallel is None else self._parallel.world_size
        normalizer = update_normalizer(
            cfg_l.aggregation, [s.loss_tokens for s in active], max_new_tokens=self.cfg.generation.max_new_tokens,
            micro_batches=len(micro) * world,  # bnpo: TRL's accumulation steps; ranks are assumed to cut alike
        )
        micro += [[]] * self._missing_rounds(len(micro))
        self.optimizer.zero_grad(set_to_none=True)
        if normalizer == 0:
            # Nothing to learn from (e.g. every completion truncated and masked). With every
            # grad None, AdamW's step changes nothing (no decay, no moment update); it is
            # called so the LR scheduler sees the usual optimizer-then-scheduler order.
            self.optimizer.step()
            return None, 0.0, stats
        total = torch.zeros((), device=self.device)
        # Forward and backward alike under the dropout: gradient checkpointing replays the forward in the backward.
        with lora_adapters.adapter_dropout(self.model) if self._adapter_dropout else contextlib.nullcontext():
            for index, chunk in enumerate(micro):
                with self._gradient_sync(last=index == len(micro) - 1):
                    if not chunk:
                        self._backward_without_sequences()
                        continue
                    loss, micro_stats = self._micro_batch_loss(chunk, normalizer, first=first)
                    (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
                total = total + loss.detach()
                stats = stats + micro_stats
        if self._parallel is not None:
            total, stats = self._parallel.reduce(total, stats)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self._params, cfg_t.max_grad_norm)
        loss_value, norm_value = float(total), float(grad_norm)
        if self.scaler is not None and math.isfinite(loss_value) and not math.isfinite(norm_value):
            # float16 overflow: the scaler skips this update and lowers its scale (reported as grad_norm 0).
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            return loss_value, 0.0, stats
        if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(
                f"training step {self.version}: loss = {loss_value}, gradient norm = {norm_value}; the update was not "
                f"applied. Try a lower train.lr (now {cfg_t.lr:g}) or train.max_grad_norm (now {cfg_t.max_grad_norm:g}), "
                f"and check that the generator's log-probs are finite and taken at generation.temperature."
            )
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_value, norm_value, stats

    def _micro_batch_loss(self, chunk: list[TrainSequence], normalizer: int, *, first: bool) -> tuple[Tensor, LossStats]:
        """The loss (with grad, scaled by the update's `normalizer`) and statistics of one micro-batch."""
        cfg_l = self.cfg.train.loss
        batch = self._collate(chunk)
        logits = self._logits(self._training_model, batch)
        logp_new, entropy = self._policy_logprobs(logits, batch)
        del logits
        logp_prox = None
        if cfg_l.objective == "decoupled":  # `first`: pi_prox is this very forward's (no dropout: see _train_step)
            logp_prox = logp_new.detach() if first else batch.logp_prox
        logp_start = logp_new.detach() if first else logp_prox  # pi of the step-start weights (None: not known here)
        if logp_start is not None:
            self._offpolicy.observe(logp_start, batch.logp_gen, batch.advantages, batch.mask, batch.staleness)
        logp_ref = None
        if cfg_l.kl_coef > 0:
            with torch.no_grad(), self._reference_model() as reference:
                ref_logits = self._logits(reference, batch)
                logp_ref, _ = token_logprobs(ref_logits, batch.scored_targets, self.cfg.generation.temperature, with_entropy=False)
                logp_ref = batch.to_grid(logp_ref)
                del ref_logits
        return grpo_loss(
            logp_new,
            batch.logp_gen,
            batch.advantages,
            batch.mask,
            normalizer,
            loss=cfg_l,
            logp_prox=logp_prox,
            logp_ref=logp_ref,
            staleness=batch.staleness,
            entropy=entropy,
            plugin=self._loss_plugin,
        )

    # ---------------------------------------------------------------------------------
    # Data parallelism (training/data_parallel.py); each is the identity in a single process

    @property
    def _training_model(self) -> torch.nn.Module:
        """What the loss's forward runs through: the DDP wrapper when data-parallel (its backward sums the gradients)."""
        return self.model if self._parallel is None else self._parallel.module

    def _share(self, groups: list[list[TrainSequence]]) -> list[list[TrainSequence]]:
        return groups if self._parallel is None else self._parallel.share(groups)

    def _missing_rounds(self, count: int) -> int:
        """The forward passes this rank adds to its `count` so that it makes as many as every rank (FSDP all-gathers in each)."""
        return 0 if self._parallel is None else self._parallel.rounds(count) - count

    def _gradient_sync(self, *, last: bool) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if self._parallel is None else self._parallel.sync(last=last)

    def _backward_without_sequences(self) -> None:
        """A zero-loss forward and backward over one pad token: this rank's part of the gradient sum when it has no
        sequence in an update (every rank must make the same collectives). Adds exactly 0 to every gradient. With the KL
        term it makes the KL reference's forward too, in a micro-batch's order (sharded, that forward all-gathers)."""
        batch = self._collate([filler(self.pad_id)])
        logits = self._logits(self._training_model, batch)
        if self.cfg.train.loss.kl_coef > 0:
            with torch.no_grad(), self._reference_model() as reference:
                self._logits(reference, batch)
        (logits.sum() * 0.0).backward()

    # ---------------------------------------------------------------------------------
    # Helpers

    def _micro_batches(self, seqs: list[TrainSequence]) -> list[list[TrainSequence]]:
        """`seqs` cut into micro-batches: packed by `train.micro_batch_tokens`, else by length into `micro_batch_size`."""
        budget = self.cfg.train.micro_batch_tokens
        if budget is not None:
            return packing.pack_sequences(seqs, budget)
        return list(chunks(by_length(seqs), self.cfg.train.micro_batch_size))

    def _collate(self, seqs: list[TrainSequence]) -> MicroBatch:
        lay_out = collate if self.cfg.train.micro_batch_tokens is None else packing.collate_packed
        return lay_out(seqs, pad_id=self.pad_id, version=self.version, device=self.device, algorithm=self.algorithm)

    @contextlib.contextmanager
    def _reference_model(self) -> Iterator[torch.nn.Module]:
        """The KL reference for a forward pass: the frozen copy, or (LoRA) the model with its adapters switched off."""
        if self.reference is not None:
            yield self.reference
        else:
            with lora_adapters.adapters_off(self.model):
                yield self.model

    def _logits(self, model: torch.nn.Module, batch: MicroBatch) -> Tensor:
        """Logits at the positions that predict the completion tokens: `[B, C, V]` padded, `[1, K, V]` packed."""
        kwargs: dict[str, Any] = {**batch.model_inputs(), "use_cache": False}
        if self._keeps_logits:
            kwargs["logits_to_keep"] = batch.logits_to_keep
        with autocast(self._device, self.cfg.train.precision):
            logits = model(**kwargs).logits
        return batch.kept(logits)

    def _policy_logprobs(self, logits: Tensor, batch: MicroBatch, *, with_entropy: bool = True) -> tuple[Tensor, Tensor | None]:
        """log pi_theta of the completion tokens under the sampling distribution (`self.processing`: repetition penalty,
        temperature, and renormalised over the support top-k / top-p / min-p keep of these logits; sampling.py), and
        the entropy, both as the completion grid `[B, C]`."""
        seen = batch.seen(logits.shape[-1]) if self.processing.penalises else None
        logp, entropy = sampled_logprobs(logits, batch.scored_targets, self.processing, seen=seen, with_entropy=with_entropy)
        return batch.to_grid(logp), (None if entropy is None else batch.to_grid(entropy))

    def _fill_proximal(self, seqs: list[TrainSequence]) -> None:
        """pi_prox of the current weights for each sequence (no grad), stored per sequence."""
        batches = self._micro_batches([s for s in seqs if s.completion_ids])
        with torch.no_grad():
            for chunk in batches + [[filler(self.pad_id)]] * self._missing_rounds(len(batches)):  # fillers: not stored
                batch = self._collate(chunk)
                logp, _ = self._policy_logprobs(self._logits(self.model, batch), batch, with_entropy=False)
                for row, s in enumerate(chunk):
                    s.logp_prox = logp[row, : len(s.completion_ids)].detach().clone()
