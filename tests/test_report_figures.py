"""The HTML report's figures: the numeric transforms (occupancy, rates, CDF, knee), latencies and the Gantt
sample, the timeline's rows, the server and GPU series, the sweep charts (the page itself: test_report.py)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from support.synthetic import SimConfig, write_synthetic_results

from loadgen.metrics import definitions as metrics
from loadgen.report import series, server_series, sweep_chart, timeline
from loadgen.report.load import load_run, read_jsonl, requests_from_records


def _brute_occupancy(starts, ends, edges, samples=4000):
    out = []
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        t = np.linspace(a, b, samples, endpoint=False) + (b - a) / samples / 2
        out.append(((starts[:, None] <= t) & (t < ends[:, None])).sum(axis=0).mean())
    return np.array(out)


def test_mean_occupancy_is_the_exact_time_average():
    rng = np.random.default_rng(3)
    starts = rng.uniform(0, 10, 200)
    ends = starts + rng.exponential(1.5, 200)
    edges = series.time_edges(0, 12, max_bins=24)
    assert edges[0] <= 0 and edges[-1] >= 12 and len(edges) - 1 <= 24
    exact = series.mean_occupancy(starts, ends, edges)
    assert np.allclose(exact, _brute_occupancy(starts, ends, edges), atol=0.05)
    # integral over all bins = total busy time
    assert np.isclose((exact * np.diff(edges)).sum(), np.clip(ends, None, edges[-1]).sum() - starts.sum())


def test_binned_rate_and_mean():
    edges = np.array([0.0, 0.5, 1.0, 1.5])
    t = np.array([0.1, 0.2, 0.7, 1.2, 9.0])  # 9.0 falls outside
    w = np.array([1.0, 3.0, 2.0, 5.0, 7.0])
    assert np.allclose(series.binned_rate(t, w, edges), [8.0, 4.0, 10.0])
    m = series.binned_mean(np.array([0.1, 0.2, 1.2]), np.array([2.0, 4.0, 6.0]), edges)
    assert np.allclose(m[[0, 2]], [3.0, 6.0]) and np.isnan(m[1])


def test_cdf_is_monotonic_and_keeps_the_ends():
    v = np.random.default_rng(0).lognormal(size=5000)
    x, p = series.cdf(v, max_points=100)
    assert len(x) <= 100 and x[0] == v.min() and x[-1] == v.max() and p[-1] == 1.0
    assert np.all(np.diff(x) >= 0) and np.all(np.diff(p) > 0)


def test_knee_is_where_latency_turns_up():
    thr = [100, 200, 300, 380, 400, 405]
    lat = [1.0, 1.05, 1.1, 1.3, 3.0, 9.0]
    assert series.knee_index(thr, lat) == 3
    assert series.knee_index([1, 2, 3, 4], [1, 2, 3, 4]) is None  # a straight line has no knee
    assert series.knee_index([1, 2], [1, 5]) is None


def test_latencies_match_the_metrics_module(run_dir):
    records = read_jsonl(run_dir / "points" / "c004" / "requests.jsonl")
    req = requests_from_records(records)
    lat = series.latencies(req)
    measured = [r for r in records if not r["warmup"]]
    ok = [r for r in measured if r["error"] is None]
    assert lat["ok"].sum() == len(ok) and len(req) == len(measured)
    assert np.allclose(np.sort(lat["ttft"][lat["ok"]]), np.sort([metrics.ttft(r) for r in ok]))
    assert np.allclose(np.sort(lat["tpot"][lat["ok"]]), np.sort([metrics.tpot(r) for r in ok]))
    assert np.allclose(np.sort(lat["itl"]), np.sort(np.concatenate([metrics.itl(r) for r in ok])))


def test_gantt_sample_keeps_errors_and_send_order(run_dir):
    req = load_run(run_dir).points[-1].requests
    idx = series.gantt_sample(req, 40)
    errors = {i for i, e in enumerate(req.error) if e is not None}
    assert 0 < len(errors) and errors <= set(idx.tolist())
    assert len(idx) <= 40 + len(errors)
    assert np.all(np.diff(req.sent[idx]) >= 0)


def test_timeline_rows_share_one_x_axis_and_follow_the_data(run_dir):
    run = load_run(run_dir)
    fig = timeline.timeline(run, run.points[1])
    # linked x axes, zooming one row zooms all: every row's axis is the bottom one or matches it
    layout = fig["layout"]
    assert len({layout["xaxis" + t["xaxis"][1:]].get("matches", t["xaxis"]) for t in fig["data"]}) == 1
    titles = [a["text"] for a in fig["layout"]["annotations"]]
    for expected in (
        "requests (client)",
        "server batch",
        "tokens per engine step",
        "KV cache",
        "utilisation",
        "output tokens/s",
        "requests (Gantt",
    ):
        assert any(expected in t for t in titles), expected
    names = {t["name"] for t in fig["data"]}
    assert {
        "running (/metrics)",
        "waiting (/metrics)",
        "running (engine steps, mean)",
        "error",
        "decode",
        "prefill / TTFT",
        "host CPU % (mean of cores)",
        "KV cache % (/metrics)",
    } <= names
    # client-side output token rate integrates back to the tokens that were streamed
    rate = next(t for t in fig["data"] if t["name"] == "output tok/s")
    width = rate["x"][1] - rate["x"][0]
    assert np.isclose(np.sum(rate["y"]) * width, run.points[1].requests.event_tokens.sum())
    # engine steps (unix step ends in iterations.jsonl) land on the run clock: each step's end is followed
    # within a millisecond by the token events it produced
    it = server_series.iteration_arrays(run.points[1], run.run["t0_unix"])
    ev = np.sort(run.points[1].requests.event_t)
    after = ev[np.minimum(np.searchsorted(ev, it["t"]), len(ev) - 1)] - it["t"]
    assert np.all((after >= 0) & (after < 1e-3))


def test_preemptions_are_marked(run_dir, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(run_dir, d)
    path = d / "points" / "c004" / "iterations.jsonl"
    rows = read_jsonl(path)
    rows[10]["preempted"] = ["a", "b"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = load_run(d)
    fig = timeline.timeline(run, run.points[1])
    pre = next(t for t in fig["data"] if t["name"] == "preemption")
    assert pre["text"].tolist() == [2.0] and pre["x"][0] == pytest.approx(
        rows[10]["t_end_unix"] - run.run["t0_unix"]
    )


def test_gpu_memory_power_and_clock_get_rows_of_their_own(tmp_path):
    """Each GPU's NVML memory, power and SM clock are drawn in their units (one row each, a line per GPU)
    beside its utilisation %; a run without GPUs has none of these rows."""
    run = load_run(write_synthetic_results(tmp_path, "gpu", SimConfig(seed=3, gpus=2)))
    point = run.points[0]
    rows = server_series.gpu_series(point)
    assert set(rows) == {"GPU memory used, GiB", "GPU power, W", "GPU SM clock, MHz"}
    t, mem = rows["GPU memory used, GiB"]["GPU 1"]
    assert len(t) == len(point.telemetry) and np.allclose(mem, 70 + 2**-30)
    assert np.allclose(rows["GPU SM clock, MHz"]["GPU 0"][1], 1980.0)
    fig = timeline.timeline(run, point)
    titles = [a["text"] for a in fig["layout"]["annotations"]]
    assert all(any(title in a for a in titles) for title in rows)
    names = [tr["name"] for tr in fig["data"]]
    assert names.count("GPU 0") == 3 == names.count("GPU 1") and "GPU 1 util %" in names
    bare = load_run(write_synthetic_results(tmp_path, "cpu", SimConfig(seed=3)))
    assert server_series.gpu_series(bare.points[0]) == {}


def test_server_state_from_llama_slots_and_failed_scrapes(run_dir, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(run_dir, d)
    rows = [
        {"t": 1.0, "error": "ConnectError: refused", "latency_s": 0.002},
        {
            "t": 1.1,
            "metrics": {"llamacpp:requests_deferred": 3.0},
            "slots": [{"id": 0, "busy": True}, {"id": 1, "busy": False}],
        },
        {
            "t": 1.2,
            "metrics": {"llamacpp:requests_deferred": 1.0},
            "slots": [{"id": 0, "busy": True}, {"id": 1, "busy": True}],
        },
    ]
    (d / "points" / "c001" / "server_state.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    srv = server_series.server_series(load_run(d).points[0])
    assert srv["running"][1].tolist() == [1.0, 2.0] and srv["waiting"][1].tolist() == [3.0, 1.0]
    assert "kv" not in srv


def test_sweep_draws_only_panels_with_data(run_dir, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(run_dir, d)
    summary = json.loads((d / "summary.json").read_text())
    for p in summary["points"]:
        del p["goodput"]  # a run without --slo
    (d / "summary.json").write_text(json.dumps(summary))
    fig = sweep_chart.sweep([load_run(d)])
    assert {t["xaxis"] for t in fig["data"]} == {"x", "x2"}
    assert "xaxis3" not in fig["layout"] and fig["layout"]["xaxis2"]["domain"][1] > 0.9
    assert [a["text"] for a in fig["layout"]["annotations"]] == [
        "<b>throughput vs load</b>",
        "<b>latency vs throughput (solid line: p50 · dashed line: p99)</b>",
    ]


def test_sweep_has_a_curve_per_workload_and_load_kind(run_dir, tmp_path):
    import copy

    d = tmp_path / "run"
    shutil.copytree(run_dir, d)
    summary = json.loads((d / "summary.json").read_text())
    points = []
    for wl in ("chat", "rag"):
        for p in summary["points"]:
            q = copy.deepcopy(p)
            q["workload"] = {"name": wl}
            q["point_id"] = f"{wl}/{p['point_id']}"
            points.append(q)
    for rate in (5.0, 2.0):
        q = copy.deepcopy(summary["points"][0])
        q["workload"] = {"name": "chat"}
        q["load"].update(process="poisson", concurrency=None, rate=rate)
        q["point_id"] = f"chat/r{rate:05.1f}"
        points.append(q)
    summary["points"] = points
    (d / "summary.json").write_text(json.dumps(summary))
    fig = sweep_chart.sweep([load_run(d)])
    lines = {t["name"]: t["x"] for t in fig["data"] if t["xaxis"] == "x"}
    assert lines == {
        "full chat concurrency": [1, 4, 16],
        "full rag concurrency": [1, 4, 16],
        "full chat rate": [2.0, 5.0],
    }


@pytest.mark.parametrize("backend", ["openai", "vllm", "llamacpp", "sglang", "tgi"])
def test_server_series_read_each_servers_names_from_its_profile(backend):
    """The report knows no vendor by name: every server's gauges, named on its backend's profile (the bundled
    reference server's included, which counts KV blocks), become the timeline's running / waiting / KV rows."""
    from backends.profile import REFERENCE_PROFILE, profile_of
    from backends.registry import get_backend
    from loadgen.report.load import PointData

    profile = REFERENCE_PROFILE if backend == "openai" else profile_of(get_backend(backend))
    metrics: dict[str, float] = {profile.running[0]: 3.0, profile.waiting[0]: 2.0}
    if profile.kv_usage:
        metrics[profile.kv_usage[0]] = 0.25
    if profile.kv_blocks:
        metrics |= {profile.kv_blocks[0]: 48.0, profile.kv_blocks[1]: 192.0}
    rows = [{"t": 1.0, "metrics": metrics}, {"t": 2.0, "metrics": metrics}]
    srv = server_series.server_series(PointData("p", {}, requests_from_records([]), server_state=rows))
    assert srv["running"][1].tolist() == [3.0, 3.0] and srv["waiting"][1].tolist() == [2.0, 2.0]
    kv = srv["kv"][1].tolist() if "kv" in srv else None
    assert kv == ([25.0, 25.0] if profile.kv_usage or profile.kv_blocks else None)
