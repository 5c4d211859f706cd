#!/usr/bin/env bash
# `make gpu-check OUT=DIR` on the GPU machine (after `make gpu-prepare` here; .gpu carried with the call):
# installs the carried wheels, then runs every check of scripts/gpu_check.py into DIR. Extra arguments go to it.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/gpu_check.sh OUT [scripts/gpu_check.py flags]}
shift
. scripts/gpu_env.sh
exec "$PY" scripts/gpu_check.py --out "$OUT" "$@"
