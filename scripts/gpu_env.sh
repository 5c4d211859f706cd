# Sourced (from the repository root) by the GPU machine's checks, `make gpu-check` and `make scale-check`:
# the wheels carried in .gpu/wheels (made here by scripts/gpu_prepare.sh: what that machine's image lacks)
# go into a private folder, which with the repository goes on PYTHONPATH; the checks run as
# `$PY scripts/...`. Without carried wheels (this machine: the venv has everything) nothing is installed.
PY=${PY:-python3}
if compgen -G ".gpu/wheels/*.whl" >/dev/null; then
  SITE=${SERVELAB_SITE:-/tmp/servelab-site}
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .gpu/wheels/*.whl
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
