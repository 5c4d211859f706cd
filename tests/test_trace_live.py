"""A real short sweep against the bundled reference server, run in a real terminal (tmux):

* the live display, captured mid-run from the pane: progress bar, point i/n, live TTFT/ITL, errors by kind;
* ``bench trace`` on its results: the trace parses as the Chrome JSON trace format, passes
  :func:`loadgen.report.trace.check`, and holds one request slice per record, one token instant per streamed chunk,
  one engine-step slice per ``/v1/iterations`` record and the counter series, at the recorded run-clock times.

Perfetto's own trace processor (``trace_processor_shell``) cannot be had from PyPI/Debian/npm here (the
``perfetto`` package downloads it from Google's servers at run time), so the file is read back with the
format's rules instead (docs/trace.md).
"""

import gzip
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from loadgen.cli.app import app
from loadgen.cli.live import LiveDisplay
from loadgen.dispatch.loadspec import LoadSpec
from loadgen.dispatch.progress import Progress
from loadgen.dispatch.sweep import PointPlan
from loadgen.report.trace import US, build_trace, check
from loadgen.timing.clock import RunClock
from workloads.contracts import RequestRecord

# "short" requests finish; "long" ones (with a slowed engine) run past --timeout: errors show up live
WORKLOAD = """
[[classes]]
name = "short"
weight = 3
prompt = { dist = "fixed", value = 24 }
output = { dist = "fixed", value = 8 }

[[classes]]
name = "long"
weight = 1
prompt = { dist = "fixed", value = 24 }
output = { dist = "fixed", value = 400 }
"""
BENCH = str(Path(sys.executable).parent / "bench")


@pytest.fixture(scope="module")
def tmux_run(tmp_path_factory):
    tmux = shutil.which("tmux")
    assert tmux, "tmux is missing (make test-deps installs it)"
    d = tmp_path_factory.mktemp("live")
    (d / "w.toml").write_text(WORKLOAD)
    sock, session = f"servelab-test-{os.getpid()}", "live"
    cmd = (f"SERVELAB_ENGINE_SLEEP_MS=25 {BENCH} sweep --workload {d / 'w.toml'} --concurrency 2,3 "
           f"--num-requests 8 --warmup 1 --timeout 3 --output-dir {d} --run-id r; echo $? > {d / 'rc'}; sleep 60")  # fmt: skip
    subprocess.run([tmux, "-L", sock, "new-session", "-d", "-s", session, "-x", "220", "-y", "40", cmd], check=True)
    captures: list[str] = []
    try:
        deadline = time.monotonic() + 600
        while not (d / "rc").exists() and time.monotonic() < deadline:
            out = subprocess.run([tmux, "-L", sock, "capture-pane", "-p", "-t", session], capture_output=True,
                                 text=True)  # fmt: skip
            captures.append(out.stdout)
            time.sleep(0.5)
        final = subprocess.run([tmux, "-L", sock, "capture-pane", "-p", "-t", session, "-S", "-200"],
                               capture_output=True, text=True).stdout  # fmt: skip
    finally:
        subprocess.run([tmux, "-L", sock, "kill-server"], check=False)
    assert (d / "rc").exists(), "the sweep did not finish in 10 minutes:\n" + (captures[-1] if captures else "")
    return d, captures, final


def test_live_display_in_a_terminal(tmux_run):
    d, captures, final = tmux_run
    summary = json.loads((d / "r" / "summary.json").read_text())
    points = summary["points"]
    assert [p["point_id"] for p in points] == ["c002", "c003"]
    # the panel mid-run: bar (rich's bar glyphs), place in the sweep, progress against the count, live numbers
    live = [c for c in captures if "point " in c and "━" in c and "TTFT p50/p99" in c]
    assert live, "no capture showed the live panel:\n" + "\n---\n".join(captures[-5:])
    assert any("point 1/2 c002" in c for c in live) and any("point 2/2 c003" in c for c in live)
    assert any("/8 requests" in c and "left " in c and "in-flight" in c and "out tok/s" in c for c in live)
    assert any("TTFT p50/p99 -/-" not in c and "ITL p50/p99 -/-" not in c for c in live)  # numbers so far
    # errors by kind, live, and the same count as the results say
    timeouts = sum(p["errors"]["by_kind"].get("timeout", 0) for p in points)
    assert timeouts >= 1, "the long class should have timed out"
    assert sum(p["counts"]["errors"] for p in points) == timeouts
    assert any("errors timeout" in c for c in live + [final])
    # each point leaves its final line in the scrollback with its measured count
    for p in points:
        n_err = p["errors"]["by_kind"].get("timeout", 0)
        assert f"{p['point_id']}  done 8/8 100%" in final
        assert (f"errors timeout {n_err}" if n_err else "errors 0") in final


def test_trace_of_a_real_run_reads_back(tmux_run):
    d, _, _ = tmux_run
    res = CliRunner().invoke(app, ["trace", str(d / "r"), "--point", "c009"])
    assert res.exit_code == 2 and "no such point(s): c009; points here: c002, c003" in res.output
    res = CliRunner().invoke(app, ["trace", str(d / "r"), "--point", "c003", "--no-tokens", "-o", str(d / "t.json")])
    small = json.loads((d / "t.json").read_text())
    assert res.exit_code == 0 and not any(e["ph"] == "i" for e in small["traceEvents"])
    assert {e["args"]["name"] for e in small["traceEvents"] if e["name"] == "process_name"} == {"point c003"}
    res = CliRunner().invoke(app, ["trace", str(d / "r"), "-o", str(d / "run.json.gz")])
    assert res.exit_code == 0, res.output
    trace = json.loads(gzip.decompress((d / "run.json.gz").read_bytes()))
    check(trace)
    ev = trace["traceEvents"]
    procs = {e["args"]["name"]: e["pid"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert set(procs) == {"point c002", "point c003"}
    for point_id in ("c002", "c003"):
        pid = procs[f"point {point_id}"]
        pdir = d / "r" / "points" / point_id
        recs = [json.loads(x) for x in (pdir / "requests.jsonl").read_text().splitlines()]
        its = [json.loads(x) for x in (pdir / "iterations.jsonl").read_text().splitlines()]
        samples = [json.loads(x) for x in (pdir / "server_state.jsonl").read_text().splitlines()]
        mine = [e for e in ev if e.get("pid") == pid]
        reqs = sorted((e for e in mine if e["ph"] == "X" and e["cat"] == "request" and e["name"].startswith("request")),
                      key=lambda e: e["args"]["id"])  # fmt: skip
        assert len(reqs) == len(recs) and len(recs) == 9  # 8 measured + 1 warm-up
        by_id = {r["id"]: r for r in recs}
        for e in reqs:
            r = by_id[e["args"]["id"]]
            assert e["ts"] == pytest.approx(min(r["intended"], r["sent"]) * US, abs=1)
            assert e["ts"] + e["dur"] == pytest.approx(r["end"] * US, abs=1)
            assert e["name"] == ("request" if r["error"] is None else f"request ({r['error']['kind']})")
        errors = [r for r in recs if r["error"] is not None]
        assert len(errors) == sum(1 for e in reqs if e["name"] != "request")
        assert all(r["error"]["kind"] == "timeout" for r in errors)
        # one instant per streamed chunk, at the chunk's time, with its token count
        tokens = [e for e in mine if e["ph"] == "i"]
        chunks = sorted(round(t * US, 3) for r in recs for t, _ in r["events"])
        assert sorted(e["ts"] for e in tokens) == pytest.approx(chunks, abs=1)
        ok = [r for r in recs if r["error"] is None]
        assert max(e["args"]["total"] for e in tokens) == max(r["output_tokens"] or 0 for r in recs)
        assert all(r["output_tokens"] == 8 for r in ok if r["cls"] == "short")
        # engine steps: one slice per iteration record, at its run-clock time
        steps = [e for e in mine if e["ph"] == "X" and e["cat"] == "engine"]
        assert len(steps) == len(its) > 0
        assert sorted(e["ts"] for e in steps) == pytest.approx(sorted(r["t"] * US for r in its), abs=1)
        assert sum(e["args"]["decode tokens"] for e in steps) == sum(r["decode_tokens"] for r in its)
        # counters: KV use per step, the server's gauges per /metrics sample, client in-flight per edge
        counters = [e for e in mine if e["ph"] == "C"]
        assert sum(1 for e in counters if e["name"] == "KV blocks used") == len(its)
        scraped = [s for s in samples if "metrics" in s]
        running = [e for e in counters if e["name"] == "server servelab_requests_running"]
        assert len(running) == len(scraped) > 0
        assert sum(1 for e in counters if e["name"] == "client in-flight") == 2 * len(recs)
        assert max(e["args"]["requests"] for e in counters if e["name"] == "client in-flight") <= 3


def test_check_rejects_what_importers_would_drop():
    bad = {"traceEvents": [
        {"ph": "X", "pid": 1, "tid": 1, "name": "a", "ts": 0, "dur": 10},
        {"ph": "X", "pid": 1, "tid": 1, "name": "b", "ts": 5, "dur": 10},  # overlaps a without nesting
    ]}  # fmt: skip
    with pytest.raises(ValueError, match="overlaps"):
        check(bad)
    with pytest.raises(ValueError, match="counter values"):
        check({"traceEvents": [{"ph": "C", "pid": 1, "name": "c", "ts": 0, "args": {"v": "x"}}]})
    with pytest.raises(ValueError, match="phase"):
        check({"traceEvents": [{"ph": "Q", "pid": 1}]})
    with pytest.raises(FileNotFoundError):
        build_trace(Path("/nonexistent"))
    res = CliRunner().invoke(app, ["trace", "/nonexistent"])
    assert res.exit_code == 2 and "no points/ directory" in res.output
    res = CliRunner().invoke(app, ["trace", "/nonexistent", "-o", "x.perfetto-trace"])
    assert res.exit_code == 2 and "must end in .json or .json.gz" in res.output


def test_plain_lines_when_not_a_terminal():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=300)
    clock = RunClock()
    plan = PointPlan("c004", None, LoadSpec(process="closed", concurrency=4, num_requests=4))  # type: ignore[arg-type]
    live = LiveDisplay(console, clock, plain_every_s=0.05).points([PointPlan("c001", None, plan.load), plan],
                                                                  config=(2, 3, "np4"))  # type: ignore[arg-type]
    p = Progress(t_start=clock.now())
    with live(plan, p):
        for i in range(4):
            rec = RequestRecord(id=str(i), sent=clock.now(), end=clock.now() + 1.0,
                                events=[[clock.now() + 0.1, 1], [clock.now() + 0.3, 2]], output_tokens=3)  # fmt: skip
            if i == 3:
                rec.set_error("http_5xx", "boom")
                p.errors += 1
                p.error_kinds["http_5xx"] = 1
            p.done += 1
            p.output_tokens += 3
            p.observe(rec)
            time.sleep(0.1)
    lines = buf.getvalue().splitlines()
    assert len(lines) >= 2 and all("\x1b" not in x for x in lines)  # periodic plain lines, no escapes
    last = lines[-1]
    assert last.startswith("config 2/3 np4 · point 2/2 c004  done 4/4 100%")
    assert "TTFT p50/p99 100.0/100.0 ms" in last and "ITL p50/p99 100.0/100.0 ms" in last
    assert "errors http_5xx 1" in last
