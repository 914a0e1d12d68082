"""`make_publisher`: the `WeightPublisher` that `generation.http.weight_sync` names, for `HttpGenerator`.

Job: map the config to a publisher: full -> `DiskWeightPublisher`, delta -> `DeltaWeightPublisher`,
lora -> `LoraWeightPublisher`, nccl -> `CollectiveWeightPublisher` (with generation.http.collective's settings and
generation.weight_sync_timeout_s as the transport's own bound). Invariant: every value the config accepts
maps to one publisher; the config's Literal refuses any other.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from asyncgrpo.config import GenerationConfig
from asyncgrpo.generation.collective_publisher import CollectiveWeightPublisher
from asyncgrpo.generation.delta_publisher import DeltaWeightPublisher
from asyncgrpo.generation.lora_publisher import LoraWeightPublisher
from asyncgrpo.generation.weight_sync import DiskWeightPublisher, WeightPublisher


def make_publisher(cfg: GenerationConfig, weights_dir: str | Path,
                   model_config: str | Path | Mapping[str, Any] | None) -> WeightPublisher:
    kind = cfg.http.weight_sync
    if kind == "delta":
        return DeltaWeightPublisher(weights_dir, model_config=model_config)
    if kind == "lora":
        return LoraWeightPublisher(weights_dir, model_config=model_config)
    if kind == "nccl":
        collective = cfg.http.collective
        return CollectiveWeightPublisher(weights_dir, model_config=model_config, host=collective.host,
                                         backend=collective.backend, on_failure=collective.on_failure,
                                         collective_timeout_s=cfg.weight_sync_timeout_s,
                                         chunk_bytes=max(1, int(collective.chunk_mib * 2**20)))
    return DiskWeightPublisher(weights_dir, model_config=model_config)
