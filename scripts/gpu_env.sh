# Sourced (from the repository root) by scripts/gpu_run.sh, i.e. `make gpu-check` and `make scale-check`:
# where $PY lacks the project's dependencies (the GPU machine's image; KINDS.md lists it), the wheels
# carried in .gpu/wheels (made here by scripts/gpu_prepare.sh) go into a private folder on PYTHONPATH;
# the repository goes on it too (the checks run as `$PY scripts/...`, not from an installed package).
PY=${PY:-python3}
if ! "$PY" -c "import fastapi, gguf, msgspec, orjson, plotly, uvicorn" 2>/dev/null; then
  compgen -G ".gpu/wheels/*.whl" >/dev/null || { echo "gpu_env: $PY lacks the project's packages and .gpu/wheels is empty: run make gpu-prepare first" >&2; exit 1; }
  SITE=${SERVELAB_SITE:-/tmp/servelab-site}
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .gpu/wheels/*.whl
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
