"""LoRA adapters through peft (`train.lora`, extra ``asyncgrpo[lora]``): wrap, merge for serving, save, load.

Job: everything the trainer and checkpoints need to know about adapters, so the rest of the
code sees plain state dicts under the base model's own parameter names.

Invariants:
- `wrap` freezes the base weights; only the adapters (float32) train. Their initial values depend only on
  `run.seed` (drawn from a generator seeded with it, the global RNG left as it was), not on what drew
  random numbers before: loading the model, building the KL reference, a Ray rank's own set-up.
- Adapter dropout (`train.lora.dropout`) applies only inside `adapter_dropout`: its dropout modules
  alone are put in train mode there (the model's own dropouts stay off), and back in eval mode on
  exit, so every other forward pass (pi_prox, the KL reference, evaluation) is deterministic.
- `merged_state` returns the base model's state-dict names and shapes (what a generator loaded
  from `model.path` expects): base weights as they are (no copy) and, for each adapted linear,
  W + (alpha / r) * B @ A computed fresh. The peft model is never merged in place, so the
  base weights are never perturbed by a merge/unmerge round trip. On a model sharded by FSDP2
  (training/sharding.py) the same code merges the shards (DTensors; every rank must call it).
- An embedding tied to the output layer (tie_word_embeddings, as in SmolLM2) is never adapted
  (ConfigError): a served or saved model has one matrix for both, so no merge could hold it.
- `save_adapter` (of `adapter_state`, gathered when sharded) / `load_adapter` use peft's own adapter layout (adapter_config.json,
  adapter_model.safetensors) in `ADAPTER_DIR` of a checkpoint; it loads with
  ``PeftModel.from_pretrained(base, path / ADAPTER_DIR)``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncgrpo.errors import ConfigError

if TYPE_CHECKING:
    import torch

ADAPTER_DIR = "adapter"
ADAPTER_NAME = "default"


def check_peft() -> None:
    """ConfigError unless peft is installed (preflight, before any model loads: imports neither peft nor torch)."""
    if importlib.util.find_spec("peft") is None:
        raise ConfigError(_no_peft("not installed"))


def _no_peft(why: str) -> str:
    return (f"train.lora is set, but peft cannot be imported ({why}). Fix: pip install 'asyncgrpo[lora]' (or pip install "
            f"peft), or remove train.lora to fine-tune every weight.")


def wrap(model: torch.nn.Module, lora: Any, seed: int) -> torch.nn.Module:
    """`model` with LoRA adapters of `lora` (a `LoraConfig` section) on its target modules, initialised from `seed`."""
    import torch

    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise ConfigError(_no_peft(str(exc))) from exc
    from peft.tuners.lora import LoraLayer

    targets = lora.target_modules
    tied = _tied_embeddings(model)
    try:
        config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
                            target_modules=targets if isinstance(targets, str) else list(targets))
        with warnings.catch_warnings():  # peft reads transformers' deprecated name; nothing a user can act on
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
            device = next(model.parameters()).device
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(seed)
                wrapped = get_peft_model(model, config)
    except ValueError as exc:
        raise ConfigError(
            f"train.lora.target_modules = {targets!r} does not fit this model ({exc}). Fix: name linear modules of the "
            f"model (e.g. [q_proj, k_proj, v_proj, o_proj]) or use all-linear."
        ) from exc
    if adapted := [name for name, module in base_model(wrapped).named_modules() if isinstance(module, LoraLayer) and name in tied]:
        raise ConfigError(
            f"train.lora.target_modules = {targets!r} adapts {', '.join(adapted)}, but this model ties its input and output "
            f"embeddings (one matrix, tie_word_embeddings): the merged weights the generators serve and checkpoints keep "
            f"cannot hold an adapter on only one of them, so they would not be the model being trained. Fix: leave "
            f"{' and '.join(sorted(tied))} out of train.lora.target_modules (all-linear does)."
        )
    return wrapped


def _tied_embeddings(model: Any) -> set[str]:
    """The names of the input and output embedding modules when they share one weight, else none."""
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if inputs is None or outputs is None or outputs.weight is not inputs.weight:
        return set()
    return {name for name, module in model.named_modules() if module is inputs or module is outputs}


def base_model(model: Any) -> Any:
    """The transformers model inside a peft wrapper (with the adapters attached)."""
    return model.get_base_model()


def adapters_off(model: Any) -> contextlib.AbstractContextManager[Any]:
    """While entered, `model` computes as its base model (the adapters contribute nothing): the KL reference."""
    return model.disable_adapter()


@contextlib.contextmanager
def adapter_dropout(model: Any) -> Iterator[None]:
    """While entered, the adapters' dropout applies (their dropout modules, and only those, are in train mode)."""
    from peft.tuners.lora import LoraLayer

    dropouts = [d for module in model.modules() if isinstance(module, LoraLayer) for d in module.lora_dropout.values()]
    for dropout in dropouts:
        dropout.train()
    try:
        yield
    finally:
        for dropout in dropouts:
            dropout.eval()


def merged_state(model: Any) -> dict[str, torch.Tensor]:
    """The weights a generator serves: base names, adapters merged into their linears (see the module docstring)."""
    import torch
    from peft.tuners.lora import LoraLayer

    base = base_model(model)
    merged: dict[str, torch.Tensor] = {}
    adapted: dict[str, Any] = {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    with torch.no_grad():
        for name, module in adapted.items():
            weight = module.get_base_layer().weight
            merged[f"{name}.weight"] = weight + module.get_delta_weight(ADAPTER_NAME).to(weight.dtype)
        for key, tensor in base.state_dict(keep_vars=True).items():
            if ".lora_" in key:
                continue
            plain = key.replace(".base_layer.", ".")
            merged.setdefault(plain, tensor.detach())
    return merged


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """The adapters' tensors under the peft model's own state-dict names (sharded: this rank's shards)."""
    return {name: tensor for name, tensor in model.state_dict().items() if ".lora_" in name}


def save_adapter(model: Any, directory: Path, state: dict[str, torch.Tensor]) -> None:
    """The adapter of `state` (`adapter_state`, gathered when sharded) in peft's layout in `directory` / ADAPTER_DIR."""
    model.save_pretrained(str(Path(directory) / ADAPTER_DIR), state_dict=state)


def load_adapter(model: torch.nn.Module, checkpoint: Path) -> None:
    """Load the adapter weights of `checkpoint` into `model` (same LoRA config); raise on any mismatch."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    file = Path(checkpoint) / ADAPTER_DIR / "adapter_model.safetensors"
    if not file.is_file():
        raise ConfigError(
            f"checkpoint {checkpoint} holds no LoRA adapter ({file} is missing): it was trained without train.lora. "
            f"Fix: resume it without train.lora, or start a LoRA run from its weights with model.path={checkpoint}."
        )
    result = set_peft_model_state_dict(model, load_file(str(file)), adapter_name=ADAPTER_NAME)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    missing = [k for k in (getattr(result, "missing_keys", []) or []) if ".lora_" in k]
    if unexpected or missing:
        raise ConfigError(
            f"the LoRA adapter of checkpoint {checkpoint} does not match train.lora: unexpected {unexpected[:3]}, "
            f"missing {missing[:3]}. Fix: resume with the train.lora settings the checkpoint was written with."
        )
