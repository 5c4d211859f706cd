"""Runs that survive real server behaviour: keep-alive closes, dropped requests, a dying server, Ctrl-C.

Fault injection is loadgen/testservers/null.py in its own process; every test asserts where errors appear.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from support.signals import sigint_default

from backends.openai import OpenAIBackend
from loadgen.dispatch.engine import PointOptions, run_point
from loadgen.dispatch.loadspec import LoadSpec
from loadgen.dispatch.signals import run_async
from loadgen.exitcodes import ExitCode
from loadgen.experiments.calibrate import FixedWorkload
from loadgen.testservers.null import NullServerProcess
from loadgen.timing.clock import RunClock
from workloads.contracts import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
WAVE_TOKENS = 32  # every request's exact output: equal lengths finish together, in waves
WAVES = f"""
[[classes]]
name = "waves"
prompt = {{ dist = "fixed", value = 32 }}
output = {{ dist = "fixed", value = {WAVE_TOKENS} }}
"""


def default_cli_run(
    url: str, tmp_path: Path, concurrency: int, backend: str, n: int | None = None, args: tuple[str, ...] = (),
) -> list[dict]:  # fmt: skip
    """`bench run` as a user types it (default backend and client) at ``concurrency``: ``n`` requests
    (default: at least 4 waves and 48 requests) of 32 prompt tokens and exactly WAVE_TOKENS output tokens, so
    finishes arrive in synchronised waves (the keep-alive race at its worst). Asserts 0 errors, exact counts
    and the detected ``backend``; ``args`` are extra CLI options."""
    n = n or max(48, 4 * concurrency)
    from typer.testing import CliRunner

    from loadgen.cli.app import app

    (tmp_path / "waves.toml").write_text(WAVES)
    rid = f"waves-c{concurrency}"
    res = CliRunner().invoke(app, ["run", "--url", url, "--workload", str(tmp_path / "waves.toml"),
                                   "--concurrency", str(concurrency), "--num-requests", str(n),
                                   "--output-dir", str(tmp_path), "--run-id", rid, *args])  # fmt: skip
    assert res.exit_code == 0, res.output
    run_dir = tmp_path / rid
    assert json.loads((run_dir / "run.json").read_text())["backend_detection"]["backend"] == backend
    (point,) = json.loads((run_dir / "summary.json").read_text())["points"]
    recs = read_jsonl(run_dir / "points" / point["point_id"] / "requests.jsonl")
    assert point["counts"]["errors"] == 0 and len(recs) == n, point["errors"]
    assert all(r["error"] is None and r["output_tokens"] == WAVE_TOKENS for r in recs)
    assert point["status"] == "complete"
    return recs


def run(url: str, out: Path, client: str, n: int, concurrency: int = 4, bodies: list | None = None):
    wl = FixedWorkload(max_tokens=5, extra_bodies=bodies or [{}])
    load = LoadSpec("closed", concurrency=concurrency, num_requests=n, timeout=30, stall_timeout=10)
    s = run_async(run_point(OpenAIBackend(url, model="null"), wl, load, out, RunClock(),
                            options=PointOptions(client_kind=client)))
    return s, read_jsonl(out / "requests.jsonl")


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_long_sse_lines_and_large_bodies_are_read_whole(tmp_path, null_server, client):
    """Stream events of 200 KB, one line each (aiohttp's own line reader raises "Chunk too big" above
    128 KiB) after a 750 KB request body: every event, token and byte arrives, 0 errors."""
    wl = FixedWorkload(max_tokens=150_000, prompt="word " * 150_000,
                       extra_bodies=[{"nullserver": {"tokens_per_event": 50_000}}])  # fmt: skip
    load = LoadSpec("closed", concurrency=2, num_requests=6, timeout=30, stall_timeout=10)
    s = run_async(run_point(OpenAIBackend(null_server, model="null"), wl, load, tmp_path, RunClock(),
                            options=PointOptions(client_kind=client)))
    recs = read_jsonl(tmp_path / "requests.jsonl")
    assert s["counts"]["errors"] == 0 and len(recs) == 6, s["errors"]
    for r in recs:
        assert r["error"] is None and len(r["events"]) == 3 and r["output_tokens"] == 150_000
        assert r["prompt_tokens"] == 150_000  # the server read the whole body (its words)


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_keepalive_race_is_retried_once_and_counted_exactly(tmp_path, client):
    """The server drops every request that arrives on a reused connection (the keep-alive race, every
    time): each is resent once on a fresh connection, so 0 errors, and the records' retries equal
    the requests the server dropped."""
    with NullServerProcess(keepalive="drop_idle") as url:
        s, recs = run(url, tmp_path, client, n=120)
        stats = httpx.get(url + "/stats").json()
    assert len(recs) == 120 and s["counts"]["errors"] == 0, s["errors"]
    assert stats["dropped_idle"] > 20  # the race really happened
    assert sum(r["retries"] for r in recs) == stats["dropped_idle"]
    assert stats["requests"] == 120 and all(r["retries"] <= 1 for r in recs)
    assert s["status"] == "complete"
    retried = [r for r in recs if r["retries"]]
    assert all(r["sent"] >= r["intended"] and r["headers"] > r["sent"] for r in retried)


@pytest.mark.parametrize("keepalive", ["close", "drop"])
@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_server_that_closes_every_connection(tmp_path, client, keepalive):
    """Closing after each response, with (``close``) or without (``drop``) a Connection: close header:
    no request fails, and a header-announced close never needs a retry."""
    with NullServerProcess(keepalive=keepalive) as url:
        s, recs = run(url, tmp_path, client, n=100)
        stats = httpx.get(url + "/stats").json()
    assert len(recs) == 100 and s["counts"]["errors"] == 0, s["errors"]
    assert stats["requests"] == 100  # every request reached the server exactly once
    if keepalive == "close":
        assert sum(r["retries"] for r in recs) == 0


@pytest.mark.parametrize("keepalive", ["on", "drop_idle"])
@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_dropped_request_errors_exactly_where_the_server_dropped_it(tmp_path, client, keepalive):
    """Every 4th request is read and then dropped without a byte of response: exactly those fail
    (after at most one retry, when they had gone out on a reused connection), and the run goes on."""
    bodies = [{}, {}, {}, {"nullserver": {"fault": "drop_request"}}]
    with NullServerProcess(keepalive=keepalive) as url:
        s, recs = run(url, tmp_path, client, n=40, concurrency=2, bodies=bodies)
        stats = httpx.get(url + "/stats").json()
    failed = sorted(int(r["id"][1:]) for r in recs if r["error"])
    assert failed == list(range(3, 40, 4)), [r["error"] for r in recs if r["error"]]
    assert {r["error"]["kind"] for r in recs if r["error"]} <= {"connect", "disconnect"}
    assert s["status"] == "complete" and len(recs) == 40
    # every attempt the server failed (a dropped request, or one dropped unread on a reused connection)
    # is either a recorded error or a retry: 10 errors plus the retries, exactly
    assert stats["dropped_requests"] + stats["dropped_idle"] == 10 + sum(r["retries"] for r in recs)
    assert stats["requests"] == 40 + sum(r["retries"] for r in recs if r["error"] and keepalive == "on")


@pytest.mark.parametrize("process", ["closed", "poisson"])
def test_server_that_dies_mid_run_aborts_the_point(tmp_path, process):
    """The server process exits when its 30th request arrives: the requests before it are fine, the
    ones in flight fail, nothing is sent once the first failure is seen, and the point is aborted (not
    spun through), for closed and open loops alike."""
    wl = FixedWorkload(max_tokens=5, extra_bodies=[{}])
    load = LoadSpec(process, concurrency=4 if process == "closed" else None, rate=None if process == "closed" else 80,
                    num_requests=500, timeout=30, stall_timeout=10)  # fmt: skip
    with NullServerProcess(die_after=30, itl=0.01) as url:
        s = run_async(run_point(OpenAIBackend(url, model="null"), wl, load, tmp_path, RunClock()))
    recs = read_jsonl(tmp_path / "requests.jsonl")
    ok = [r for r in recs if r["error"] is None]
    failed = [r for r in recs if r["error"]]
    assert s["status"] == "aborted" and "stopped accepting connections" in s["aborted"]["reason"]
    assert 20 <= len(ok) <= 29 and 1 <= len(failed) <= 10, (len(ok), [r["error"] for r in failed])
    first_failure = min(r["end"] for r in failed)
    assert max(r["end"] for r in ok) <= first_failure  # errors only after the death
    assert all(r["sent"] <= first_failure + 0.5 for r in recs)  # dispatch held from the first failure on
    assert s["aborted"]["t"] >= max(r["end"] for r in failed)


def _bench(args: list[str], **kw) -> subprocess.Popen[bytes]:
    code = "from loadgen.cli.app import main; main()"
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, **kw)  # fmt: skip


def _wait_records(path: Path, n: int, proc: subprocess.Popen[bytes], timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        if path.exists() and (k := path.read_bytes().count(b"\n")) >= n:
            return k
        time.sleep(0.05)
    raise AssertionError(f"fewer than {n} records in {path} after {timeout} s")


def test_kill_server_mid_run(tmp_path):
    """`bench run` against a server killed (SIGKILL) mid-run: exits SERVER_GONE within a few seconds,
    summary and report written, point aborted, at most `concurrency` requests recorded after the death."""
    srv = NullServerProcess(itl=0.02)
    url = srv.start()
    try:
        proc = _bench(["run", "--url", url, "--concurrency", "8", "--num-requests", "300", "--output-dir",
                       str(tmp_path), "--run-id", "kill", "--poll-hz", "0", "--telemetry-hz", "0"])  # fmt: skip
        reqs = tmp_path / "kill" / "points" / "c008" / "requests.jsonl"
        before = _wait_records(reqs, 20, proc)
        assert srv.proc is not None
        srv.proc.kill()
        t_kill = time.monotonic()
        srv.proc.wait()
        out, _ = proc.communicate(timeout=60)
        elapsed = time.monotonic() - t_kill
    finally:
        srv.stop()
    text = out.decode()
    assert proc.returncode == ExitCode.SERVER_GONE, text
    assert elapsed < 15, elapsed
    run_dir = tmp_path / "kill"
    assert (run_dir / "report.html").is_file() and (run_dir / "summary.json").is_file()
    (point,) = json.loads((run_dir / "summary.json").read_text())["points"]
    assert point["status"] == "aborted" and point["aborted"]["reason"]
    recs = read_jsonl(reqs)
    assert before <= len(recs) - 0 and len(recs) - before <= 8 + 8  # in flight at the kill (the
    # records counted before the kill were read while up to 8 more were ending)
    after = [r for r in recs if r["error"]]
    assert 1 <= len(after) <= 8, [r["error"] for r in after]
    assert "server gone" in text


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, ExitCode.INTERRUPTED), (signal.SIGTERM, ExitCode.TERMINATED)])
def test_signal_writes_partial_summary_and_report(tmp_path, null_server, sig, code):
    """A real SIGINT (Ctrl-C) / SIGTERM to `bench run`: exit 130 / 143 with summary.json and report.html,
    the point marked interrupted with its finished and cancelled counts."""
    restore = sigint_default if sig == signal.SIGINT else None
    args = ["run", "--url", null_server, "--concurrency", "4", "--num-requests", "100000", "--output-dir",
            str(tmp_path), "--run-id", "sig", "--poll-hz", "0", "--telemetry-hz", "0",
            "--extra-body", '{"nullserver": {"itl": 0.01}}']  # fmt: skip
    proc = _bench(args, preexec_fn=restore)
    reqs = tmp_path / "sig" / "points" / "c004" / "requests.jsonl"
    _wait_records(reqs, 20, proc)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == code, out.decode()
    run_dir = tmp_path / "sig"
    assert (run_dir / "report.html").is_file()
    (point,) = json.loads((run_dir / "summary.json").read_text())["points"]
    i = point["interrupted"]
    recs = read_jsonl(reqs)
    assert point["status"] == "interrupted" and i["signal"] == sig.name
    assert i["finished"] + i["cancelled"] == len(recs) and i["finished"] >= 20 and 1 <= i["cancelled"] <= 4
    assert {r["error"]["kind"] for r in recs if r["error"]} == {"cancelled"}


def test_report_and_gate_accept_a_run_without_summary(tmp_path, null_server):
    """A run killed before its summary (SIGKILL): `bench report` and `bench gate` recompute it from
    requests.jsonl and say so."""
    from typer.testing import CliRunner

    from loadgen.cli.app import app

    proc = _bench(["run", "--url", null_server, "--concurrency", "2", "--num-requests", "100000", "--output-dir",
                   str(tmp_path), "--run-id", "killed", "--poll-hz", "0", "--telemetry-hz", "0",
                   "--extra-body", '{"nullserver": {"itl": 0.01}}'])  # fmt: skip
    _wait_records(tmp_path / "killed" / "points" / "c002" / "requests.jsonl", 10, proc)
    proc.kill()
    proc.wait()
    run_dir = tmp_path / "killed"
    assert not (run_dir / "summary.json").exists()
    res = CliRunner().invoke(app, ["report", str(run_dir)])
    assert res.exit_code == 0, res.output
    assert "recomputing it from requests.jsonl" in " ".join(res.output.split()), res.output
    assert (run_dir / "report.html").is_file()
    res = CliRunner().invoke(app, ["gate", "--baseline", str(run_dir), "--candidate", str(run_dir),
                                   "--metric", "output_tok_s:-50%", "--min-trials", "2"])  # fmt: skip
    said = " ".join(res.output.split())
    assert "recomputing it from requests.jsonl" in said and "no such result" not in said, res.output
    assert "c002" in said and "inconclusive" in said  # one trial a side: compared, but not enough to decide


def test_error_rate_above_the_limit_fails_with_the_top_kinds(tmp_path, null_server):
    """Half the requests fail (HTTP 500): the default --max-error-rate cannot pass that run, and the
    message names the error kinds; a run where every request fails exits FAILED from the CLI."""
    from typer.testing import CliRunner

    from loadgen.cli.app import app
    from loadgen.cli.run import point_outcome

    s, recs = run(null_server, tmp_path / "half", "aiohttp", n=40, bodies=[{}, {"nullserver": {"fault": "500"}}])
    assert s["counts"]["errors"] == 20 and s["status"] == "complete"
    code, message = point_outcome(s, 0.05)
    assert code == ExitCode.FAILED and "error rate 50.0%" in (message or "") and "http_5xx: 20" in (message or "")
    assert point_outcome(s, 0.6) == (ExitCode.OK, None)
    res = CliRunner().invoke(app, [
        "run", "--url", null_server, "--concurrency", "2", "--num-requests", "20", "--output-dir", str(tmp_path),
        "--poll-hz", "0", "--telemetry-hz", "0", "--extra-body", '{"nullserver": {"fault": "500"}}',
    ])  # fmt: skip
    assert res.exit_code == ExitCode.FAILED, res.output
    said = " ".join(res.output.split())
    assert "no request succeeded" in said and "http_5xx: 20" in said, res.output


def test_second_ctrl_c_exits_at_once(tmp_path, null_server):
    """Two Ctrl-Cs in a row: the second does not wait for the partial summary, it exits 130 now
    (every finished record is already on disk)."""
    # hundreds of records and 16 in flight: stopping (cancel, summary, report) takes long enough for the
    # second signal to land in it
    args = ["run", "--url", null_server, "--concurrency", "16", "--num-requests", "100000", "--output-dir",
            str(tmp_path), "--run-id", "twice", "--poll-hz", "0", "--telemetry-hz", "0",
            "--extra-body", '{"nullserver": {"itl": 0.001}}']  # fmt: skip
    proc = _bench(args, preexec_fn=sigint_default)
    reqs = tmp_path / "twice" / "points" / "c016" / "requests.jsonl"
    _wait_records(reqs, 400, proc)
    proc.send_signal(signal.SIGINT)
    seen = b""
    assert proc.stdout is not None
    while b"again exits at once" not in seen:  # the first one is being handled: the second comes now
        line = proc.stdout.readline()
        assert line, seen.decode()
        seen += line
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    out = seen + out
    assert proc.returncode == ExitCode.INTERRUPTED and "SIGINT again: exiting now" in out.decode(), out.decode()
    lines = reqs.read_bytes().split(b"\n")
    assert lines[-1] == b"" and all(json.loads(x)["id"] for x in lines[:-1])  # no torn record


def test_sweep_stops_at_a_dead_server_and_exits_with_the_worst_point(tmp_path):
    """c=1 runs clean, the server dies during c=2: that point is aborted, c=4 never runs (a sweep stops
    by default), and the sweep exits SERVER_GONE, the worst of its points."""
    from typer.testing import CliRunner

    from loadgen.cli.app import app
    from loadgen.exitcodes import worst

    assert worst([ExitCode.OK, ExitCode.FAILED, ExitCode.SERVER_GONE]) == ExitCode.SERVER_GONE
    assert worst([ExitCode.SERVER_GONE, ExitCode.INTERRUPTED]) == ExitCode.INTERRUPTED and worst([]) == ExitCode.OK
    with NullServerProcess(die_after=16, itl=0.01) as url:
        res = CliRunner().invoke(app, ["sweep", "--url", url, "--concurrency", "1,2,4", "--num-requests", "10",
                                       "--warmup", "0", "--output-dir", str(tmp_path), "--run-id", "s",
                                       "--poll-hz", "0", "--telemetry-hz", "0"])  # fmt: skip
    assert res.exit_code == ExitCode.SERVER_GONE, res.output
    points = json.loads((tmp_path / "s" / "summary.json").read_text())["points"]
    assert [(p["point_id"], p["status"]) for p in points] == [("c001", "complete"), ("c002", "aborted")]
    assert points[0]["counts"]["errors"] == 0 and "server gone" in res.output


def test_sweep_waits_for_the_server_with_wait_for_server(tmp_path):
    """--wait-for-server: after the aborted point the sweep waits for the server (restarted here on the
    same port) and goes on with the next point; the exit code still reports the aborted point."""
    import threading

    from typer.testing import CliRunner

    from loadgen.cli.app import app

    first = NullServerProcess(die_after=16, itl=0.01)
    url = first.start()
    second = NullServerProcess(itl=0.01)
    second.port = first.port

    def restart() -> None:
        assert first.proc is not None
        first.proc.wait(120)
        time.sleep(2)  # gone for a while
        second.start()

    t = threading.Thread(target=restart)
    t.start()
    try:
        res = CliRunner().invoke(app, ["sweep", "--url", url, "--concurrency", "1,2,4", "--num-requests", "10",
                                       "--warmup", "0", "--output-dir", str(tmp_path), "--run-id", "w",
                                       "--poll-hz", "0", "--telemetry-hz", "0", "--wait-for-server", "60"])  # fmt: skip
    finally:
        t.join()
        first.stop()
        second.stop()
    assert res.exit_code == ExitCode.SERVER_GONE, res.output
    points = json.loads((tmp_path / "w" / "summary.json").read_text())["points"]
    assert [(p["point_id"], p["status"]) for p in points] == [
        ("c001", "complete"), ("c002", "aborted"), ("c004", "complete")]
    assert points[2]["counts"]["errors"] == 0 and points[2]["counts"]["ok"] == 10
