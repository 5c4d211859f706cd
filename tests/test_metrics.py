import io

import numpy as np
import pytest

from loadgen.metrics import definitions as metrics
from loadgen.metrics import percentiles, pointsummary


def rec(sent, events, end, out=None, intended=None, cls="a", warmup=False, error=None, prompt=10):
    return {
        "id": "x", "cls": cls, "warmup": warmup, "intended": sent if intended is None else intended, "sent": sent,
        "headers": sent, "end": end, "status": 200, "error": error, "events": [list(e) for e in events],
        "prompt_tokens": prompt, "prompt_tokens_source": "usage",
        "output_tokens": sum(k for _, k in events) if out is None else out, "output_tokens_source": "usage",
    }


def test_ttft_tpot_e2e_and_from_intended():
    r = rec(1.0, [(1.5, 1), (1.6, 1), (1.8, 1), (2.0, 1)], 2.0, intended=0.5)
    assert metrics.ttft(r) == pytest.approx(0.5)
    assert metrics.e2e(r) == pytest.approx(1.0)
    assert metrics.tpot(r) == pytest.approx((1.0 - 0.5) / 3)
    s = pointsummary.summarize([r])
    assert s["latency"]["ttft_from_intended"]["mean"] == pytest.approx(1.0)
    assert s["latency"]["e2e_from_intended"]["mean"] == pytest.approx(1.5)


def test_one_token_answer_has_no_tpot():
    assert metrics.tpot(rec(0.0, [(0.2, 1)], 0.2)) is None


def test_itl_is_token_weighted_and_chunk_gaps_are_raw():
    # first event 1 token, then a 3-token event after 0.3 s, then a 1-token event after 0.1 s
    r = rec(0.0, [(0.1, 1), (0.4, 3), (0.5, 1)], 0.5)
    assert metrics.itl(r) == pytest.approx([0.1, 0.1, 0.1, 0.1])
    assert metrics.chunk_gaps(r) == pytest.approx([0.3, 0.1])
    s = pointsummary.summarize([r])
    assert s["latency"]["itl"]["count"] == 4
    assert s["latency"]["chunk_gap"]["mean"] == pytest.approx(0.2)
    assert s["latency"]["tpot"]["mean"] == pytest.approx(0.4 / 4)


def test_unresolved_none_token_deltas_count_one_token_each():
    r = rec(0.0, [(0.1, 1), (0.3, None), (0.4, 2), (0.6, None)], 0.6, out=5)
    assert metrics.itl(r) == pytest.approx([0.2, 0.05, 0.05, 0.2])
    s = pointsummary.summarize([r])
    assert s["latency"]["itl"]["count"] == 4
    assert s["throughput"]["steady"]["output_tok_per_s"] == pytest.approx(5 / 0.6)


def test_percentiles_match_numpy_linear():
    vals = [0.1, 0.5, 0.2, 0.9, 0.3, 0.7, 1.5]
    st = percentiles.stats(vals)
    for p in (50, 90, 95, 99):
        assert st[f"p{p}"] == pytest.approx(np.percentile(vals, p))
    assert st["max"] == 1.5 and st["count"] == 7 and st["mean"] == pytest.approx(np.mean(vals))
    assert percentiles.stats([])["p50"] is None


def test_steady_window_throughput_and_whole_run():
    # closed loop of 1: requests back to back, 1 s each, 10 tokens each (one per 0.1 s)
    recs = [rec(float(i), [(i + 0.1 * (j + 1), 1) for j in range(10)], i + 1.0) for i in range(5)]
    s = pointsummary.summarize(recs, {"process": "closed", "concurrency": 1})
    assert s["window"] == [1.0, 4.0]  # first send + one request length .. last send
    steady, whole = s["throughput"]["steady"], s["throughput"]["whole"]
    assert steady["valid"] and steady["reason"] is None and steady["note"] is None
    assert steady["output_tok_per_s"] == pytest.approx(10.0)
    assert steady["req_per_s"] == pytest.approx(1.0)
    assert steady["req_per_s_little"] == pytest.approx(1.0)
    assert steady["output_tok_per_s_events"] == pytest.approx(10.0)
    assert whole["req_per_s"] == pytest.approx(5 / 5)
    assert whole["total_tok_per_s"] == pytest.approx((50 + 50) / 5)
    assert s["client"]["achieved_concurrency"] == pytest.approx(1.0)
    assert s["client"]["warnings"] == []


def test_steady_window_starts_after_the_last_warmup_request():
    # closed loop of 2 (records of a run where a 3 s warm-up overlapped measured 1 s requests): the
    # window starts no earlier than the warm-up's end
    warm = {**rec(0.0, [(0.1 * (j + 1), 1) for j in range(30)], 3.0), "warmup": True}
    recs = [warm] + [rec(float(i), [(i + 0.1 * (j + 1), 1) for j in range(10)], i + 1.0) for i in range(8)]
    s = pointsummary.summarize(recs, {"process": "closed", "concurrency": 2})
    assert s["window"] == [3.0, 7.0]
    assert s["throughput"]["steady"]["output_tok_per_s"] == pytest.approx(10.0)
    # a warm-up that outlasts the dispatch leaves no steady state: whole run, valid = False
    s = pointsummary.summarize([{**warm, "end": 9.0}] + recs[1:])
    assert s["window"] == [0.0, 8.0] and not s["throughput"]["steady"]["valid"]
    assert s["throughput"]["steady"] == {**s["throughput"]["whole"], **{k: s["throughput"]["steady"][k] for k in (
        "valid", "reason", "note", "req_per_s_little", "req_per_s_completed", "output_tok_per_s_events")}}


def test_warmup_excluded_and_errors_by_kind():
    recs = [
        rec(0.0, [(0.1, 1)], 0.2, warmup=True),
        rec(0.1, [(0.2, 2)], 0.3),
        rec(0.2, [], 0.25, error={"kind": "http_5xx", "message": "x"}),
        rec(0.3, [], 0.35, error={"kind": "http_5xx", "message": "x"}),
        rec(0.4, [(0.5, 1)], 0.6, error={"kind": "disconnect", "message": "x"}),
    ]
    s = pointsummary.summarize(recs)
    assert s["counts"] == {"requests": 4, "ok": 1, "errors": 3, "incomplete": 0, "warmup": 1, "output_tokens": 2,
                           "prompt_tokens": 10, "output_tokens_sources": {"usage": 1}, "reasoning_tokens": 0}
    assert s["errors"]["rate"] == pytest.approx(0.75)
    assert s["errors"]["by_kind"] == {"disconnect": 1, "http_5xx": 2}
    assert s["latency"]["ttft"]["count"] == 1


def test_goodput_counts_requests_meeting_every_slo():
    fast = rec(0.0, [(0.1, 1), (0.2, 1)], 0.2)
    slow_ttft = rec(1.0, [(1.9, 1), (2.0, 1)], 2.0)
    slow_tpot = rec(2.0, [(2.1, 1), (3.0, 1)], 3.0)
    s = pointsummary.summarize([fast, slow_ttft, slow_tpot], slo={"ttft": 0.5, "tpot": 0.5})
    assert s["goodput"]["good"] == 1
    assert s["goodput"]["fraction"] == pytest.approx(1 / 3)
    assert metrics.meets_slo(slow_tpot, {"ttft": 0.5}) is True


def test_per_class_has_the_same_metrics():
    recs = [rec(0.0, [(0.1, 1), (0.3, 1)], 0.3, cls="short"), rec(0.0, [(0.5, 4)], 0.5, cls="long")]
    s = pointsummary.summarize(recs)
    assert set(s["per_class"]) == {"short", "long"}
    assert s["per_class"]["short"]["latency"]["ttft"]["mean"] == pytest.approx(0.1)
    assert s["per_class"]["long"]["counts"]["output_tokens"] == 4
    assert set(s["per_class"]["long"]) >= {"latency", "throughput", "errors", "counts"}


def test_client_health_flags_schedule_lag_and_rate_shortfall():
    # open loop at 100 req/s, but every request went out 20 ms late and the sends bunch up
    recs = [rec(0.01 * i + 0.02 + 0.01 * i, [(0.05 + 0.02 * i, 1)], 0.06 + 0.02 * i, intended=0.01 * i)
            for i in range(50)]
    c = pointsummary.summarize(recs, {"process": "poisson", "rate": 100})["client"]
    assert c["schedule_lag"]["p99"] > metrics.LAG_WARN_S
    assert c["achieved_rate"] == pytest.approx(50.0)
    assert c["scheduled_rate"] == pytest.approx(100.0)
    assert c["limited"] and len(c["warnings"]) == 2


def test_prefix_cache_hits_from_responses_else_server_counters_and_the_warning():
    """A point's prefix-cache hits come from the responses (measured, successful requests that said), else
    from the server's counters; a workload that shares nothing and got most of its prompt from the cache is
    warned about, one that shares on purpose (or cannot tell) is not."""
    warm = [{**rec(0.0, [(0.1, 1)], 0.2, prompt=100), "cached_tokens": 96} for _ in range(3)]
    cold = {**rec(0.0, [(0.1, 1)], 0.2, prompt=100), "cached_tokens": 0}
    silent = rec(0.0, [(0.1, 1)], 0.2, prompt=100)  # a server that did not say: left out, not counted as 0
    failed = {**rec(0.0, [], 0.2, error={"kind": "http", "message": "500"}), "cached_tokens": 100}
    s = pointsummary.summarize([*warm, cold, silent, failed])
    assert s["prefix_cache"] == {"source": "responses", "requests": 4, "cached_tokens": 288, "prompt_tokens": 400,
                                 "hit_rate": 0.72}  # fmt: skip
    for shares, warned in ((False, True), (True, False), (None, False)):
        point = pointsummary.summarize([*warm, cold])
        pointsummary.add_prefix_cache(point, shares)
        assert ("warning" in point["prefix_cache"]) is warned
    point = pointsummary.summarize([*warm, cold, cold, cold])  # 288 of 600: below CACHE_WARN
    pointsummary.add_prefix_cache(point, False)
    assert "warning" not in point["prefix_cache"]
    point = pointsummary.summarize([silent])
    point["server"] = {"point": {"prefix_cache": {"cached_tokens": 90.0, "prompt_tokens": 100.0, "hit_rate": 0.9}}}
    pointsummary.add_prefix_cache(point, False)
    assert point["prefix_cache"]["source"].startswith("server counters") and "--reset-cache" in point["prefix_cache"]["warning"]
    bare = pointsummary.summarize([silent])
    pointsummary.add_prefix_cache(bare, False)
    assert "prefix_cache" not in bare


def test_the_medians_interval_covers_it_and_a_wide_one_is_said():
    """stats' p50_lo..p50_hi (order statistics, no distribution assumed) holds the true median in at least
    95 % of samples; the run table's notes say when a TTFT p50 is too uncertain to repeat within 10 %."""
    from loadgen.cli.run import notes

    rng = np.random.default_rng(1)
    for n in (6, 16, 100, 2000):
        misses = sum(not (s["p50_lo"] <= np.log(2) <= s["p50_hi"])
                     for s in (percentiles.stats(rng.exponential(1.0, n)) for _ in range(2000)))  # fmt: skip
        assert misses <= 0.05 * 2000 * 1.2, (n, misses)  # 5 % at most, with room for the sample's own noise
    assert percentiles.stats([1.0, 2.0, 3.0])["p50_lo"] is None  # 3 values cannot bound the median at 95 %
    few = pointsummary.summarize([rec(0.0, [(t, 1)], 1.0) for t in (0.1, 0.2, 0.3, 0.5, 0.8, 0.9, 0.9, 1.0)])
    assert any("rests on 8 requests" in line for line in notes(few))
    tight = pointsummary.summarize([rec(0.0, [(0.5 + 0.001 * (i % 7), 1)], 1.0) for i in range(200)])
    assert not any("rests on" in line for line in notes(tight))


def test_prompt_lengths_compare_the_intended_with_the_servers_count():
    """Only requests with both an intended length (the workload's tokenizer) and the server's usage count;
    a gap over 2 % is a warning, a chat prompt (no intent: the template is the server's) is left out."""
    def r(intended, counted, source="usage"):
        return {**rec(0.0, [(0.1, 1)], 0.2, prompt=counted), "prompt_tokens_intended": intended,
                "prompt_tokens_source": source}  # fmt: skip

    exact = pointsummary.summarize([r(100, 100), r(200, 201), r(None, 50), r(300, 300, "tokenizer")])
    assert exact["prompt_lengths"] == {"requests": 2, "intended": 300, "counted": 301, "ratio": 301 / 300}
    off = pointsummary.summarize([r(100, 107), r(100, 107)])
    assert off["prompt_lengths"]["ratio"] == pytest.approx(1.07) and "+7.0%" in off["prompt_lengths"]["warning"]
    assert "prompt_lengths" not in pointsummary.summarize([r(None, 50)])


def test_every_registry_metric_is_at_its_path_in_a_summary_made_from_records():
    """Each registry metric names a figure where a PointSummary made from records holds it (a distribution's
    every stat), its tag resolves to it, and its formula is the one docs/metrics.md gives."""
    from pathlib import Path

    recs = [{**rec(0.1 * i, [(0.1 * i + 0.1 * (1 + i % 2), 1), (0.1 * i + 0.3, 2), (0.1 * i + 0.5, 1)], 0.1 * i + 0.6,
                   intended=0.1 * i - 0.001), "cached_tokens": 4} for i in range(20)]  # fmt: skip
    s = pointsummary.summarize(recs, load={"process": "closed", "concurrency": 4}, slo={"ttft": 0.15})
    # a pooling run's (embeddings: no content events, 3 inputs each) has inputs/s, and only it
    pooled = pointsummary.summarize([{**r, "events": [], "output_tokens": 0, "extra": {"inputs": 3}} for r in recs])
    assert pointsummary.pooling(pooled) and not pointsummary.pooling(s) and metrics.INPUTS_S.of(s) is None
    assert metrics.INPUTS_S.of(pooled) == pytest.approx(3 * metrics.REQ_S.of(pooled))
    assert pooled["counts"]["inputs"] == 60 and pooled["latency"]["ttft"]["count"] == 0
    docs = " ".join((Path(__file__).parents[1] / "docs" / "metrics.md").read_text().replace("`", "").split())
    for tag, m in metrics.REGISTRY.items():
        # the identical share is bench verify's, not a run's: its value is checked in tests/test_verify.py
        for stat in (percentiles.STAT_KEYS if m.distribution else (None,)) if m is not metrics.IDENTICAL else ():
            assert isinstance(m.of(pooled if m is metrics.INPUTS_S else s, stat), float), (tag, stat)
            assert metrics.resolve(f"{tag}_{stat}" if stat else tag) == (m, stat)
        assert m.doc in docs, tag
        assert m.unit in metrics.UNIT_WORDS
    assert set(metrics.LATENCIES) == set(s["latency"])  # every latency the summary computes, and no other
    assert metrics.GOODPUT.of(s) == pytest.approx(metrics.REQ_S.of(s) / 2)  # half of them are over the TTFT SLO
    with pytest.raises(KeyError):
        metrics.resolve("output_tok_s_p99")  # a scalar has no stats


def test_the_run_table_shows_the_registrys_labels_scales_and_units():
    """The run table's headings are the registry's labels (a label changed there changes the table), its
    latencies its shown unit (ms)."""
    from rich.console import Console

    from loadgen.cli.run import summary_table

    s = pointsummary.summarize([rec(0.0, [(0.25, 1), (0.5, 1)], 0.5)], load={"process": "closed", "concurrency": 1})

    def render() -> str:
        out = io.StringIO()
        Console(file=out, width=300).print(summary_table([{**s, "point_id": "c001"}]))
        return out.getvalue()

    before = render()
    assert "TTFT p50" in before and "250.0" in before and "latencies in ms" in before
    object.__setattr__(metrics.TTFT, "label", "first token")  # the registry is frozen: only a test relabels it
    try:
        after = render()
    finally:
        object.__setattr__(metrics.TTFT, "label", "TTFT")
    assert "first token p50" in after and "first token p99" in after and "TTFT" not in after
