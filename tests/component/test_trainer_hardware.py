"""The trainer on real hardware settings, on the CPU: device placement, mixed precision with float32
master weights, gradient checkpointing, LoRA (merged weights served and checkpointed), LR schedules,
and the engine's copy in the serving dtype."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from asyncgrpo.errors import ConfigError
from asyncgrpo.generation.serving_copy import serving_copy
from asyncgrpo.models.device import autocast, check_precision, resolve_device
from asyncgrpo.training.checkpoint import load_checkpoint, save_checkpoint
from asyncgrpo.training.integrity import checkpoint_problem
from asyncgrpo.training.trainer import TorchTrainer
from tests.component.test_trainer import TEMPERATURE, make_cfg, make_groups, weights
from tests.tiny_models import tiny_llama

pytestmark = pytest.mark.timeout(120)



def objective(model: torch.nn.Module, groups) -> float:
    """sum over rollouts of advantage * log pi(completion | prompt): what a GRPO step raises."""
    total = 0.0
    with torch.no_grad():
        for g in groups:
            for r in g.rollouts:
                ids = torch.tensor([list(g.prompt.token_ids) + list(r.completion.token_ids)])
                p = len(g.prompt.token_ids)
                logits = model(input_ids=ids).logits[0, p - 1 : -1].float() / TEMPERATURE
                logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.completion.token_ids)[:, None]).sum()
                total += r.advantage * float(logp)
    return total


def train_and_measure(train: dict, steps: int = 3):
    """Train a fresh tiny model for `steps` on fixed groups; return (trainer, objective before, objective after)."""
    model = tiny_llama(0)
    groups = make_groups(model, 3)
    before = objective(model, groups)
    trainer = TorchTrainer(model, None, make_cfg({"lr": 3e-3, **train}))
    for _ in range(steps):
        trainer.train_step(groups)
    return trainer, groups, before, objective(trainer.model, groups)


def test_mixed_precision_computes_in_bfloat16_and_keeps_float32_master_weights():
    model = tiny_llama(0).to(torch.bfloat16)  # as model.dtype: bfloat16 would load it
    groups = make_groups(tiny_llama(0), 2)
    seen: list[torch.dtype] = []
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    trainer = TorchTrainer(model, None, make_cfg({"precision": "bfloat16"}))
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    before = weights(trainer.model)
    metrics = trainer.train_step(groups)
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    assert seen and set(seen) == {torch.bfloat16}  # the matmuls ran in bfloat16 ...
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # ... the weights stayed float32
    assert all(s["exp_avg"].dtype == torch.float32 for s in trainer.optimizer.state.values())
    assert any(not torch.equal(before[k], v) for k, v in weights(trainer.model).items())


def test_float16_precision_trains_with_a_gradient_scaler_and_saves_its_state():
    trainer, _, before, after = train_and_measure({"precision": "float16"}, steps=2)
    assert trainer.scaler is not None and "scaler" in trainer.state_dict()
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert after > before


def test_gradient_checkpointing_recomputes_layers_and_matches_full_fine_tuning():
    full, groups, before, after_full = train_and_measure({})
    checkpointed, _, _, after_ckpt = train_and_measure({"gradient_checkpointing": True})
    assert after_full > before and after_ckpt > before  # same direction ...
    for name, tensor in full.model.state_dict().items():  # ... and the same update, up to float rounding
        torch.testing.assert_close(checkpointed.model.state_dict()[name], tensor, rtol=1e-4, atol=1e-5)
    mlp = checkpointed.model.model.layers[0].mlp
    calls: list[int] = []
    forward = mlp.forward
    mlp.forward = lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs)
    checkpointed.train_step(groups[:1])
    assert len(calls) == 2  # forward, then again in the backward pass: activations were not kept
    assert not any(m.training for m in checkpointed.model.model.layers[0].modules() if m is not checkpointed.model.model.layers[0])


def test_gradient_checkpointing_on_a_model_that_cannot_is_a_config_error():
    model = tiny_llama(0)
    model.supports_gradient_checkpointing = False  # as a custom architecture without it
    expected = r"train.gradient_checkpointing = true, but LlamaForCausalLM .*Fix: set train.gradient_checkpointing: false"
    with pytest.raises(ConfigError, match=expected):
        TorchTrainer(model, None, make_cfg({"gradient_checkpointing": True}))


def test_lora_trains_adapters_only_serves_merged_weights_and_matches_full_fine_tuning_direction(tmp_path):
    pytest.importorskip("peft", reason="LoRA needs peft: pip install 'asyncgrpo[lora]'")
    _, _, before, after_full = train_and_measure({})
    trainer, groups, _, after_lora = train_and_measure({"lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}})
    assert after_full > before and after_lora > before
    initial = tiny_llama(0).state_dict()
    base = trainer.base_model.state_dict()
    assert all(torch.equal(base[k], v) for k, v in base.items() if ".lora_" not in k and k.replace(".base_layer", "") in initial
               and torch.equal(initial[k.replace(".base_layer", "")], v))
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)

    served = trainer.generation_weights()
    assert set(served) == set(initial)  # the base model's names: a generator built from model.path takes them
    changed = {k for k in served if not torch.equal(served[k], initial[k])}
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight")) for k in changed)
    engine_model = serving_copy(tiny_llama(0), served, dtype=torch.float32, device=torch.device("cpu"))
    assert objective(engine_model, groups) == pytest.approx(after_lora, rel=1e-4)

    path = save_checkpoint(tmp_path, 3, trainer, "{}", {"done": {}})
    assert checkpoint_problem(path) is None
    assert (path / "adapter" / "adapter_model.safetensors").is_file()
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(path)
    assert objective(merged, groups) == pytest.approx(after_lora, rel=1e-4)
    resumed = TorchTrainer(tiny_llama(0), None, trainer.cfg)
    load_checkpoint(path, resumed)
    assert resumed.version == 3
    for k, v in resumed.generation_weights().items():
        torch.testing.assert_close(v, served[k])


def test_with_lora_the_kl_reference_is_the_base_model_with_adapters_off_not_a_copy():
    pytest.importorskip("peft", reason="LoRA needs peft: pip install 'asyncgrpo[lora]'")
    cfg = make_cfg({"lr": 1e-2, "loss": {"kl_coef": 0.1}, "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}})
    groups = make_groups(tiny_llama(0), 2)
    shared, copied = TorchTrainer(tiny_llama(0), None, cfg), TorchTrainer(tiny_llama(0), None, cfg)
    assert shared.reference is None  # no second copy of the model's weights
    copied.reference = tiny_llama(0).eval().requires_grad_(False)  # a frozen copy of the initial model, as without LoRA
    for _ in range(3):
        a, b = shared.train_step(groups), copied.train_step(groups)
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-5, abs=1e-9) and a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert a["kl"] > 0  # the adapters have moved the policy away from the reference


LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def test_lora_dropout_applies_to_the_policy_update():
    pytest.importorskip("peft", reason="LoRA needs peft: pip install 'asyncgrpo[lora]'")
    groups = make_groups(tiny_llama(0), 3)

    def two_steps(dropout: float) -> tuple[TorchTrainer, list[float]]:
        trainer = TorchTrainer(tiny_llama(0), None, make_cfg({"lr": 3e-3, "lora": {**LORA, "dropout": dropout}}))
        return trainer, [trainer.train_step(groups)["loss"] for _ in range(2)]  # the adapters start as 0: step 2 sees them

    plain, plain_losses = two_steps(0.0)
    dropped, dropped_losses = two_steps(0.5)
    assert dropped_losses[0] == pytest.approx(plain_losses[0], rel=1e-5)
    assert dropped_losses[1] != pytest.approx(plain_losses[1], rel=1e-3)  # the dropout reached the loss ...
    changed = [n for n, p in dropped.model.named_parameters() if p.requires_grad and not torch.equal(p, plain.model.get_parameter(n))]
    assert changed  # ... and the update
    assert not any(m.training for m in dropped.model.modules())  # and is off again after the step


def test_under_lora_dropout_pi_prox_and_the_reference_are_taken_without_it():
    pytest.importorskip("peft", reason="LoRA needs peft: pip install 'asyncgrpo[lora]'")
    cfg = make_cfg({"lr": 3e-3, "loss": {"objective": "decoupled", "kl_coef": 0.1}, "lora": {**LORA, "dropout": 0.5}})
    trainer = TorchTrainer(tiny_llama(0), None, cfg)
    trainer.train_step(make_groups(tiny_llama(0), 3))  # the adapters move away from 0, so dropping them changes pi_theta
    groups = make_groups(trainer.model, 3, seed=1)  # generated by the current policy: pi_gen = pi_prox, without dropout
    metrics = trainer.train_step(groups)
    assert metrics["is_ratio/mean"] == pytest.approx(1.0, abs=1e-5) and metrics["is_ratio/max"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["kl"] > 0


def test_the_adapters_start_from_run_seed_whatever_drew_random_numbers_before():
    pytest.importorskip("peft", reason="LoRA needs peft: pip install 'asyncgrpo[lora]'")

    def adapters(seed: int, draws_before: int) -> dict[str, torch.Tensor]:
        model = tiny_llama(0)  # (seeds the global RNG itself)
        torch.rand(draws_before)  # what loading a model, a KL copy or a Ray rank's set-up may draw
        cfg = make_cfg({"lora": LORA})
        trainer = TorchTrainer(model, None, cfg.model_copy(update={"run": cfg.run.model_copy(update={"seed": seed})}))
        return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}

    first = adapters(0, draws_before=0)
    assert all(torch.equal(first[n], p) for n, p in adapters(0, draws_before=7).items())
    assert any(not torch.equal(first[n], p) for n, p in adapters(1, draws_before=0).items())
    model = tiny_llama(0)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    TorchTrainer(model, None, make_cfg({"lora": LORA}))
    assert torch.equal(torch.rand(3), expected)  # the global RNG goes on as if no adapter had been drawn


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")  # peft's own hint of the same
@pytest.mark.parametrize("targets", [["lm_head"], ["embed_tokens", "q_proj"]])
def test_lora_on_a_tied_embedding_is_refused_since_no_merged_model_could_serve_it(targets):
    pytest.importorskip("peft", reason="LoRA needs peft: pip install 'asyncgrpo[lora]'")
    from asyncgrpo.models.tiny import build_tiny

    model, _ = build_tiny(0)  # ties lm_head to embed_tokens, as SmolLM2 does
    with pytest.raises(ConfigError, match=r"but this model ties its input and output embeddings .*Fix: leave lm_head and "
                                          r"model.embed_tokens out of train.lora.target_modules"):
        TorchTrainer(model, None, make_cfg({"lora": {"r": 4, "target_modules": targets}}))
    model, _ = build_tiny(0)
    assert TorchTrainer(model, None, make_cfg({"lora": {"r": 4}})).lora  # all-linear leaves lm_head out


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ("constant", [0.5, 1, 1, 1, 1, 1]),
        ("linear", [0.5, 1, 1, 0.75, 0.5, 0.25]),
        ("cosine", [0.5, 1, 1, (1 + math.cos(math.pi / 4)) / 2, 0.5, (1 + math.cos(3 * math.pi / 4)) / 2]),
    ],
)
def test_lr_schedules_warm_up_then_decay_towards_zero_at_max_steps(schedule, expected):
    model = tiny_llama(0)
    trainer = TorchTrainer(model, None, make_cfg({"lr": 1e-3, "warmup_steps": 2, "max_steps": 6, "lr_schedule": schedule}))
    groups = make_groups(model, 1)
    lrs = [trainer.train_step(groups)["lr"] for _ in range(6)]
    assert lrs == pytest.approx([1e-3 * f for f in expected], abs=1e-12)


def test_a_loaded_optimizer_follows_the_new_schedule():
    model = tiny_llama(0)
    groups = make_groups(model, 1)
    first = TorchTrainer(copy.deepcopy(model), None, make_cfg({"lr": 1e-3, "max_steps": 4}))
    first.train_step(groups)
    first.train_step(groups)
    resumed = TorchTrainer(copy.deepcopy(model), None, make_cfg({"lr": 1e-3, "max_steps": 4, "lr_schedule": "linear"}))
    resumed.load_state_dict(first.state_dict())
    assert resumed.lr == pytest.approx(1e-3 * 0.5)  # step 2 of 4 on the linear decay, not the saved constant rate


def test_device_placement_puts_the_model_and_batches_on_train_device():
    trainer = TorchTrainer(tiny_llama(0), None, make_cfg({"device": "cpu"}))
    assert trainer.device == torch.device("cpu")
    assert {p.device for p in trainer.model.parameters()} == {torch.device("cpu")}
    assert resolve_device("auto") == (torch.device("cuda") if torch.cuda.is_available() else trainer.device if not (
        getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()) else torch.device("mps"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_asking_for_a_gpu_that_is_not_there_is_a_config_error_not_a_silent_cpu_run():
    with pytest.raises(ConfigError, match=r"train.device = 'cuda:1'.*no CUDA device.*Fix: set train.device: auto"):
        TorchTrainer(tiny_llama(0), None, make_cfg({"device": "cuda:1"}))


def test_bfloat16_on_a_gpu_without_it_is_a_config_error_before_any_step(monkeypatch):
    capabilities = {0: (8, 0), 1: (7, 0)}  # an A100 and a V100
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capabilities[torch.device(device).index or 0])
    with pytest.raises(ConfigError, match=r"train.precision = 'bfloat16'.*cuda:1, compute capability 7.0.*Fix: set train.precision: float16"):
        check_precision(torch.device("cuda:1"), "bfloat16")
    check_precision(torch.device("cuda:0"), "bfloat16")
    check_precision(torch.device("cuda:1"), "float16")
    check_precision(torch.device("cpu"), "bfloat16")  # CPU autocast has bfloat16


def test_the_engine_copy_is_built_in_the_serving_dtype_and_loads_float32_weights():
    source = tiny_llama(0, tie=True)
    engine_model = serving_copy(source, source.state_dict(), dtype=torch.bfloat16, device=torch.device("cpu"))
    assert {p.dtype for p in engine_model.parameters()} == {torch.bfloat16}
    assert engine_model.lm_head.weight is engine_model.model.embed_tokens.weight  # tied, not a second copy
    ids = torch.tensor([[1, 5, 7, 9]])
    with torch.no_grad():
        torch.testing.assert_close(engine_model(input_ids=ids).logits.float(), source(input_ids=ids).logits, atol=0.05, rtol=0.05)


def test_autocast_keeps_no_cast_cache():
    """The cache would hold a bfloat16 copy of every weight until the forward ends, which gradient checkpointing cannot free."""
    with autocast(torch.device("cpu"), "bfloat16"):
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert not torch.is_autocast_cache_enabled()
