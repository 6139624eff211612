# Two commands on a fresh machine: `make demo` (set up, then the guard against injected faults and the cpu-small
# speed A/B) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test lint

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU wheel; a later `torch>=2.4` requirement is then already satisfied.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/python scripts/benchmark.py --preset cpu-small --mode faults --max_steps 200
	$(BIN)/python scripts/benchmark.py --preset cpu-small --repeats 1

test: setup
	$(BIN)/python -m pytest -q tests

lint: setup
	$(BIN)/ruff check .
