"""An embeddings server measured end to end as a user would (issue 36), for each server's live tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from loadgen.cli.app import app
from support.cli import cli_point
from workloads.contracts import read_jsonl

ROOT = Path(__file__).resolve().parents[2]


def embeddings_end_to_end(url: str, tmp_path: Path) -> None:
    """`bench run --api embeddings` on the default workload, `bench sweep` of an embeddings workload (2 texts of 16
    tokens per request) at two concurrencies and two trials, its report, and `bench gate` on two such sweeps:
    every request ok, no TTFT (nothing is generated), inputs/s = 2 x req/s, and the server counts exactly the
    tokens the workload meant."""
    runner = CliRunner()
    one, out = cli_point(url, ROOT / "workloads/builtin/chat-short.toml", tmp_path, "one", 2, "--api", "embeddings")
    assert one["counts"]["inputs"] == 2 and "inputs/s" in out and one["latency"]["ttft"]["count"] == 0
    wl = tmp_path / "emb.toml"
    wl.write_text('api = "embeddings"\n[[classes]]\nname = "passages"\nprompt = 16\ninputs = 2\n')
    for run_id in ("base", "cand"):
        res = runner.invoke(app, ["sweep", "--url", url, "--workload", str(wl), "--concurrency", "1,2",
                                  "--num-requests", "4", "--repeat", "2", "--output-dir", str(tmp_path),
                                  "--run-id", run_id])  # fmt: skip
        assert res.exit_code == 0, res.output
        assert "not the lengths asked" not in res.output  # the server's count of the inputs, before the load
    points = json.loads((tmp_path / "base" / "summary.json").read_text())["points"]
    assert len(points) == 4
    for p in points:
        assert p["counts"]["ok"] == 4 and p["counts"]["errors"] == 0 and p["counts"]["inputs"] == 8, p["counts"]
        assert p["latency"]["ttft"]["count"] == 0 and p["counts"]["output_tokens"] == 0
        for scope in ("whole", "steady"):
            rates = p["throughput"][scope]
            assert rates["inputs_per_s"] == pytest.approx(2 * rates["req_per_s"]), rates
        assert p["prompt_lengths"]["ratio"] == 1.0, p["prompt_lengths"]  # the server counted what was meant
        recs = read_jsonl(tmp_path / "base" / "points" / p["point_id"] / "requests.jsonl")
        assert all(r["extra"]["inputs"] == 2 and r["events"] == [] for r in recs)
    assert "inputs/s" in (tmp_path / "base" / "report.html").read_text()
    verdict = tmp_path / "verdict.json"
    res = runner.invoke(app, ["gate", "--baseline", str(tmp_path / "base"), "--candidate", str(tmp_path / "cand"),
                              "--metric", "inputs_s:-50%", "--metric", "e2e_p50:+100%", "--min-trials", "2",
                              "--json", str(verdict)])  # fmt: skip
    assert res.exit_code in (0, 2), res.output  # pass, or inconclusive on 2 trials
    checks = json.loads(verdict.read_text())["checks"]
    assert {(c["point"], c["metric"]) for c in checks} == {(p, m) for p in ("c001", "c002") for m in ("inputs_s", "e2e_p50")}
    assert all(c["verdict"] in ("pass", "inconclusive") and c["baseline_mean"] > 0 for c in checks), checks
