"""Interleaved A/B trials against two real (null) SSE servers, gated end to end."""

from __future__ import annotations

from backends.openai import OpenAIBackend
from loadgen.dispatch.loadspec import LoadSpec
from loadgen.experiments.ab import abba, run_ab
from loadgen.experiments.calibrate import FixedWorkload
from loadgen.gate.compare import compare
from loadgen.gate.resultset import load
from loadgen.gate.rules import MetricRule

NULL = 'python -m loadgen.testservers.null --port {port} --behaviour \'{{"itl": %s, "ttft": 0.005}}\''
RULES = [MetricRule.parse("output_tok_s:-20%"), MetricRule.parse("e2e_p50:+25%")]


def _ab(tmp_path, itl_base: float, itl_cand: float, name: str):
    dirs = run_ab(
        {"baseline": NULL % itl_base, "candidate": NULL % itl_cand},
        lambda url: OpenAIBackend(url, model="null"),
        FixedWorkload(max_tokens=20),
        LoadSpec("closed", concurrency=2, num_requests=8, warmup=1),
        trials=5,
        out_root=tmp_path,
        run_id=name,
        config={"workloads": ["fixed"], "concurrency": [2]},
    )
    return compare(load(dirs["baseline"]), load(dirs["candidate"]), RULES)


def test_abba_order():
    assert abba(3) == [
        (0, "baseline"),
        (0, "candidate"),
        (1, "candidate"),
        (1, "baseline"),
        (2, "baseline"),
        (2, "candidate"),
    ]


def test_ab_same_server_passes_slower_server_is_a_regression(tmp_path):
    same = _ab(tmp_path, 0.002, 0.002, "same")
    # no false alarm; "pass" on a quiet machine, "inconclusive" is allowed when other jobs load it
    assert same.verdict in ("pass", "inconclusive"), [(c.metric, c.ci, c.reason) for c in same.checks]
    slow = _ab(tmp_path, 0.002, 0.006, "slow")  # ~3x the inter-token time
    assert slow.verdict == "regression"
    assert all(c.verdict == "regression" for c in slow.checks)
    assert all(c.n_baseline == c.n_candidate == 5 for c in slow.checks)
    base = load(tmp_path / "slow-baseline")
    assert base.paired and sorted(base.points) == ["c002"]
    assert (tmp_path / "slow-candidate" / "points" / "c002" / "t4" / "requests.jsonl").exists()
