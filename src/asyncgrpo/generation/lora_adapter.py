"""A LoRA adapter as it travels from the trainer to the generators (`generation.http.weight_sync: lora`).

Job: `with_adapter(merged, model)` is what a LoRA trainer's `generation_weights()` returns: the merged weights
(a plain mapping under the base model's names, what every generator loads) that also carry the adapter as
`PolicyWeights.adapter`; `write_adapter` writes an adapter in PEFT's `save_pretrained` layout
(``adapter_config.json`` + ``adapter_model.safetensors``), which vLLM's ``/v1/load_lora_adapter`` and
``PeftModel.from_pretrained`` read.

Invariants:
- The adapter's tensors are CPU copies taken when the weights were asked for (the trainer's own adapter
  parameters change at the next step); their names and config are exactly what peft's `save_pretrained` writes,
  so the files here and a checkpoint's adapter are interchangeable.
- Consumers that know nothing of adapters (the local engine, Ray generators, the full and delta publishers) see
  an ordinary mapping of the merged weights.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter: `tensors` under peft's saved names, `config` the JSON of its adapter_config.json."""

    tensors: Mapping[str, Any]
    config: Mapping[str, Any]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class PolicyWeights(dict):
    """The merged weights of a LoRA policy (a plain dict of them) carrying its adapter in `adapter`."""

    adapter: AdapterWeights | None = None


def with_adapter(merged: Mapping[str, Any], model: Any, adapter_name: str = "default") -> PolicyWeights:
    """`merged` as `PolicyWeights` carrying a copy of the adapter `adapter_name` of the peft model `model`."""
    from peft import get_peft_model_state_dict

    tensors = {name: t.detach().to("cpu", copy=True).contiguous()
               for name, t in get_peft_model_state_dict(model, adapter_name=adapter_name).items()}
    config = {key: sorted(value) if isinstance(value, set) else value
              for key, value in model.peft_config[adapter_name].to_dict().items()}
    out = PolicyWeights(merged)
    out.adapter = AdapterWeights(tensors, json.loads(json.dumps(config, default=str)))
    return out


def write_adapter(adapter: AdapterWeights, directory: Path) -> None:
    """Write `adapter` into the existing `directory` in peft's save_pretrained layout."""
    from safetensors.torch import save_file

    (directory / ADAPTER_CONFIG).write_text(json.dumps(dict(adapter.config), indent=2, sort_keys=True))
    save_file(dict(adapter.tensors), str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
