#!/usr/bin/env bash
# `make gpu-check` / `make scale-check` on the GPU machine (after `make gpu-prepare` here; .gpu carried with
# the call): installs the carried wheels (scripts/gpu_env.sh), then runs scripts/SCRIPT --out OUT [flags].
set -euo pipefail
cd "$(dirname "$0")/.."
SCRIPT=${1:?usage: scripts/gpu_run.sh gpu_check.py|scale_check.py OUT [flags]}
OUT=${2:?usage: scripts/gpu_run.sh gpu_check.py|scale_check.py OUT [flags]}
shift 2
. scripts/gpu_env.sh
exec "$PY" "scripts/$SCRIPT" --out "$OUT" "$@"
