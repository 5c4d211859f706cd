#!/usr/bin/env bash
# Here, before a GPU machine is lent: fills .gpu/ (ignored by git, carried with the device call) with what
# the GPU checks need and that machine lacks (KINDS.md lists its image): the wheels of the project's
# dependencies it does not have, for its Python (3.12, x86-64), at the versions this venv runs, and the
# bundled model's tokenizer as a tensor-less GGUF (the 98 MB model cannot travel; the checks seed models
# with its vocabulary). About 16 MB in all.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PKGS=(fastapi starlette pydantic pydantic_core annotated-types typing-inspection typing_extensions uvicorn orjson
      msgspec gguf plotly opentelemetry-api)
rm -rf .gpu/wheels && mkdir -p .gpu/wheels
pins=()
for p in "${PKGS[@]}"; do pins+=("$p==$("$PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$p")"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d .gpu/wheels "${pins[@]}" 2>&1 | grep -v "^WARNING: Location" || true
[ "$(ls .gpu/wheels/*.whl | wc -l)" -eq "${#PKGS[@]}" ] || { echo "gpu_prepare: expected ${#PKGS[@]} wheels in .gpu/wheels" >&2; exit 1; }
"$PY" scripts/gpu_check.py --export-tokenizer .gpu/tokenizer.gguf
du -sh .gpu
