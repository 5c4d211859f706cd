"""`--workers N`: one load point split over worker processes, against the null server on loopback."""

import asyncio
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from support.service_models import LIVE
from support.signals import sigint_default

from backends.openai import OpenAIBackend
from loadgen.cli.run import point_outcome
from loadgen.cli.targets import load_workload
from loadgen.dispatch.engine import PointOptions, run_point
from loadgen.dispatch.fleet import Fleet
from loadgen.dispatch.loadspec import LoadSpec, Share
from loadgen.exitcodes import ExitCode
from loadgen.experiments.calibrate import SERVER_BUSY, FixedWorkload
from loadgen.metrics import pointsummary
from loadgen.timing.clock import RunClock
from workloads.contracts import read_jsonl

ROOT = Path(__file__).resolve().parents[1]


async def point(url, out, load, workers, wl=None, **body):
    wl = wl or FixedWorkload(max_tokens=4, extra_bodies=[{"nullserver": body}] if body else [{}])
    s = await run_point(OpenAIBackend(url, model="null"), wl, load, out, RunClock(),
                        options=PointOptions(fleet=Fleet(workers)))
    return s, read_jsonl(out / "requests.jsonl")


def test_share_deals_sessions_and_parts():
    shares = [Share(k, 3) for k in range(3)]
    assert [[i for i in range(10) if s.mine(i)] for s in shares] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert [s.part(10) for s in shares] == [4, 3, 3] and sum(s.part(7) for s in shares) == 7
    load = LoadSpec("closed", concurrency=5, num_requests=11)
    assert [load.part(s).concurrency for s in shares] == [2, 2, 1]
    assert load.workers(8) == 5 and LoadSpec("poisson", rate=5, num_requests=2).workers(4) == 2


async def test_open_loop_schedule_is_the_single_process_one(null_server, tmp_path):
    """For one seed, two workers send the measured requests at the same intended times (from the start of
    the measured phase) as one process does, each request once: the schedule was dealt, not redrawn."""
    load = LoadSpec("poisson", rate=150, num_requests=80, warmup=6, seed=7)
    runs = {}
    for n in (1, 2):
        s, recs = await point(null_server, tmp_path / str(n), load, n)
        assert s["counts"]["errors"] == 0 and s["counts"]["ok"] == 80 and s["workers"]["count"] == n
        measured = [r for r in recs if not r["warmup"]]
        runs[n] = (sorted(round(r["intended"] - s["t_measured"], 9) for r in measured),
                   sorted(r["id"] for r in measured), sorted(r["id"] for r in recs if r["warmup"]))  # fmt: skip
    assert runs[1] == runs[2]
    w = [read_jsonl(tmp_path / "2" / "workers" / f"w{k}.jsonl") for k in (0, 1)]
    assert [len(x) for x in w] == [43, 43]  # 3 warm-ups + 40 measured each, dealt alternately
    assert {int(r["id"][1:]) % 2 for r in w[1]} == {1}


async def test_closed_loop_concurrency_is_the_requested_total(null_server, tmp_path):
    s, recs = await point(null_server, tmp_path, LoadSpec("closed", concurrency=6, num_requests=150), 2,
                          itl=0.005)  # fmt: skip
    assert s["counts"]["errors"] == 0 and s["counts"]["ok"] == 150
    assert [w["lost"] for w in s["workers"]["per_worker"]] == [None, None]
    edges = sorted([(r["sent"], 1) for r in recs] + [(r["end"], -1) for r in recs], key=lambda e: (e[0], e[1]))
    inflight = peak = 0
    for _, d in edges:
        inflight += d
        peak = max(peak, inflight)
    assert peak == 6  # 3 slots per worker, never more in flight together
    assert s["client"]["requested_concurrency"] == 6 and s["client"]["achieved_concurrency"] > 0.8 * 6


async def test_multi_turn_sessions_stay_on_one_worker_in_order(null_server, tmp_path):
    wl = load_workload("multiturn-chat", None)
    s, recs = await point(null_server, tmp_path, LoadSpec("closed", concurrency=4, num_requests=40), 2, wl=wl)
    assert s["counts"]["errors"] == 0 and s["counts"]["ok"] == 40
    where = {}
    for k in (0, 1):
        for r in read_jsonl(tmp_path / "workers" / f"w{k}.jsonl"):
            assert where.setdefault(r["session"], k) == k  # a session's turns all on one worker
    turns = defaultdict(list)
    for r in sorted(recs, key=lambda r: r["sent"]):
        turns[r["session"]].append(r)
    assert any(len(t) > 1 for t in turns.values()) and len(set(where.values())) == 2
    for t in turns.values():
        assert [r["turn"] for r in t] == list(range(len(t)))
        assert all(a["end"] <= b["sent"] for a, b in zip(t, t[1:], strict=False))  # the next turn after the last answer


async def test_killed_worker_is_reported_and_records_kept(null_server, tmp_path):
    """SIGKILL one of two workers mid-point: the other runs its share to the end, the dead one's records up
    to its death are kept in the merged file, the summary names it, and the point's exit code is non-zero."""
    load = LoadSpec("closed", concurrency=4, num_requests=300, timeout=30)
    task = asyncio.ensure_future(point(null_server, tmp_path, load, 2, itl=0.01))
    w1 = tmp_path / "workers" / "w1.jsonl"
    for _ in range(1200):
        if w1.exists() and w1.read_bytes().count(b"\n") >= 10:
            break
        await asyncio.sleep(0.05)
    (victim,) = [p for p in multiprocessing.active_children() if p.name == "bench-worker-1"]
    os.kill(victim.pid, signal.SIGKILL)
    s, recs = await task
    before = len(read_jsonl(w1))
    assert before >= 10 and s["counts"]["errors"] == 0
    assert [w["index"] for w in s["workers"]["lost"]] == [1] and "SIGKILL" in s["workers"]["lost"][0]["reason"]
    assert len(read_jsonl(tmp_path / "workers" / "w0.jsonl")) == 150 and len(recs) == 150 + before
    code, message = point_outcome(s, 0.05)
    assert code == ExitCode.FAILED and "worker 1" in message


def test_bench_run_summary_is_the_one_recomputed_from_the_merged_records(null_server, tmp_path):
    """`bench run --workers 2`: one summary, equal to the metrics recomputed from the merged requests.jsonl."""
    args = ["run", "--url", null_server, "--rate", "120", "--num-requests", "90", "--workers", "2", "--seed", "3",
            "--output-dir", str(tmp_path), "--run-id", "w2", "--poll-hz", "0", "--telemetry-hz", "0"]  # fmt: skip
    out = subprocess.run([sys.executable, "-c", "from loadgen.cli.app import main; main()", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    (s,) = json.loads((tmp_path / "w2" / "summary.json").read_text())["points"]
    assert s["counts"]["errors"] == 0 and s["counts"]["ok"] == 90 and s["workers"]["count"] == 2
    recs = read_jsonl(tmp_path / "w2" / "points" / s["point_id"] / "requests.jsonl")
    again = json.loads(json.dumps(pointsummary.summarize(recs, s["load"]), default=str))
    for key, value in again.items():
        if key != "client":
            assert s[key] == value, key
    cpu = ("cpu", "cpu_wait", "limited", "warnings")  # the client's CPU use is not in the records
    assert {k: v for k, v in s["client"].items() if k not in cpu} == {k: v for k, v in again["client"].items() if k not in cpu}


def test_ctrl_c_stops_every_worker_and_leaves_one_summary(null_server, tmp_path):
    """SIGINT to `bench run --workers 2` (the coordinator only, as a terminal's Ctrl-C is, the workers being in
    their own process group): passed on to both workers, which cancel what is in flight; exit 130 with the
    merged records and one summary marked interrupted."""
    args = ["run", "--url", null_server, "--concurrency", "4", "--num-requests", "100000", "--workers", "2",
            "--output-dir", str(tmp_path), "--run-id", "sig", "--poll-hz", "0", "--telemetry-hz", "0",
            "--extra-body", '{"nullserver": {"itl": 0.01}}']  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", "from loadgen.cli.app import main; main()", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=sigint_default)  # fmt: skip
    point_dir = tmp_path / "sig" / "points" / "c004"
    deadline = time.monotonic() + 120
    while not all((point_dir / "workers" / f"w{k}.jsonl").exists() for k in (0, 1)) or sum(
        (point_dir / "workers" / f"w{k}.jsonl").read_bytes().count(b"\n") for k in (0, 1)) < 20:  # fmt: skip
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode() if proc.stdout else ""
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == ExitCode.INTERRUPTED, out.decode()
    (point,) = json.loads((tmp_path / "sig" / "summary.json").read_text())["points"]
    recs = read_jsonl(point_dir / "requests.jsonl")
    i = point["interrupted"]
    assert point["status"] == "interrupted" and point["workers"]["lost"] == [] and i["finished"] >= 20
    assert i["finished"] + i["cancelled"] == len(recs) and 1 <= i["cancelled"] <= 4
    assert {r["error"]["kind"] for r in recs if r["error"]} == {"cancelled"}


async def test_calibrate_reports_the_ceiling_per_worker_count(tmp_path):
    from loadgen.experiments.calibrate import calibrate

    res = await calibrate(tmp_path, concurrency=8, events=4, num_requests=200, rate=40, duration=1, workers=(1, 2))
    rows = res["scaling"]
    assert [r["workers"] for r in rows] == [1, 2] and res["closed"] == rows[0] and res["servers"] == 2  # one per worker
    for r in rows:
        assert r["errors"] == 0 and r["requests"] == 200 and r["req_per_s"] > 0 and r["cpu_ms_per_request"] > 0
        assert r["cores_busy"] > 0 and isinstance(r["cores_limit"], bool)
        assert 0 < r["server_cpu_max"] <= r["server_cpu"] and r["servers_limit"] == (r["server_cpu_max"] > SERVER_BUSY)
    assert rows[0]["efficiency"] == 1.0 and rows[1]["efficiency"] == rows[1]["req_per_s"] / (2 * rows[0]["req_per_s"])
    assert res["open"]["errors"] == 0 and json.loads((tmp_path / "calibrate.json").read_text())["scaling"] == rows


def test_capacity_with_two_workers_finds_the_known_capacity_and_stops_probes_early(tmp_path):
    """`bench capacity --workers 2` against the known-answer service model: the workers' records reach each
    probe while it runs (the coordinator appends them to its requests.jsonl), so probes split over two
    processes stop as soon as they are decided, and the interval holds the model's capacity, as with one."""
    from loadgen.metrics.slo import parse_slos
    from loadgen.testservers.servicemodel import ServiceModelProcess, true_capacity

    slo = "tpot_p50=30ms"  # TPOT = 3 + 6c ms: capacity 4 (as tests/test_capacity_cli.py's live search)
    truth = true_capacity(LIVE, (60, 8), parse_slos(slo, percentiles=True), "concurrency")
    wl = tmp_path / "fixed.toml"
    wl.write_text('description = "fixed"\n[[classes]]\nname = "fixed"\nprompt = 60\noutput = 8\n')
    with ServiceModelProcess(LIVE) as url:
        args = ["capacity", "--url", url, "--slo", slo, "--mode", "concurrency", "--workload", str(wl), "--workers", "2",
                "--budget", "60", "--max-probe-s", "10", "--max-samples", "400", "--output-dir", str(tmp_path),
                "--run-id", "w2", "--timeout", "30"]  # fmt: skip
        out = subprocess.run([sys.executable, "-c", "from loadgen.cli.app import main; main()", *args], cwd=ROOT,
                             capture_output=True, text=True, timeout=400)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads((tmp_path / "w2" / "capacity.json").read_text())
    res, probes = doc["result"], doc["result"]["probes"]
    table = [(p["phase"], p["load"], p["verdict"], p["confident"], p["requests"], p["reason"]) for p in probes]
    assert doc["config"]["workers"] == 2 and all(p["errors"] == 0 for p in probes), table
    lo, hi = res["interval"]
    assert res["status"] == "ok" and lo <= truth < hi, (truth, res["interval"], table)
    split = [p for p in probes if p["phase"] == "search" and p["load"] >= 2]  # c >= 2: two worker processes
    assert split, table
    for p in split:  # decided by the sequential test on live records, before the sample and time caps (10 s)
        assert p["confident"] and "cap" not in p["reason"] and p["requests"] < 400 and p["seconds"] < 10, table
        d = Path(p["dir"])
        assert sorted(f.name for f in (d / "workers").iterdir()) == ["w0.jsonl", "w1.jsonl"]
        recs = read_jsonl(d / "requests.jsonl")  # both workers' records, the probe's cancelled ones included
        assert {r["session"] for r in recs} >= {"s1", "s2"} and len(recs) >= p["requests"]
        assert sum(len(read_jsonl(d / "workers" / f)) for f in ("w0.jsonl", "w1.jsonl")) == len(recs)


def test_null_server_processes_share_one_port():
    """`NullServerProcess(processes=3)`: three serving processes on one port (SO_REUSEPORT); the kernel deals
    connections to all of them, and they stop together."""
    import httpx
    import psutil

    from loadgen.testservers.null import NullServerProcess

    srv = NullServerProcess(processes=3)
    with srv as url:
        pids = srv.pids()
        assert len(set(pids)) == 3
        clients = [httpx.Client() for _ in range(30)]  # 30 keep-alive connections: all 3 get one (p ≈ 1 - 1.5e-5)
        try:
            for c in clients:
                r = c.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True})
                assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            held = {p: sum(1 for k in psutil.Process(p).net_connections("tcp")
                           if k.laddr.port == srv.port and k.status == psutil.CONN_ESTABLISHED) for p in pids}  # fmt: skip
        finally:
            for c in clients:
                c.close()
    assert sum(held.values()) == 30 and min(held.values()) >= 1, held
    deadline = time.monotonic() + 5
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, "a serving process outlived stop()"
        time.sleep(0.05)


async def test_scaling_caps_each_point_and_starts_no_count_past_its_deadline(tmp_path):
    """`loadgen.experiments.calibrate.scaling` (the scale check's): a point ends at `max_s` when its request count would take
    longer, and a deadline already past starts no count at all."""
    from loadgen.experiments.calibrate import NullTarget, scaling

    with NullTarget(4, "aiohttp", 1) as target:
        (row,) = await scaling(target, tmp_path, 4, 10**6, (1,), max_s=1.0)
        assert row["errors"] == 0 and 0 < row["requests"] < 10**6 and row["load_s"] < 10
        assert await scaling(target, tmp_path / "late", 4, 100, (1, 2), until=time.monotonic() - 1) == []


def test_a_worker_loop_runs_on_while_its_reply_waits_in_the_pipe():
    """A progress reply carries megabytes of records at scale; writing it waits for the coordinator to read.
    The worker's event loop (its sends and reads) must not wait with it."""
    from support.ticker import serve

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=serve, args=(child,), daemon=True)
    proc.start()
    try:
        parent.send((0, "start", ()))
        assert parent.recv() == (0, True, None)
        parent.send((1, "big", (64 << 20,)))  # 64 MiB: far more than the pipe's buffer
        sent = time.monotonic()
        time.sleep(0.6)  # not reading: the reply waits in the pipe
        assert parent.recv() == (1, True, b"x" * (64 << 20))
        parent.send((2, "times", ()))
        i, ok, ticks = parent.recv()
        assert ok
        waiting = [t for t in ticks if sent + 0.2 < t < sent + 0.5]
        assert len(waiting) > 10, f"the worker's loop ran {len(waiting)} times in 0.3 s while its reply waited"
    finally:
        parent.send(None)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
