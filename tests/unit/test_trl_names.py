"""TRL's names: one table (trl_names.py) behind the validator's help, `asyncgrpo convert-trl` and the README's
mapping table. Every name in it is a real field of the installed trl's GRPOConfig (or ModelConfig), every key
it maps to is a key of our config, and the README's table is generated from it."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from asyncgrpo.commands.cli import main
from asyncgrpo.config import Config, load_config, section_model
from asyncgrpo.errors import ConfigError
from asyncgrpo.trl_convert import convert_trl
from asyncgrpo.trl_names import TABLE

from .test_docs import SCRIPT


def _our_keys() -> set[str]:
    keys: set[str] = set()

    def walk(prefix: str, model) -> None:
        for name, field in model.model_fields.items():
            keys.add(prefix + name)
            sub = section_model(field.annotation)
            if sub is not None:
                walk(f"{prefix}{name}.", sub)

    walk("", Config)
    return keys


def test_every_trl_name_is_a_field_of_trl_and_every_key_is_ours():
    trl = pytest.importorskip("trl")
    fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)} | {f.name for f in dataclasses.fields(trl.ModelConfig)}
    not_trl = [f.trl for f in TABLE if f.trl not in fields and not f.older]
    assert not not_trl, f"not fields of trl {trl.__version__}'s GRPOConfig/ModelConfig: {not_trl}"
    assert [f.trl for f in TABLE if f.older and f.trl in fields] == []  # marked older, yet still there
    not_ours = [f.ours for f in TABLE if f.ours is not None and f.ours not in _our_keys()]
    assert not not_ours, f"not keys of asyncgrpo's config: {not_ours}"
    assert len({f.trl for f in TABLE}) == len(TABLE)


def test_the_readme_table_is_generated_from_the_table():
    import importlib.util

    spec = importlib.util.spec_from_file_location("trl_table", SCRIPT.parent / "trl_table.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    text = script.README.read_text(encoding="utf-8")
    assert script.rewrite(text) == text, "README.md's TRL table is out of date: run `python scripts/trl_table.py`"
    assert "| `num_generations` | `rollout.group_size` |" in text


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("rollout.num_generations=8", "rollout.num_generations: unknown key. TRL's `num_generations` is `rollout.group_size` here. "
                                      "Fix: replace it with rollout.group_size=8."),
        ("num_generations=8", "num_generations: unknown key. TRL's `num_generations` is `rollout.group_size` here."),
        ("train.learning_rate=0.00001", "train.learning_rate: unknown key. TRL's `learning_rate` is `train.lr` here. "
                                        "Fix: replace it with train.lr=1e-05."),
        ("loss_type=grpo", "TRL's `loss_type` is `train.loss.type` here"),
        ("train.loss.loss_type=dr_grpo", "Fix: replace it with train.loss.type=dr_grpo."),
        ("loss_type=ppo", "'ppo' has no counterpart here: the loss types here are grpo, dr_grpo, dapo"),
        ("vllm_importance_sampling_mode=token_mask", "Fix: replace it with train.loss.mismatch_correction=token_mask."),
        ("top_k=50", "TRL's `top_k` is `generation.top_k` here (0 is off, as are TRL's null and vLLM's -1). "
                    "Fix: replace it with generation.top_k=50."),
        ("generation_kwargs={}", "generation samples with temperature, top_p, top_k, min_p and repetition_penalty only"),
        ("bf16=true", "Fix: replace it with train.precision=bfloat16."),
    ],
)
def test_a_trl_name_is_refused_with_its_key_here(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config("recipes/demo.yaml", [override])
    assert expected in str(err.value)
    assert "max_generation_failures" not in str(err.value)  # the old, wrong "did you mean"


def test_a_grpo_config_converts_with_a_report_and_the_recipe_is_valid():
    trl = {"learning_rate": 1e-6, "num_generations": 4, "generation_batch_size": 16, "loss_type": "grpo", "beta": 0.04,
           "epsilon_high": None, "top_k": 0, "num_iterations": 2, "vllm_gpu_memory_utilization": 0.3, "push_to_hub": False,
           "bf16": True, "fp16": True, "report_to": "none", "max_steps": 20}
    conversion = convert_trl(trl)
    assert conversion.recipe == {
        "train": {"lr": 1e-6, "loss": {"type": "grpo", "kl_coef": 0.04, "clip_high": 0.2}, "precision": "bfloat16",
                  "max_steps": 20},
        "rollout": {"group_size": 4, "groups_per_step": 4},
        "logging": {"sinks": ["jsonl"]},
    }
    same = {name for name, _, _ in conversion.same}
    unmapped = {name: why for name, _, why in conversion.unmapped}
    assert same == {"top_k", "push_to_hub"}
    assert set(unmapped) == {"num_iterations", "vllm_gpu_memory_utilization", "fp16"}
    assert "bf16 already set train.precision to bfloat16" in unmapped["fp16"]
    assert "vLLM server's command line" in unmapped["vllm_gpu_memory_utilization"]
    assert len(conversion.mapped) + len(same) + len(unmapped) == len(trl)
    Config.model_validate(conversion.recipe)


def test_a_whole_grpo_config_dump_converts_to_a_valid_recipe():
    trl = pytest.importorskip("trl")
    dump = trl.GRPOConfig(output_dir="out", use_cpu=True, bf16=False).to_dict()
    conversion = convert_trl(dump)
    Config.model_validate(conversion.recipe)  # TRL's nulls (run_name, num_generations_eval, ...) leave our defaults
    assert conversion.recipe["rollout"] == {"group_size": 8, "groups_per_step": 1, "mask_truncated": False}
    assert conversion.recipe["train"]["device"] == "cpu" and "max_steps" not in conversion.recipe["train"]
    unmapped = {name: why for name, _, why in conversion.unmapped}
    assert "max_steps" in unmapped
    same = {name for name, _, _ in conversion.same}  # without use_vllm TRL applies no importance-sampling correction
    assert {"vllm_importance_sampling_correction", "vllm_importance_sampling_mode"} <= same
    assert conversion.recipe["train"]["loss"]["type"] == "dapo"
    assert len(conversion.mapped) + len(conversion.same) + len(conversion.unmapped) == len(dump)


def test_convert_trl_cli_writes_a_recipe_check_accepts(tmp_path, capsys):
    source = tmp_path / "grpo.yaml"
    source.write_text(yaml.safe_dump({"num_generations": 4, "learning_rate": 1e-5, "max_steps": 3, "top_k": 50,
                                      "output_dir": str(tmp_path / "run")}))
    out = tmp_path / "recipe.yaml"
    assert main(["convert-trl", str(source), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "num_generations: 4 -> rollout.group_size: 4" in err and "top_k: 50 -> generation.top_k: 50" in err
    assert main(["check", str(out)]) == 0
    assert "rollout: 16 groups of 4 per step" in capsys.readouterr().out


def test_convert_trl_cli_refuses_a_recipe_that_would_not_validate(tmp_path, capsys):
    source = tmp_path / "grpo.json"
    source.write_text('{"num_generations": 1}')
    assert main(["convert-trl", str(source)]) == 3
    # A group of 1 cannot keep the default 2 survivors (config's rule; GRPO's own, groups of 2 or more, is checked when
    # the algorithm is built, and a TRL recipe cannot break it once this holds).
    assert "rollout.min_group_survivors = 2 exceeds rollout.group_size = 1" in capsys.readouterr().err


def test_trls_vllm_importance_sampling_correction_converts_to_the_decoupled_objective_and_its_mismatch_mode():
    trl = {"use_vllm": True, "vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "token_truncate",
           "vllm_importance_sampling_clip_min": None, "vllm_importance_sampling_clip_max": 2.0, "loss_type": "cispo",
           "importance_sampling_level": "token", "vllm_server_base_url": "http://127.0.0.1:8000"}
    conversion = convert_trl(trl)
    loss = Config.model_validate(conversion.recipe).train.loss
    assert (loss.type, loss.objective, loss.mismatch_correction, loss.mismatch_clip_min, loss.mismatch_clip_max) == (
        "cispo", "decoupled", "token_truncate", None, 2.0)
    assert len(conversion.mapped) + len(conversion.same) + len(conversion.unmapped) == len(trl)
