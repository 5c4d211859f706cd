#!/usr/bin/env bash
# Run the CI performance gate N times in a row and tabulate the verdicts (docs/ci-gate.md):
#   scripts/ci_gate_repeat.sh 10 [OUT]     # writes OUT/summary.txt (default results/ci-gate-repeat)
set -uo pipefail
cd "$(dirname "$0")/.."
N="${1:-10}"
OUT="${2:-results/ci-gate-repeat}"
mkdir -p "$OUT"
for i in $(seq 1 "$N"); do
  s=$(date +%s)
  SERVELAB_GATE_OUT="$OUT/run$i" .ci/gate > "$OUT/run$i.log" 2>&1; rc=$?
  v=$(.venv/bin/python -c 'import json,sys; d=json.load(open(sys.argv[1])); c=d["checks"][0]; print(d["verdict"], round(c["ratio"],3), [round(x,3) for x in c["ci"]])' "$OUT/run$i/gate.json" 2>&1)
  echo "run $i rc=$rc secs=$(( $(date +%s) - s )) $v $(uptime | sed 's/.*load average/load/')" | tee -a "$OUT/summary.txt"
done
