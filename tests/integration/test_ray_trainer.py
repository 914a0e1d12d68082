"""`RayTrainer` on a local Ray cluster (2 CPUs, one per module): 2 data-parallel ranks make the step one process
makes on the same batch (loss, metrics, updated weights) and publish rank 0's weights by reference, which a
generator actor installs with the usual version protocol; a rank killed between steps fails the next step naming
it, with every rank stopped; so does a rank that hangs while the weights are gathered outside a step (a start's cold sync).

Tolerance of the comparison: the ranks compute the same sums as one process, grouped differently (each rank adds
its sequences' gradients, then the two partial sums are added; the micro-batches, and so the padded shapes of
the matrix products, differ too). In float32 that changes the last bits of the loss, the gradient norm and the
statistics: they must agree to 1e-5 relative (float32 resolves ~6e-8). `grad_norm` is the direct check of the
gradients' scale: averaged instead of summed over the ranks, it would be half, while AdamW's update is nearly
blind to a gradient's scale. The weights are compared after the step's three AdamW updates (each moves a weight
by up to lr = 1e-2): AdamW divides each gradient by its own running magnitude, which turns the last-bit
differences of nearly-cancelling gradients into visible differences of the update. So the bound on the weights
is the one process's own float32 noise, measured in the test: how far its weights move when only its
micro-batch size changes (3 -> 1; 3.0e-4 on this batch). The two ranks stay within it (5.8e-5 measured).
"""

from __future__ import annotations

import asyncio
import copy
import os
import signal

import pytest
import torch

from asyncgrpo.config import load_config
from asyncgrpo.errors import TrainerRankError
from asyncgrpo.generation.local import LocalEngine
from asyncgrpo.generation.ray_pool import RayGenerator
from asyncgrpo.generation.ray_weights import StoredWeights
from asyncgrpo.metric_names import TRAIN_KEYS, offpolicy_keys
from asyncgrpo.models.loading import load_model_and_tokenizer
from asyncgrpo.training.checkpoint import load_checkpoint, save_checkpoint
from asyncgrpo.training.ray_trainer import RayTrainer
from asyncgrpo.training.trainer import TorchTrainer
from asyncgrpo.types import GenerationRequest, SamplingParams
from tests.bounded import run_bounded
from tests.component.test_trainer import TEMPERATURE, make_groups
from tests.integration.ray_cluster import local_cluster, processes_of, ray, still_running

pytestmark = pytest.mark.timeout(240)

LR = 1e-2


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(num_cpus=2) as temp_dir:
        yield temp_dir


def config(*overrides: str):
    # 4 groups in 3 updates (2, 1 and 1 groups): in the last two, rank 1 has no sequence and joins with a zero loss;
    # micro-batches of 3 sequences: the ranks make different numbers of forward passes per update.
    return load_config(None, ["model.path=builtin:tiny", f"generation.temperature={TEMPERATURE}", f"train.lr={LR}",
                              "train.updates_per_batch=3", "train.micro_batch_size=3", "train.device=cpu",
                              "rollout.group_size=4", "rollout.mask_truncated=true", *overrides])


def run(coro, timeout_s: float = 200.0):
    return run_bounded(coro, timeout_s)


@pytest.mark.parametrize(("loss", "sharding"), [
    ((), "ddp"),
    (("train.loss.objective=decoupled", "train.loss.normalization=sequence", "train.loss.kl_coef=0.1"), "ddp"),
    ((), "fsdp"),  # sharded: the ranks gather rank 0's weights for the generator (training/sharding.py)
], ids=["behaviour-token", "decoupled-sequence-kl", "fsdp"])
def test_two_ranks_make_the_single_process_step(cluster, loss, sharding):
    model, tokenizer = load_model_and_tokenizer("builtin:tiny", "float32", 0)
    groups = make_groups(model, 4, seed=5, truncated_every=3)
    single = TorchTrainer(copy.deepcopy(model), tokenizer, config(*loss))
    expected = single.train_step(groups)
    expected_weights = single.generation_weights()
    regrouped = TorchTrainer(copy.deepcopy(model), tokenizer, config(*loss, "train.micro_batch_size=1"))
    regrouped.train_step(groups)
    float32_noise = largest_difference(regrouped.generation_weights(), expected_weights)

    async def scenario():
        cfg = config(*loss, "runtime=ray", "train.world_size=2", f"train.sharding={sharding}", "ray.trainer.num_cpus=0.5", "ray.generators=1",
                     "ray.generator.num_cpus=0.5", "generation.backend_dead_after_s=60",
                     "ray.trainer.placement=PACK", "ray.generator.placement=SPREAD")  # each role in its placement group
        trainer = RayTrainer(cfg, tokenizer, checkpoint=None, version=0)
        generator = RayGenerator(cfg, copy.deepcopy(model), tokenizer)
        await trainer.start()
        await generator.start()
        try:
            assert live_placement_groups() == ["PACK", "SPREAD"]
            metrics = await asyncio.to_thread(trainer.train_step, groups)
            published = trainer.generation_weights()
            assert isinstance(published, StoredWeights)
            await generator.load_weights(published, trainer.version)  # the actor reads them from the store ...
            assert published._fetched is None  # ... and this process never held them
            served = [await generator.generate(greedy(i, tokenizer)) for i in range(3)]
            return metrics, await asyncio.to_thread(dict, published), trainer.version, served
        finally:
            await generator.aclose()
            await trainer.aclose()

    metrics, weights, version, served = run(scenario())
    assert live_placement_groups() == []
    assert version == 1 and set(metrics) == {*TRAIN_KEYS, *offpolicy_keys(1)}
    assert metrics["loss"] != 0.0
    for key in TRAIN_KEYS:
        assert metrics[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-9), key
    assert weights.keys() == expected_weights.keys()
    assert 0 < float32_noise < LR / 10
    assert largest_difference(weights, expected_weights) <= float32_noise

    async def reference():  # rank 0's weights in an in-process engine: the generator actor served exactly them
        engine = LocalEngine(copy.deepcopy(model).requires_grad_(False), tokenizer)
        await engine.start()
        try:
            await engine.load_weights(weights, 1)
            return [await engine.generate(greedy(i, tokenizer)) for i in range(3)]
        finally:
            await engine.aclose()

    assert all(set(c.versions) == {1} for c in served)
    assert [c.token_ids for c in served] == [c.token_ids for c in run(reference())]


def live_placement_groups() -> list[str]:
    """The strategies of the cluster's placement groups not removed."""
    return sorted(group["strategy"] for group in ray.util.placement_group_table().values() if group["state"] != "REMOVED")


def greedy(index: int, tokenizer) -> GenerationRequest:
    ids = tuple(tokenizer(f"say {'abc'[index]}: ")["input_ids"])
    return GenerationRequest(f"r{index}", index, ids, SamplingParams(max_new_tokens=8, temperature=0.0), seed=index)


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[name] - b[name]).abs().max()) for name in a)


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_rank_0_writes_the_checkpoint_and_a_killed_rank_fails_the_next_step_naming_it_and_every_rank_is_stopped(
        cluster, tmp_path, monkeypatch, sharding):
    """Rank 0 writes a checkpoint's weights and optimizer state itself (sharded: each rank its shards of the optimizer
    state, training/sharded_state.py): this process never saves a tensor (torch.save refuses here), and one process
    resumes the checkpoint with the ranks' version and AdamW state; so do two new ranks (sharded: each reads its own
    shards), whose next step is the one process's next step."""
    model, tokenizer = load_model_and_tokenizer("builtin:tiny", "float32", 0)
    groups = make_groups(model, 2, seed=1)
    resumed = TorchTrainer(copy.deepcopy(model), tokenizer, config())
    cfg = config("runtime=ray", "train.world_size=2", f"train.sharding={sharding}", "ray.trainer.num_cpus=1", "ray.trainer_timeout_s=60")

    def refused(*args, **kwargs):
        raise AssertionError("the driver wrote a checkpoint's tensors")

    async def scenario():
        trainer = RayTrainer(cfg, tokenizer, checkpoint=None, version=0)
        await trainer.start()
        try:
            await asyncio.to_thread(trainer.train_step, groups)
            assert await asyncio.to_thread(trainer.peak_memory_bytes) == [None, None]  # CPU ranks: no GPU peak
            with monkeypatch.context() as driver:
                driver.setattr(torch, "save", refused)
                checkpoint = await asyncio.to_thread(save_checkpoint, tmp_path, 1, trainer, "", {})
            assert (checkpoint / "optimizer" / "manifest.json").is_file() == (sharding == "fsdp")
            load_checkpoint(checkpoint, resumed)
            assert resumed.version == 1 and len(resumed.optimizer.state) == len(list(model.parameters()))
            assert all(int(s["step"]) > 0 for s in resumed.optimizer.state.values())
            pids = trainer.rank_pids
            ranks = {pid for pid, cmd in processes_of(cluster).items() if cmd.startswith("ray::TrainerRank")}
            assert set(pids) == ranks and len(ranks) == 2
            os.kill(pids[1], signal.SIGKILL)
            with pytest.raises(TrainerRankError) as failed:
                await asyncio.to_thread(trainer.train_step, groups)
            with pytest.raises(TrainerRankError):  # lost for good: no checkpoint from half a trainer, and no disk blamed
                save_checkpoint(tmp_path, 1, trainer, "", {})
            return str(failed.value), trainer.version, pids, checkpoint
        finally:
            await trainer.aclose()

    message, version, pids, checkpoint = run(scenario())
    assert f"trainer rank 1 of 2 (pid {pids[1]} on " in message and "died" in message and "during training step 1" in message
    assert "rank 0" not in message and "resumes from the newest checkpoint" in message and "\n" not in message
    assert version == 1
    assert not still_running(pids), "a rank outlived the failure"

    async def resume():
        again = RayTrainer(cfg, tokenizer, checkpoint=checkpoint, version=1)
        await again.start()
        try:
            return await asyncio.to_thread(again.train_step, groups)
        finally:
            await again.aclose()

    metrics, expected = run(resume()), resumed.train_step(groups)
    for key in ("loss", "grad_norm"):  # the later updates' losses and gradients depend on the resumed AdamW moments
        assert metrics[key] == pytest.approx(expected[key], rel=1e-5), key


def test_a_rank_that_hangs_while_the_weights_are_gathered_outside_a_step_is_named_in_bounded_time(cluster):
    """A start's cold sync asks for the weights at a version no step published: the ranks are asked as a step asks
    them (bounded by ray.trainer_timeout_s, the rank responsible named, every rank stopped), not left to a generator's
    fetch from the store. Rank 0 answers for the weights, and is stopped (SIGSTOP: alive, silent). A rank that dies
    there takes the same path (`_call`), as a rank killed between steps does (the test above)."""
    _, tokenizer = load_model_and_tokenizer("builtin:tiny", "float32", 0)
    cfg = config("runtime=ray", "train.world_size=2", "ray.trainer.num_cpus=1", "ray.trainer_timeout_s=3")

    async def scenario():
        trainer = RayTrainer(cfg, tokenizer, checkpoint=None, version=0)
        await trainer.start()
        try:
            pids = trainer.rank_pids
            os.kill(pids[0], signal.SIGSTOP)
            with pytest.raises(TrainerRankError) as failed:
                await asyncio.to_thread(trainer.generation_weights)
            return str(failed.value), pids
        finally:
            await trainer.aclose()

    message, pids = run(scenario(), timeout_s=90)
    assert f"trainer rank 0 of 2 (pid {pids[0]} on " in message, message
    assert "did not answer within ray.trainer_timeout_s = 3 s" in message
    assert "rank 1" not in message and "during gathering the weights of version 0" in message
    assert "resumes from the newest checkpoint" in message and "\n" not in message
    assert not still_running(pids), "a rank outlived the failure"


@pytest.mark.parametrize(("asked", "said"), [
    (["ray.trainer.num_cpus=4"],  # more CPUs than the cluster has
     ["trainer rank 0 of 2 (not started) did not answer within ray.startup_timeout_s = 3 s", "ray.trainer.num_cpus = 4"]),
    (["ray.trainer.num_cpus=0.5", "ray.trainer.placement=STRICT_SPREAD"],  # two nodes asked of a one-node cluster
     ["placement group within ray.startup_timeout_s = 3 s", "ray.trainer.placement = STRICT_SPREAD: 2 bundles of {'CPU': 0.5}"]),
])
def test_ranks_the_cluster_cannot_place_fail_the_start_in_bounded_time_naming_what_they_ask(cluster, asked, said):
    _, tokenizer = load_model_and_tokenizer("builtin:tiny", "float32", 0)
    cfg = config("runtime=ray", "train.world_size=2", *asked, "ray.startup_timeout_s=3")

    async def scenario():
        trainer = RayTrainer(cfg, tokenizer, checkpoint=None, version=0)
        with pytest.raises(TrainerRankError) as failed:
            await trainer.start()
        return str(failed.value)

    message = run(scenario(), timeout_s=60)
    assert all(fragment in message for fragment in said), message


def test_a_run_with_ranks_holds_no_trainer_in_its_driver_and_its_generators_start_from_the_checkpoint(tmp_path, monkeypatch):
    """train.world_size > 1: the driver builds no `TorchTrainer` (no float32 weights, KL reference or optimizer state:
    the ranks hold them); it resumes the run's records from the checkpoint, at its version, and the generators' first
    copy holds the checkpoint's weights in model.dtype (read as the ranks read them). No Ray is started."""
    from safetensors.torch import load_file

    from asyncgrpo.commands.train import Stop, TrainingRun, train
    from asyncgrpo.rundir import claim
    from asyncgrpo.training.resume import plan_resume

    recipe = ["model.path=builtin:tiny", f"run.output_dir={tmp_path}", "run.name=run", "train.max_steps=2",
              "rollout.groups_per_step=2", "rollout.group_size=2", "eval.every_steps=0", "logging.progress=false",
              "model.dtype=bfloat16"]
    run(train(load_config(None, recipe)))  # one process: a checkpoint at step 2
    cfg = load_config(None, [*recipe, "train.max_steps=4", "runtime=ray", "train.world_size=2"])

    def refused(*args, **kwargs):
        raise AssertionError("the driver built a TorchTrainer")

    monkeypatch.setattr(TorchTrainer, "__init__", refused)
    with claim(cfg.run.directory) as run_dir:
        plan = plan_resume(cfg)
        prepared = TrainingRun.prepare(cfg, plan, run_dir, Stop())
        try:
            assert isinstance(prepared.trainer, RayTrainer) and prepared.ranks is prepared.trainer
            assert prepared.trainer.version == 2 and prepared.trainer.checkpoint == plan.checkpoint
            served = prepared.engine._model.state_dict()
            saved = load_file(str(plan.checkpoint / "model.safetensors"))
            assert all(served[name].dtype == torch.bfloat16 and torch.equal(served[name], saved[name].to(torch.bfloat16))
                       for name in saved)
        finally:
            run(prepared._close_parts())
            for record in prepared._records():
                record.close()
