"""Peer agreement with vLLM's `bench serve` (``-m vllm`` and ``slow``: ~20 minutes, so in neither the default
run nor ``make test-vllm``; run it with ``pytest -m vllm tests/test_peers.py``).

Runs scripts/compare_peers.py: vLLM's `bench serve` and `bench run` at the same time on the same server
(paired: each at c/2, at c = 1 taking turns), three rounds, the same traffic (32-token prompts from a fresh
seed per run, exactly 128 output tokens, c = 1/4/16) against the reference server and llama-server; TTFT, TPOT and ITL medians and output tok/s must agree within 3 %
(docs/metrics.md, "Agreement with vLLM's bench serve") and no request may fail.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]


def test_bench_run_agrees_with_vllm_bench_serve(tmp_path):
    out = tmp_path / "peers"
    res = subprocess.run([sys.executable, str(ROOT / "scripts/compare_peers.py"), "--out", str(out), "--rounds", "3"],
                         capture_output=True, text=True, timeout=3600)  # fmt: skip
    summary = json.loads((out / "peers.json").read_text())
    assert set(summary) == {"reference", "llama-server"}
    for server, per_c in summary.items():
        assert set(per_c) == {"1", "4", "16"}
        for c, figs in per_c.items():
            assert figs["errors"] == 0, (server, c)
            for fig in ("ttft_ms", "tpot_ms", "itl_ms", "output_tok_s"):
                assert abs(figs[fig]["diff"]) <= 0.03, (server, c, fig, figs[fig])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
