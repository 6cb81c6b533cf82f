# The two commands of the README: `make run` and `make test`. Everything else is a step of those.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test check lint typecheck bench-small browser-deps js-deps embedding-server-deps docs clean local-model

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

## Install and start a real small model on a local llama-server (prints the LLM_* settings for `make run`).
local-model: $(VENV)/.installed
	$(BIN)/chatmem local-model start

## Install the test dependencies (headless Chromium, the JS protocol clients) and run lint, mypy and every test:
## in TEST_PROCESSES processes (pytest-xdist; each with its own embedded Postgres), then the tests of
## the one local model server (marked real_model) in one process, since they share its single slot.
TEST_PROCESSES ?= 2
test: $(VENV)/.installed-test browser-deps js-deps embedding-server-deps
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy chat_api memory indexer
	HF_HUB_OFFLINE=1 $(BIN)/pytest -n $(TEST_PROCESSES) -m "not real_model"; rest=$$?; \
	HF_HUB_OFFLINE=1 $(BIN)/pytest -m real_model; model=$$?; \
	test $$rest -eq 0 && test $$model -eq 0

# A real embedding server (infinity-emb) for the tests of EMBEDDING_BASE_URL, in its own venv: it pins
# numpy<2 and sentence-transformers<4, which chatmem's venv cannot hold. torch is pinned first, as above.
EMBEDDING_SERVER_VENV := .venv-embedding-server
embedding-server-deps: $(EMBEDDING_SERVER_VENV)/.installed

$(EMBEDDING_SERVER_VENV)/.installed: scripts/embedding-server-requirements.txt
	$(PYTHON) -m venv $(EMBEDDING_SERVER_VENV)
	$(EMBEDDING_SERVER_VENV)/bin/pip install --quiet --upgrade pip
	$(EMBEDDING_SERVER_VENV)/bin/pip install --quiet torch==2.13.0
	$(EMBEDDING_SERVER_VENV)/bin/pip install --quiet -r scripts/embedding-server-requirements.txt
	touch $@

browser-deps:
	@bash scripts/install-browser.sh || echo "warning: headless Chromium could not be installed; browser tests will be skipped"

# The protocols' own JavaScript clients (`ai`, `openai`, `@ag-ui/client`), pinned by tests/js/package-lock.json.
js-deps: tests/js/node_modules/.package-lock.json examples/ai-sdk-react/node_modules/.package-lock.json examples/ag-ui-assistant-ui/node_modules/.package-lock.json

tests/js/node_modules/.package-lock.json: tests/js/package.json tests/js/package-lock.json
	cd tests/js && npm ci --no-audit --no-fund --loglevel=error

# The AI SDK example (React, @ai-sdk/react, esbuild), pinned by its own lockfile; its browser test serves it.
examples/ai-sdk-react/node_modules/.package-lock.json: examples/ai-sdk-react/package.json examples/ai-sdk-react/package-lock.json
	cd examples/ai-sdk-react && npm ci --no-audit --no-fund --loglevel=error

# The AG-UI example (assistant-ui's AG-UI runtime, esbuild), pinned by its own lockfile; its browser test serves it.
examples/ag-ui-assistant-ui/node_modules/.package-lock.json: examples/ag-ui-assistant-ui/package.json examples/ag-ui-assistant-ui/package-lock.json
	cd examples/ag-ui-assistant-ui && npm ci --no-audit --no-fund --loglevel=error

check: test typecheck

typecheck: $(VENV)/.installed-test
	$(BIN)/mypy chat_api memory indexer

## Run every benchmark small, to prove they work (figures from a full run go in the closing notes).
bench-small: $(VENV)/.installed-test
	HF_HUB_OFFLINE=1 $(BIN)/python bench/run_small.py

docs: $(VENV)/.installed
	$(BIN)/python -m chat_api.cli.settings_doc --write README.md

clean:
	rm -rf $(VENV) $(EMBEDDING_SERVER_VENV) tests/js/node_modules examples/ai-sdk-react/node_modules examples/ag-ui-assistant-ui/node_modules .pytest_cache .ruff_cache .mypy_cache test-artifacts bench/results
