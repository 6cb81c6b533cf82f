# The two commands of the README: `make run` and `make test`. Everything else is a step of those.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test check lint typecheck bench-small browser-deps docs clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch is installed first and pinned: a bare `torch` pulls gigabytes of CUDA packages.
$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

## Install and run the whole system on embedded defaults (Postgres, Postgres queue, demo model).
run: $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/chatmem up

## Install the test dependencies (and headless Chromium) and run lint and every test.
test: $(VENV)/.installed-test browser-deps
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	HF_HUB_OFFLINE=1 $(BIN)/pytest

browser-deps:
	@bash scripts/install-browser.sh || echo "warning: headless Chromium could not be installed; browser tests will be skipped"

check: test typecheck

typecheck: $(VENV)/.installed-test
	$(BIN)/mypy chat_api memory indexer

## Run every benchmark small, to prove they work (figures from a full run go in the closing notes).
bench-small: $(VENV)/.installed-test
	HF_HUB_OFFLINE=1 $(BIN)/python bench/run_small.py

docs: $(VENV)/.installed
	$(BIN)/python -m chat_api.settings_doc --write README.md

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache test-artifacts bench/results
