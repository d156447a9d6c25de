# Every target creates or reuses .venv and installs what it needs; nothing is assumed installed.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvtier-installed

.PHONY: demo test lint setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned to the CPU build, so no dependency drags in a CUDA wheel
	$(BIN)/python -m pip install --quiet "torch==2.13.0+cpu" || $(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check src tests

test: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/python -m pytest -q

demo: $(STAMP)
	$(BIN)/kvtier bench tier

clean:
	rm -rf $(VENV) .pytest_cache build
