# Two commands on a fresh machine: `make demo` (set up, then the guard against injected faults and the speed A/B at the
# learning rate a user runs without a sweep, under 3 minutes on 2 cores) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test lint

# pip's own chatter (and setuptools' notice that an editable install imports from this folder, which is the point of
# it) goes to the log; a failure prints it.
$(BIN)/.installed: pyproject.toml
	@echo "installing into $(VENV) (a minute or two; log: $(VENV)/install.log)"
	@$(PYTHON) -m venv $(VENV)
	@# The CPU wheel first; the `torch>=2.4` requirement is then already satisfied.
	@( $(BIN)/pip install -q --upgrade pip && $(BIN)/pip install -q torch==2.13.0 && \
	   $(BIN)/pip install -q -e '.[dev]' ) > $(VENV)/install.log 2>&1 || { cat $(VENV)/install.log; exit 1; }
	@touch $@

setup: $(BIN)/.installed

demo: setup
	@$(BIN)/python scripts/demo.py

test: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup tests

lint: setup
	$(BIN)/ruff check .
