"""Every shell command in the README is run by a test or a documented script; the README's vLLM command serves.

Job: (1) extract the fenced shell commands of README.md (continuation lines joined, comments dropped) and check
that each is in RUN_BY, which names the test (``file::function``, checked to exist) or script that runs it, so a
README command added without a test fails here, and an entry whose command left the README fails too;
(2) start the README's vllm-cpu command line exactly as written (only the model path and the port substituted)
and see it serve the tiny model it is shown with.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from asyncgrpo.models.saving import save_model
from asyncgrpo.models.tiny import build_tiny
from tests.integration.servers import free_port, http
from tests.integration.vllm_server import VLLM_PYTHON, start_vllm_command, vllm_available

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MODEL_PLACEHOLDER = "/path/to/hf_model_dir"
VLLM_CPU_ENTRYPOINT = "vllm.entrypoints.openai.api_server"

LOCAL_MODEL_TEST = "tests/integration/test_readme_commands.py::test_the_readmes_local_model_commands_save_check_and_train"
RUN_BY: dict[str, str] = {
    "make demo": "tests/integration/test_train_e2e.py::test_synchronous_grpo_learns_the_demo_task "
    "(the target runs `asyncgrpo train recipes/demo.yaml`); docs/benchmarks.md, 'Recipes that learn'",
    "make test": "Makefile `test`: the suite itself",
    ".venv/bin/python -m asyncgrpo.models.tiny runs/tiny_model": LOCAL_MODEL_TEST,
    ".venv/bin/asyncgrpo check recipes/local_model.yaml": LOCAL_MODEL_TEST,
    ".venv/bin/asyncgrpo train recipes/local_model.yaml": "bench/recipe_curves.py local_model "
    "(docs/benchmarks.md, 'Recipes that learn': the whole 100 steps); the same run cut to 50 steps by " + LOCAL_MODEL_TEST,
    ".venv/bin/asyncgrpo train recipes/local_model.yaml model.path=/path/to/hf_model_dir train.max_steps=50":
    LOCAL_MODEL_TEST,
    ".venv/bin/asyncgrpo serve /path/to/hf_model_dir --port 8000":
    "tests/integration/test_serve.py::test_completion_has_vllms_shape_and_the_sampled_distributions_logprobs",
    ".venv/bin/asyncgrpo serve /path/to/hf_model_dir --port 8001 --served-model-name policy --max-batch-size 64":
    "tests/integration/test_serve.py::test_completion_has_vllms_shape_and_the_sampled_distributions_logprobs",
    "VLLM_SERVER_DEV_MODE=1 vllm serve /path/to/hf_model_dir --port 8000 --logprobs-mode processed_logprobs":
    "not run here: vllm-cpu's `vllm` console script is broken; the next command is the same server, tested by "
    "tests/integration/test_readme_commands.py::test_the_readmes_vllm_cpu_command_serves_the_tiny_model",
    "VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server "
    "--model /path/to/hf_model_dir --port 8000 --max-model-len 512 --dtype float32 --enforce-eager "
    "--logprobs-mode processed_logprobs --generation-config vllm":
    "tests/integration/test_readme_commands.py::test_the_readmes_vllm_cpu_command_serves_the_tiny_model",
    "pip install 'asyncgrpo[ray]'": "pyproject.toml's `ray` extra; tests/integration/test_ray_train.py runs with it",
    "asyncgrpo train recipes/demo.yaml runtime=ray ray.generators=2 ray.num_cpus=2":
    "tests/integration/test_ray_train.py::test_a_short_ray_run_with_two_generator_actors_completes",
    "asyncgrpo train recipes/demo.yaml runtime=ray ray.num_cpus=2 generation.backend=http generation.http.launch.count=2 "
    "generation.http.launch.num_cpus=0.5":
    "tests/integration/test_ray_launch.py::test_launched_servers_train_a_killed_one_restarts_with_the_current_weights_then_"
    "stays_down_and_none_survives (these overrides, and a restart budget and kills)",
    ".venv/bin/asyncgrpo simulate recipes/simulate.yaml":
    "tests/integration/test_cli.py::test_simulate_exit_codes_follow_the_outcome",
    ".venv/bin/asyncgrpo simulate recipes/simulate.yaml rollout.max_staleness=2 --json":
    "tests/integration/test_cli.py::test_simulate_json_prints_exactly_one_object_with_the_documented_keys",
}
"""README command -> the test (file::function) or script that runs it."""


def readme_commands(text: str) -> list[str]:
    """The commands of the README's ```bash/sh/shell fences: one per logical line (``\\``-continued lines joined),
    comments and blank lines dropped, whitespace collapsed."""
    commands: list[str] = []
    for block in re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```", text, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line).strip()
            if line:
                commands.append(" ".join(line.split()))
    return commands


def test_readme_commands_are_extracted_joined_and_without_comments():
    text = "```bash\nmake a   # note\n# only a comment\nx=1 run \\\n    --flag 2\n```\n```yaml\nnot: a command\n```\n"
    assert readme_commands(text) == ["make a", "x=1 run --flag 2"]


def test_every_readme_command_is_run_by_a_named_test_or_script():
    commands = readme_commands(README.read_text())
    missing = [c for c in commands if c not in RUN_BY]
    assert not missing, f"README commands no test runs (add a test and an entry to RUN_BY): {missing}"
    stale = [c for c in RUN_BY if c not in commands]
    assert not stale, f"RUN_BY entries no longer in the README: {stale}"
    for command, where in RUN_BY.items():
        for path, function in re.findall(r"(tests/[\w/]+\.py)::(\w+)", where):
            source = (ROOT / path).read_text()
            assert f"def {function}(" in source, f"{command!r}: {path} has no test {function}"


def readme_vllm_cpu_command() -> tuple[dict[str, str], list[str]]:
    """The README's vllm-cpu server command: its environment assignments and its argv."""
    [command] = [c for c in readme_commands(README.read_text()) if VLLM_CPU_ENTRYPOINT in c]
    words = shlex.split(command)
    env: dict[str, str] = {}
    while "=" in words[0] and not words[0].startswith("-"):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return env, words


@pytest.mark.timeout(600)
@pytest.mark.skipif(vllm_available() is not None, reason=vllm_available() or "")
def test_the_readmes_vllm_cpu_command_serves_the_tiny_model(tmp_path):
    env, argv = readme_vllm_cpu_command()
    assert argv[0] == ".venv-vllm/bin/python", argv
    model_dir = save_model(*build_tiny(0), tmp_path / "tiny")
    port = free_port()
    substitutes = {".venv-vllm/bin/python": str(VLLM_PYTHON), MODEL_PLACEHOLDER: str(model_dir), "8000": str(port)}
    argv = [substitutes.get(word, word) for word in argv]
    server = start_vllm_command(argv, env, model=str(model_dir), port=port, log_path=tmp_path / "server.log")
    try:
        status, reply = http("POST", f"{server.base_url}/v1/completions",
                     {"model": str(model_dir), "prompt": "say a: ", "max_tokens": 4, "logprobs": 0})
        assert status == 200, reply
        assert reply["choices"][0]["finish_reason"] == "length", reply
        assert len(reply["choices"][0]["logprobs"]["token_logprobs"]) == 4, reply
    finally:
        server.stop()


def run_readme_command(command: str, cwd: Path, substitutes: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run one README command in `cwd` with this interpreter for `.venv/bin/...`, the keys of `substitutes` replaced."""
    words = shlex.split(command)
    for old, new in substitutes.items():
        words = [word.replace(old, new) for word in words]
    program = {".venv/bin/python": [sys.executable], ".venv/bin/asyncgrpo": [sys.executable, "-m", "asyncgrpo.commands.cli"]}
    return subprocess.run([*program[words[0]], *words[1:]], cwd=cwd, capture_output=True, text=True, timeout=600)


def eval_rewards(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row["eval/reward_mean"] for row in rows if "eval/reward_mean" in row]


@pytest.mark.timeout(600)
def test_the_readmes_local_model_commands_save_check_and_train(tmp_path):
    commands = [c for c in readme_commands(README.read_text()) if "local_model" in c or "asyncgrpo.models.tiny" in c]
    save, check, _, train_yours = commands  # the plain 100-step train is measured by bench/recipe_curves.py
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "local_model.yaml").write_text((ROOT / "recipes" / "local_model.yaml").read_text())
    saved = run_readme_command(save, tmp_path, {})
    assert saved.returncode == 0, saved.stderr
    assert (tmp_path / "runs" / "tiny_model" / "config.json").is_file()
    checked = run_readme_command(check, tmp_path, {})
    assert checked.returncode == 0, checked.stderr
    model_dir = tmp_path / "elsewhere" / "my_model"
    (tmp_path / "runs" / "tiny_model").rename(model_dir.parent.mkdir() or model_dir)
    trained = run_readme_command(train_yours + " logging.progress=false", tmp_path, {MODEL_PLACEHOLDER: str(model_dir)})
    assert trained.returncode == 0, trained.stderr
    evals = eval_rewards(tmp_path / "runs" / "local-model")
    # the recipe's task is one the model can learn: 50 steps lift held-out eval from 0 (0.78 measured, seed 0)
    assert evals[0] == 0.0 and evals[-1] >= 0.4, evals
