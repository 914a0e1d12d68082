"""`RayTrainer`: a data-parallel trainer of `train.world_size` ranks, each a Ray actor (`runtime: ray`).

Job: start the ranks, join them into one `torch.distributed` process group (gloo on CPU, NCCL on
GPU) and present them to the run as the in-process `TorchTrainer` is presented: `train_step`
(blocking; the run calls it on its trainer thread), `version`, `generation_weights()`, and what
`save_checkpoint` calls (`lock`, `save_pretrained`, `save_trainer_state`, `cfg`, `tokenizer`).

Design and invariants:
- **Ranks.** Each rank builds its `TorchTrainer` as a single-process run does: from `model.path`
  (seeded by `run.seed`), then, on resume, from the checkpoint (so the KL reference and LoRA's base
  weights are the initial model's; sharded, each rank reads its own shards of the optimizer state once
  it joined, training/sharded_state.py). The run directory must be visible to every rank's node. The
  driver builds no trainer of its own (commands/train.py): the ranks are the only holders of the
  float32 weights, the KL reference and the optimizer state.
- **A step.** Every rank gets the whole batch (one object in the store) and trains its share of
  each update; the normaliser is the whole update's and the gradients are summed over the ranks
  (training/data_parallel.py). So a step equals the single-process step on the same batch, and
  the ranks' weights stay identical. Rank 0 answers for all: its metrics, its weights.
- **Weights.** `generation_weights()` returns a `StoredWeights`: the reference of rank 0's
  weights in the object store, which the generator actors read themselves (the driver never
  holds them). They are always in the store before it returns, stored by the driver's own
  reference, so a rank that dies before they exist fails a trainer call and is named, never a
  generator's weight install: a step whose version is due to be published returns them with its
  metrics (a second return of rank 0's task; then `generation_weights()` returns at once); at any
  other version (a start's cold sync) `generation_weights()` asks for them through the same
  bounded, naming call as a step (every rank when sharded: the gather is a collective). The
  version protocol is unchanged: version = steps trained.
- **Checkpoints.** Rank 0 writes the weights (`save_pretrained`) and the optimizer, scheduler and
  RNG state (`save_trainer_state`) into the checkpoint's temporary directory in the run directory
  itself: neither goes through the object store or the driver, which writes the rest
  (training/checkpoint.py: the tokenizer, config, records and state.json; the same layout).
- **Sharded** (`train.sharding: fsdp`, training/sharding.py): rank 0 answers with (or writes) the
  full weights as before, gathered from every rank's shards; so every rank is called for them (a
  gather is a collective) and only rank 0's answer is kept. The optimizer state is not gathered: each
  rank writes its shards into the checkpoint directory, which every rank must see (on several nodes:
  a shared file system), and rank 0 their manifest (training/sharded_state.py). A run resumes the
  checkpoint at any world size, sharded or not.
- **Faults.** Ranks are not restarted (a new process cannot rejoin the group mid-run). Every wait
  on a rank is bounded: `ray.startup_timeout_s` for the start, `ray.trainer_timeout_s` for any
  later call. When a rank dies, raises or does not answer in time, every rank is killed (the others
  would wait in a collective for it) and the call raises `TrainerRankError`, one paragraph naming
  the rank; from then on the trainer is `lost` and writes no checkpoint: the run resumes from its
  newest one. Which rank to name: the others are given `_FAILURE_GRACE_S` to report, and a rank
  whose process died is named before ranks whose collectives failed because of it.
- **Lifecycle.** `start()` connects to Ray (ray_cluster.py; it owns the local cluster when it
  connects first, so it is also the last to let go), reserves the ranks' placement group when
  `ray.trainer.placement` asks for one (ray_placement.py) and places the ranks; `aclose()` kills them
  and disconnects (bounded, idempotent).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from asyncgrpo.config import Config
from asyncgrpo.errors import TrainerRankError
from asyncgrpo.generation.ray_cluster import RayCluster, import_ray
from asyncgrpo.generation.ray_placement import RolePlacement
from asyncgrpo.generation.ray_weights import StoredWeights
from asyncgrpo.threads import run_in_daemon_thread
from asyncgrpo.types import Group

log = logging.getLogger("asyncgrpo")

_FAILURE_GRACE_S = 10.0  # after one rank failed, how long the others may take to report (a dead process is seen in < 1 s)
_KILL_TIMEOUT_S = 10.0


class TrainerRank:
    """One rank's body (a Ray actor, one task at a time): a `TorchTrainer` that joins the process group."""

    def __init__(self, cfg: Config, rank: int, world_size: int, checkpoint: str | None) -> None:
        import torch
        from transformers.utils import logging as hf_logging

        from asyncgrpo.models.loading import load_model_and_tokenizer
        from asyncgrpo.training.checkpoint import load_checkpoint
        from asyncgrpo.training.trainer import TorchTrainer

        hf_logging.disable_progress_bar()  # Ray forwards a rank's output to the run's console: no bars from checkpoint writes
        torch.manual_seed(cfg.run.seed)
        model, tokenizer = load_model_and_tokenizer(cfg.model.path, "float32", cfg.run.seed)
        self.trainer = TorchTrainer(model, tokenizer, cfg)
        self.sharded, self.checkpoint = cfg.train.sharding == "fsdp", checkpoint
        if checkpoint is not None:  # sharded: the optimizer's shards are read once the rank joined (`join`)
            load_checkpoint(Path(checkpoint), self.trainer, shards_after_join=self.sharded)
        self.rank, self.world_size, self.timeout_s = rank, world_size, cfg.ray.trainer_timeout_s

    def rendezvous(self) -> str:
        """Rank 0: the address of the process group's store, on this node at a free port."""
        ray = import_ray()
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def join(self, address: str) -> tuple[int, int, str]:
        """Join the process group at `address` (every rank at once) and wrap the model in DDP (or shard it: FSDP2). Returns
        (version, pid, node address) for the driver's messages."""
        import torch
        import torch.distributed as dist

        device = self.trainer.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=address, rank=self.rank,
                                world_size=self.world_size, timeout=timedelta(seconds=self.timeout_s))
        self.trainer.join_data_parallel(self.rank, self.world_size)
        if self.sharded and self.checkpoint is not None:  # each rank reads only its shards (every rank together)
            from asyncgrpo.training.sharded_state import read_shards

            read_shards(Path(self.checkpoint), self.trainer.optimizer, self.trainer.model)
        return self.trainer.version, os.getpid(), import_ray().util.get_node_ip_address()

    def train_step(self, groups: list[Group], with_weights: bool) -> tuple[dict[str, float], dict[str, Any] | None]:
        """The step's metrics and (`with_weights`) the weights after it: two returns, so the weights stay in the store.
        Sharded, every rank is asked for the weights (they are gathered) and rank 0 returns them."""
        metrics = self.trainer.train_step(groups)
        weights = self.trainer.generation_weights() if with_weights else None
        return metrics, weights if self.rank == 0 else None

    def generation_weights(self) -> tuple[int, dict[str, Any] | None]:
        """This rank's version (the driver waits on it) and (rank 0) its weights: two returns, so the weights stay in the
        store. Sharded, every rank must be called (the weights are gathered from the shards)."""
        weights = self.trainer.generation_weights()
        return self.trainer.version, weights if self.rank == 0 else None

    def peak_memory_bytes(self) -> int | None:
        """torch.cuda.max_memory_allocated of this rank's device since it started; None on a CPU rank."""
        import torch

        device = self.trainer.device
        return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None

    def save_pretrained(self, directory: str) -> None:
        self.trainer.save_pretrained(directory)

    def save_trainer_state(self, path: str) -> None:
        """Rank 0 writes the optimizer, scheduler, version and RNG state to `path`; sharded, every rank is called and
        writes its shards of the optimizer state beside it (training/sharded_state.py), then rank 0 writes `path`."""
        self.trainer.save_trainer_state(Path(path))


@dataclass(eq=False)
class _Rank:
    index: int
    handle: Any
    pid: int | None = None  # known once joined
    node: str = ""

    def describe(self, world_size: int) -> str:
        where = f"pid {self.pid} on {self.node}" if self.pid is not None else "not started"
        return f"trainer rank {self.index} of {world_size} ({where})"


class RayTrainer:
    """`train.world_size` ranks on Ray behind the trainer interface; see the module docstring.

    `tokenizer` is the run's (saved with checkpoints); `checkpoint` the one to resume from (None:
    a fresh start); `version` that checkpoint's version (0 for a fresh start)."""

    def __init__(self, cfg: Config, tokenizer: Any, *, checkpoint: Path | None, version: int) -> None:
        if cfg.train.sharding == "fsdp":
            from asyncgrpo.training.sharding import check_torch_supports_fsdp

            check_torch_supports_fsdp()  # before a cluster or a rank starts
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.version = version
        self.lock = threading.RLock()  # held by each call, so a checkpoint's parts come from one moment
        self.lost: str | None = None  # the paragraph of the failure that stopped every rank
        self.checkpoint = checkpoint
        self._cluster = RayCluster(cfg.ray, timeout_s=cfg.run.shutdown_timeout_s)
        self._placement = RolePlacement(cfg.ray.trainer, cfg.train.world_size, key="ray.trainer")
        self._ranks: list[_Rank] = []
        self._weights: tuple[int, Any] = (-1, None)  # (version, reference) of the weights rank 0 put into the store

    @property
    def world_size(self) -> int:
        return self.cfg.train.world_size

    @property
    def rank_pids(self) -> list[int | None]:
        """The ranks' process ids, in rank order (None before a rank joined)."""
        return [r.pid for r in self._ranks]

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Connect to Ray, place the ranks and join them into one process group, within ray.startup_timeout_s."""
        await self._cluster.connect()
        ray = import_ray()
        rc = self.cfg.ray
        actor_class = ray.remote(TrainerRank)
        checkpoint = str(self.checkpoint) if self.checkpoint is not None else None
        try:
            try:
                await self._placement.reserve(rc.startup_timeout_s)
            except TimeoutError:
                raise TrainerRankError(
                    f"the cluster could not hold the trainer ranks' placement group within ray.startup_timeout_s = "
                    f"{rc.startup_timeout_s:g} s ({self._placement.describe()}; free: {ray.available_resources()}). Fix: "
                    f"another ray.trainer.placement, fewer or smaller ranks, or more nodes.") from None
            for i in range(self.world_size):
                remote = actor_class.options(num_cpus=rc.trainer.num_cpus, num_gpus=rc.trainer.num_gpus, max_restarts=0,
                                             max_task_retries=0, **self._placement.options(i))
                self._ranks.append(_Rank(i, remote.remote(self.cfg, i, self.world_size, checkpoint)))
            await run_in_daemon_thread(self._join, name="asyncgrpo-ray-trainer-start")
        except BaseException:
            await self.aclose()
            raise
        log.info("trainer ranks: %s", "; ".join(rank.describe(self.world_size) for rank in self._ranks))

    def _join(self) -> None:
        rc = self.cfg.ray
        deadline = time.monotonic() + rc.startup_timeout_s
        what = (f"starting (placed with ray.trainer.num_cpus = {rc.trainer.num_cpus:g} and num_gpus = {rc.trainer.num_gpus:g}, "
                f"loading model.path, joining the process group)")
        setting = f"ray.startup_timeout_s = {rc.startup_timeout_s:g} s"
        [address] = self._gather([self._ranks[0]], lambda r: r.handle.rendezvous.remote(), what, deadline, setting)
        joined = self._gather(self._ranks, lambda r: r.handle.join.remote(address), what, deadline, setting)
        for rank, (version, pid, node) in zip(self._ranks, joined, strict=True):
            rank.pid, rank.node = pid, node
            if version != self.version:
                raise TrainerRankError(f"{rank.describe(self.world_size)} loaded version {version}, the run expects {self.version}: "
                                       f"the checkpoint {self.checkpoint} changed while the run started. Run the command again.")

    async def aclose(self) -> None:
        """Kill the ranks and let go of Ray. Bounded and idempotent."""
        ranks, self._ranks = self._ranks, []
        try:
            if ranks:
                async with asyncio.timeout(_KILL_TIMEOUT_S):
                    await run_in_daemon_thread(lambda: self._kill(ranks), name="asyncgrpo-ray-trainer-kill")
        except TimeoutError:
            raise TrainerRankError(f"killing the trainer ranks did not return within {_KILL_TIMEOUT_S:g} s; they may be left "
                                   f"running on the cluster (`ray list actors` shows them).") from None
        finally:
            await self._placement.release()
            await self._cluster.disconnect()

    @staticmethod
    def _kill(ranks: list[_Rank]) -> None:
        ray = import_ray()
        for rank in ranks:
            ray.kill(rank.handle, no_restart=True)

    # ------------------------------------------------------------------ the trainer interface

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        """One step on every rank (blocking, bounded by ray.trainer_timeout_s); rank 0's metrics. When the new version
        is due to be published (generation.weight_sync_every), rank 0 also puts its weights into the store."""
        ray = import_ray()
        with self.lock:
            batch = ray.put(list(groups))
            publish = (self.version + 1) % self.cfg.generation.weight_sync_every == 0
            weights: list[Any] = []

            def submit(rank: _Rank) -> Any:
                with_weights = publish and (rank.index == 0 or self._sharded)
                metrics_ref, weights_ref = rank.handle.train_step.options(num_returns=2).remote(batch, with_weights)
                if rank.index == 0:
                    weights.append(weights_ref)
                return metrics_ref

            metrics = self._call(self._ranks, submit, f"training step {self.version}")
            if publish:  # before the version: `generation_weights` reads both without the lock
                self._weights = (self.version + 1, weights[0])
            self.version += 1
            return metrics[0]

    def generation_weights(self) -> StoredWeights:
        """Rank 0's weights, by reference (the generators read them from the object store). After a step due to be
        published they are already there and this returns at once (they came with the step, so a rank's death shows
        there). At any other version (a start's cold sync) the ranks are asked as a step asks them: blocking (call it
        off the event loop), bounded by ray.trainer_timeout_s, a rank that dies, raises or hangs named; the weights
        are in the store when it returns."""
        self._raise_if_lost()
        version, ref = self._weights
        if version == self.version:  # the step's own: no lock, so a checkpoint being written never blocks it
            return StoredWeights(ref, timeout_s=self.cfg.ray.trainer_timeout_s)
        with self.lock:
            if self._weights[0] != self.version:
                self._weights = (self.version, self._gather_weights())
            return StoredWeights(self._weights[1], timeout_s=self.cfg.ray.trainer_timeout_s)

    def _gather_weights(self) -> Any:
        """The reference of rank 0's weights at the current version, put into the store by the ranks that answer for them
        (rank 0; sharded, every rank: the gather is a collective)."""
        stored: list[Any] = []

        def submit(rank: _Rank) -> Any:
            version_ref, weights_ref = rank.handle.generation_weights.options(num_returns=2).remote()
            if rank.index == 0:
                stored.append(weights_ref)
            return version_ref

        self._call(self._answering, submit, f"gathering the weights of version {self.version} for the generators")
        return stored[0]

    def save_pretrained(self, directory: Any) -> None:
        with self.lock:
            self._call(self._answering, lambda r: r.handle.save_pretrained.remote(str(directory)), "writing a checkpoint's weights")

    def save_trainer_state(self, path: Any) -> None:
        """Rank 0 writes the checkpoint's trainer state to `path` itself: the optimizer state never goes through the
        object store or this process."""
        with self.lock:
            self._call(self._answering, lambda r: r.handle.save_trainer_state.remote(str(path)), "writing a checkpoint's optimizer state")

    def peak_memory_bytes(self) -> list[int | None]:
        """Each rank's peak GPU memory (torch.cuda.max_memory_allocated; None on a CPU rank), in rank order; bounded
        and naming a failed rank as any call (bench/gpu_smoke.sh's per-rank column)."""
        with self.lock:
            return self._call(self._ranks, lambda r: r.handle.peak_memory_bytes.remote(), "reading its peak GPU memory")

    @property
    def _sharded(self) -> bool:
        return self.cfg.train.sharding == "fsdp"

    @property
    def _answering(self) -> list[_Rank]:
        """The ranks a call for the weights or the optimizer state goes to: rank 0, which answers; sharded, every rank."""
        return self._ranks if self._sharded else self._ranks[:1]

    # ------------------------------------------------------------------ waiting on ranks

    def _raise_if_lost(self) -> None:
        if self.lost is not None:
            raise TrainerRankError(self.lost)
        if not self._ranks:
            raise TrainerRankError("the data-parallel trainer is not started (or already closed): await start() first.")

    def _call(self, ranks: list[_Rank], submit: Any, what: str) -> list[Any]:
        self._raise_if_lost()
        timeout_s = self.cfg.ray.trainer_timeout_s
        return self._gather(ranks, submit, what, time.monotonic() + timeout_s, f"ray.trainer_timeout_s = {timeout_s:g} s")

    def _gather(self, ranks: list[_Rank], submit: Any, what: str, deadline: float, setting: str) -> list[Any]:
        """`submit(rank)` on each of `ranks`, and their results in order; on the first failure or at `deadline`
        (time.monotonic), every rank is stopped and TrainerRankError names the rank responsible."""
        ray = import_ray()
        refs = {submit(rank): rank for rank in ranks}
        results: dict[int, Any] = {}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = ", ".join(refs[ref].describe(self.world_size) for ref in pending)
                self._fail(f"{late} did not answer within {setting}", what)
            try:
                results[refs[ready[0]].index] = ray.get(ready[0])
            except ray.exceptions.RayError as exc:
                failures = {refs[ready[0]]: exc, **self._other_failures(refs, pending)}
                self._fail(self._blame(failures), what, cause=exc)
        return [results[rank.index] for rank in ranks]

    def _other_failures(self, refs: dict[Any, _Rank], pending: list[Any]) -> dict[_Rank, BaseException]:
        """The errors the other ranks report within the grace period (a rank that died is seen within a second)."""
        ray = import_ray()
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=_FAILURE_GRACE_S) if pending else ([], [])
        failures: dict[_Rank, BaseException] = {}
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as exc:
                failures[refs[ref]] = exc
        return failures

    def _blame(self, failures: dict[_Rank, BaseException]) -> str:
        """Name the ranks whose process died, else the first that raised, with what happened to it."""
        ray = import_ray()
        died = [rank for rank, exc in failures.items() if isinstance(exc, ray.exceptions.RayActorError)]
        if died:
            names = ", ".join(rank.describe(self.world_size) for rank in died)
            exc = failures[died[0]]
            return f"{names} died ({type(exc).__name__}: {_first_line(exc)})"
        rank, exc = next(iter(failures.items()))
        cause = getattr(exc, "cause", None) or exc  # a RayTaskError carries the rank's own exception
        return f"{rank.describe(self.world_size)} failed with {type(cause).__name__}: {_first_line(cause)}"

    def _fail(self, what_happened: str, what: str, *, cause: BaseException | None = None) -> None:
        self.lost = (
            f"{what_happened}, during {what}. A data-parallel trainer cannot go on without one of its ranks, so every "
            f"rank was stopped, and no checkpoint can be written after this. Fix: see why (Ray's worker logs: `ray logs`; "
            f"the kernel log for the OOM killer; ray.trainer.num_cpus/num_gpus for the resources), then run the same "
            f"command again: it resumes from the newest checkpoint (checkpoint.resume=auto)."
        )
        ranks, self._ranks = self._ranks, []
        self._kill(ranks)
        raise TrainerRankError(self.lost) from cause


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else "(no message)"
