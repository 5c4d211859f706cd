"""Metrics on constructed request timelines with known true rates and latencies (issue 18's cases).

Each timeline is built from exact send times and request lengths, so the true steady rates are known:
closed loop (c / mean request length), open loop (the realised arrival rate), one wave (no steady state),
short runs, warm-ups with a cold first wave, coalesced reads, zero-token events, cancelled requests and
tails after the last token. The report's series must equal the summary's values.
"""

import itertools

import numpy as np
import pytest

from backends.profile import ServerProfile
from loadgen.metrics import definitions as metrics
from loadgen.metrics import percentiles, pointsummary
from loadgen.report import series
from loadgen.report.load import requests_from_records
from loadgen.sidecars import telemetry
from loadgen.sidecars.poller import reconcile
from loadgen.timing.arrivals import arrival_times

TOL = 0.02  # steady figures within 2 % of the true rates wherever the window is valid


def req(sent, ttft, length, out, *, warmup=False, tail=0.0, prompt=32, intended=None, error=None):
    """A request sent at ``sent``: first token after ``ttft``, the other ``out - 1`` evenly until
    ``sent + length`` (its last content event), the body ending ``tail`` later."""
    first, last = sent + ttft, sent + length
    times = [first, *np.linspace(first, last, out)[1:]] if out > 1 else [first]
    return {
        "id": "r", "cls": "a", "warmup": warmup, "intended": sent if intended is None else intended, "sent": sent,
        "headers": sent, "end": last + tail, "status": 200, "error": error, "events": [[float(t), 1] for t in times],
        "prompt_tokens": prompt, "prompt_tokens_source": "usage", "output_tokens": out,
        "output_tokens_source": "usage", "event_tokens": "stated",
    }  # fmt: skip


def closed_loop(c, lengths, *, ttft=0.4, out=128, start=0.0, warmup=0, cold_ttft=None):
    """``c`` slots; each next request starts when a slot frees. The first ``warmup`` are warm-ups."""
    slots = [start] * c
    recs = []
    for i, length in enumerate(lengths):
        j = int(np.argmin(slots))
        t = slots[j]
        first_wave = cold_ttft is not None and i < c
        recs.append(req(t, cold_ttft if first_wave else ttft, length, out, warmup=i < warmup))
        slots[j] = t + length
    return recs


def steady(recs):
    s = pointsummary.summarize(recs)
    return s, s["throughput"]["steady"]


def test_one_wave_has_no_steady_state_and_reports_the_whole_run():
    # c = N = 64: sends spread over 19 ms, TTFT 0.4 s, E2E 5 s, 128 tokens each
    recs = [req(i * 0.019 / 63, 0.4, 5.0, 128) for i in range(64)]
    s, st = steady(recs)
    assert st["valid"] is False and "less than one request length" in st["reason"]
    assert st["req_per_s"] == pytest.approx(64 / 5.019, rel=1e-6) == s["throughput"]["whole"]["req_per_s"]
    assert st["output_tok_per_s"] == pytest.approx(64 * 128 / 5.019, rel=1e-6)  # 1,632 tok/s, not 0
    # no steady state: the whole run's concurrency (ramp and drain included) is not judged as client-limited
    c = pointsummary.summarize(recs, {"process": "closed", "concurrency": 64})["client"]
    assert c["achieved_concurrency"] < 64 and c["warnings"] == []


def test_open_loop_constant_rate_starts_after_the_fill():
    # 10 req/s for 60 s, every request 10 s long, 100 tokens: true 10 req/s and 1,000 tok/s
    recs = [req(i / 10, 0.5, 10.0, 100) for i in range(600)]
    s, st = steady(recs)
    assert st["valid"] and s["window"][0] == pytest.approx(10.0)  # one request length after the first send
    assert st["req_per_s"] == pytest.approx(10.0, rel=TOL)
    assert st["output_tok_per_s"] == pytest.approx(1000.0, rel=TOL)
    assert st["req_per_s_little"] == pytest.approx(10.0, rel=TOL) and st["note"] is None


@pytest.mark.parametrize("process,shape", [("constant", 1.0), ("poisson", 1.0), ("gamma", 0.25)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_open_loop_arrivals_constant_poisson_and_bursty_gamma(process, shape, seed):
    times = np.fromiter(itertools.islice(arrival_times(process, 20.0, seed, shape), 3000), float)
    rng = np.random.default_rng(seed)
    recs = [req(float(t), 0.3, float(rng.uniform(1, 3)), int(rng.integers(50, 150))) for t in times]
    true_rate = (len(times) - 1) / (times[-1] - times[0])  # the realised arrival rate
    _, st = steady(recs)
    assert st["valid"]
    assert st["req_per_s"] == pytest.approx(true_rate, rel=TOL)
    assert st["output_tok_per_s"] == pytest.approx(true_rate * np.mean([r["output_tokens"] for r in recs]), rel=TOL)
    assert st["total_tok_per_s"] == pytest.approx(st["output_tok_per_s"] + 32 * st["req_per_s"], rel=1e-9)


@pytest.mark.parametrize("seed", range(5))
def test_short_closed_loop_rate_is_not_biased_by_the_first_wave(seed):
    # c = 16, 48 requests, E2E uniform 4-6 s, 128 tokens: true rate = c / mean length (3.2 req/s, 410 tok/s)
    lengths = np.random.default_rng(seed).uniform(4, 6, 48)
    _, st = steady(closed_loop(16, lengths))
    true_rate = 16 / lengths.mean()
    assert st["valid"]
    assert st["req_per_s"] == pytest.approx(true_rate, rel=TOL)
    assert st["output_tok_per_s"] == pytest.approx(true_rate * 128, rel=TOL)
    assert st["req_per_s_little"] == pytest.approx(true_rate, rel=TOL)


def test_long_closed_loop():
    lengths = np.random.default_rng(9).uniform(1, 3, 800)
    s, st = steady(closed_loop(8, lengths))
    assert st["valid"] and st["req_per_s"] == pytest.approx(8 / lengths.mean(), rel=TOL)
    assert s["client"]["achieved_concurrency"] == pytest.approx(8.0, rel=TOL)


def test_isolated_warmups_keep_the_cold_wave_out_of_latency_and_throughput():
    # c = 8, 2 warm-ups that ran (as the engine now runs them) in their own phase with a 3 s TTFT; every
    # measured request starts after them with a 0.3 s TTFT
    warm = [req(0.0, 3.0, 5.0, 128, warmup=True) for _ in range(2)]
    measured = closed_loop(8, [2.0] * 64, ttft=0.3, start=5.0)
    s, st = steady(warm + measured)
    assert s["latency"]["ttft"]["p99"] == pytest.approx(0.3) and s["latency"]["ttft"]["p90"] == pytest.approx(0.3)
    assert s["counts"]["warmup"] == 2 and s["counts"]["requests"] == 64
    assert st["valid"] and st["req_per_s"] == pytest.approx(4.0, rel=TOL)
    # whole = vLLM's definition: measured completions / (last end - first measured send); no warm-up time
    assert s["throughput"]["whole"]["req_per_s"] == pytest.approx(64 / 16.0, rel=1e-9)


def test_overlapping_warmups_move_the_window_start():
    # older records: 2 warm-ups overlapping the measured first wave; the window starts after them
    warm = [req(0.0, 3.0, 6.0, 128, warmup=True) for _ in range(2)]
    measured = closed_loop(6, [2.0] * 60, start=0.0)
    s = pointsummary.summarize(warm + measured)
    assert s["window"][0] == pytest.approx(6.0)


def test_coalesced_reads_are_merged_before_dividing_gaps():
    # events at 0.4, then 0.6 and 0.6 (two events parsed from one socket read)
    r = req(0.0, 0.4, 0.6, 3)
    r["events"] = [[0.4, 1], [0.6, 1], [0.6, 1]]
    t, k = metrics.reads(r)
    assert t.tolist() == [0.4, 0.6] and k.tolist() == [1, 2]
    assert metrics.itl(r) == pytest.approx([0.1, 0.1])
    assert metrics.chunk_gaps(r) == pytest.approx([0.2])
    assert metrics.tpot(r) == pytest.approx(0.1)
    # a first read carrying 3 tokens: TPOT divides by the tokens after it
    r["events"] = [[0.4, 1], [0.4, 2], [0.6, 1], [0.8, 1]]
    r["output_tokens"] = 5
    assert metrics.tpot(r) == pytest.approx(0.4 / 2)


def test_zero_token_events_never_swallow_time():
    r = req(0.0, 0.1, 0.5, 3)
    r["events"] = [[0.1, 0], [0.2, 1], [0.3, 0], [0.4, 1], [0.5, 1]]
    vals = metrics.itl(r)
    assert vals.sum() == pytest.approx(0.4)  # the whole span from the first to the last content event
    assert vals == pytest.approx([0.1, 0.2, 0.1])
    assert metrics.tpot(r) == pytest.approx(0.4 / 3) == pytest.approx(vals.mean())


def test_tail_after_the_last_token_is_not_latency():
    # a 2-token answer, tokens at 0.1 and 0.12 s, then a 15 ms tail (usage chunk, [DONE], end of body)
    r = req(0.0, 0.1, 0.12, 2, tail=0.015)
    assert metrics.tpot(r) == pytest.approx(0.02)  # vLLM and AIPerf: 20 ms, not 35 ms
    assert metrics.e2e(r) == pytest.approx(0.12)
    assert metrics.tail(r) == pytest.approx(0.015)
    s = pointsummary.summarize([r])
    assert s["latency"]["tail"]["p50"] == pytest.approx(0.015)


def test_cancelled_requests_are_incomplete_not_errors():
    cancelled = {"kind": "cancelled", "message": "run interrupted"}
    recs = [req(float(i), 0.1, 1.0, 10) for i in range(8)]
    recs += [req(8.0, 0.1, 5.0, 10, error=cancelled), req(8.5, 0.1, 4.5, 3, error=cancelled)]
    recs += [req(9.0, 0.1, 0.2, 1, error={"kind": "http_5xx", "message": "x"})]
    s = pointsummary.summarize(recs, slo={"ttft": 0.5})
    assert s["counts"]["ok"] == 8 and s["counts"]["errors"] == 1 and s["counts"]["incomplete"] == 2
    assert s["errors"]["rate"] == pytest.approx(1 / 9)  # ok + errors; the harness's cancellations left out
    assert s["errors"]["by_kind"] == {"http_5xx": 1}
    assert s["goodput"]["fraction"] == pytest.approx(8 / 9)
    assert s["latency"]["incomplete_age"]["max"] == pytest.approx(5.0)  # a lower bound on their latency


def test_slo_from_intended_counts_the_clients_lateness():
    # sent 0.4 s after its intended time, TTFT 0.2 s: good from the send, late from the intended time
    r = req(1.4, 0.2, 1.0, 10, intended=1.0)
    assert metrics.meets_slo(r, {"ttft": 0.5}) is True
    assert metrics.meets_slo(r, {"ttft": 0.5}, slo_from="intended") is False
    s = pointsummary.summarize([r], slo={"ttft": 0.5}, slo_from="intended")
    assert s["goodput"]["good"] == 0 and s["goodput"]["slo_from"] == "intended"
    with pytest.raises(ValueError, match="slo_from"):
        pointsummary.summarize([r], slo_from="late")


def test_report_series_equal_the_summary():
    recs = closed_loop(4, np.random.default_rng(3).uniform(0.5, 1.5, 40), ttft=0.1, out=20)
    recs[5]["events"] = [[e[0], 0 if i % 3 == 1 else e[1]] for i, e in enumerate(recs[5]["events"])]  # zero-token events
    recs[6]["events"][3][0] = recs[6]["events"][2][0]  # a coalesced read
    recs[7]["error"] = {"kind": "cancelled", "message": "x"}
    s = pointsummary.summarize(recs)
    lat = series.latencies(requests_from_records(recs))
    ok = lat["ok"]
    for key in ("ttft", "tpot", "e2e"):
        vals = lat[key][ok & np.isfinite(lat[key])]
        assert percentiles.stats(vals) == pytest.approx(s["latency"][key]), key
    assert percentiles.stats(lat["itl"]) == pytest.approx(s["latency"]["itl"])


def test_poller_and_telemetry_use_the_one_percentile_method():
    lat = [0.001 * x for x in (5, 1, 9, 3, 7, 2, 8, 4, 6, 10, 30)]
    samples = [{"t": float(i), "latency_s": v, "metrics": {}} for i, v in enumerate(lat)]
    got = reconcile(samples, set(), ServerProfile(), None)["scrape_latency_ms"]
    st = percentiles.stats(lat)
    assert got == {k: pytest.approx(round(st[k] * 1e3, 3)) for k in ("p50", "p99", "max")}
    recs = [{"t": float(i), "mem_used_b": v} for i, v in enumerate(lat)]
    mem = telemetry.summarize(recs, None)["mem_used_b"]
    assert mem == {"mean": pytest.approx(st["mean"]), "max": pytest.approx(st["max"])}


def test_cli_table_shows_incomplete_and_marks_a_run_without_steady_state():
    from rich.console import Console

    from loadgen.cli.run import notes, summary_table

    cancelled = {"kind": "cancelled", "message": "run interrupted"}
    recs = [req(i * 0.019 / 63, 0.4, 5.0, 128) for i in range(64)] + [req(0.02, 0.4, 6.0, 50, error=cancelled)]
    s = {"point_id": "c064", **pointsummary.summarize(recs, {"process": "closed", "concurrency": 65})}
    console = Console(width=250, record=True)
    console.print(summary_table([s]))
    text = console.export_text()
    assert " inc " in text and f"{s['throughput']['steady']['req_per_s']:.2f}*" in text
    row = [c.strip() for c in next(line for line in text.splitlines() if "c064" in line).split("│")]
    assert row[2:5] == ["64", "0", "1"]  # ok, err, inc
    lines = notes(s)
    assert any("no steady state" in n for n in lines) and any("1 request(s) cancelled" in n for n in lines)
