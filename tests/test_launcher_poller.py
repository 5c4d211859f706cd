"""Launcher (real child processes, process groups) and poller (real HTTP scrapes on loopback)."""

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import httpx
import pytest

from backends.launcher import (
    LaunchError,
    ServerProcess,
    free_port,
    grid_label,
    parse_grid,
    render_command,
    server_grid,
    sweep_servers,
)
from backends.llamacpp import LLAMACPP_PROFILE
from loadgen.sidecars.poller import ServerStatePoller
from loadgen.timing.clock import RunClock


def test_grid_product_and_labels():
    grid = parse_grid(["np=4,16", "ub=128,512"])
    assert grid == [{"np": "4", "ub": "128"}, {"np": "4", "ub": "512"},
                    {"np": "16", "ub": "128"}, {"np": "16", "ub": "512"}]
    assert grid_label(grid[1]) == "np4-ub512"
    for bad in ["np", "np=", "=4", "port=1", "np=1 x"]:
        with pytest.raises(ValueError, match="--grid"):
            parse_grid([bad])


def test_render_command_checks_placeholders(tmp_path):
    argv = render_command("python -m x --np {np} --port {port} -m {model}", {"np": "4"}, 8123, model="/m.gguf")
    assert argv[1:] == ["-m", "x", "--np", "4", "--port", "8123", "-m", "/m.gguf"]
    assert os.path.isabs(argv[0])  # "python" is this interpreter
    with pytest.raises(ValueError, match="no --grid ub"):
        render_command("srv {ub} {port}", {}, 1)
    with pytest.raises(ValueError, match="not used"):
        render_command("srv {port}", {"np": "4"}, 1)
    default = render_command("srv -m {model} {port}", {}, 1)
    assert default[2].endswith(".gguf") and os.path.exists(default[2])


def test_server_that_dies_is_a_launch_error(tmp_path):
    log = tmp_path / "server.log"
    srv = ServerProcess(render_command("python -c 'import sys; print(\"boom\"); sys.exit(3)' {port}", {}, 1),
                        free_port(), log)
    with pytest.raises(LaunchError, match="exited with code 3") as exc:
        srv.start()
    assert "boom" in str(exc.value) and "boom" in log.read_text()


def test_server_never_healthy_is_killed(tmp_path):
    # the child spawns a grandchild in the same group: both must be gone after the failed launch
    script = ("import subprocess,sys,time; p=subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)']);"
              "print(p.pid, flush=True); time.sleep(60)")
    srv = ServerProcess([render_command("python", {}, 1)[0], "-c", script], free_port(), tmp_path / "s.log",
                        health_timeout_s=1.0, stop_grace_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="not healthy after 1s"):
        srv.start()
    assert time.monotonic() - t0 < 8
    assert srv.proc.returncode is not None
    grandchild = int((tmp_path / "s.log").read_text().splitlines()[1])
    time.sleep(0.2)
    try:  # gone, or a zombie waiting for a reaper that this container may not have
        state = open(f"/proc/{grandchild}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z")


def test_healthy_server_starts_and_stops(tmp_path):
    port = free_port()
    argv = render_command("python -m http.server {port} --bind 127.0.0.1", {}, port)
    with ServerProcess(argv, port, tmp_path / "s.log", health_path="/") as srv:
        assert srv.startup_s is not None and srv.proc.poll() is None
    assert srv.proc.returncode is not None


class _FakeLlama(BaseHTTPRequestHandler):
    """Serves a llama.cpp-shaped /metrics whose counter grows by 5 per scrape, and /slots."""

    scrapes = 0
    iterations: list[dict] | None = None

    def do_GET(self):  # noqa: N802
        if self.path == "/metrics":
            type(self).scrapes += 1
            body = ("# TYPE llamacpp:tokens_predicted_total counter\n"
                    f"llamacpp:tokens_predicted_total {5 * type(self).scrapes}\n"
                    "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 2\n").encode()
        elif self.path == "/slots":
            body = json.dumps([{"id": 0, "is_processing": True, "id_task": 7, "n_prompt_tokens": 9,
                                "next_token": [{"n_decoded": 3}]}]).encode()
        elif self.path.startswith("/v1/iterations") and type(self).iterations is not None:
            # the reference server's format: records with index >= since, at most `limit`, and `next`
            q = parse_qs(urlparse(self.path).query)
            since, limit = int(q["since"][0]), int(q.get("limit", ["1000"])[0])
            recs = [r for r in type(self).iterations if r["i"] >= since][: min(limit, 2)]  # pages of 2
            nxt = recs[-1]["i"] + 1 if recs else len(type(self).iterations)
            body = json.dumps({"iterations": recs, "next": nxt}).encode()
        else:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_poller_samples_at_rate_and_reconciles(tmp_path):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _FakeLlama)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        poller = ServerStatePoller(f"http://127.0.0.1:{httpd.server_port}", LLAMACPP_PROFILE, hz=20)
        clock = RunClock()
        poller.start(clock, tmp_path)
        time.sleep(1.0)
        summary = poller.stop(window=None)
    finally:
        httpd.shutdown()
    lines = [json.loads(x) for x in (tmp_path / "server_state.jsonl").read_text().splitlines()]
    assert len(lines) == summary["samples"] and 15 <= len(lines) <= 25
    assert all(b["t"] > a["t"] for a, b in zip(lines, lines[1:], strict=False))
    assert lines[0]["slots"] == [{"id": 0, "busy": True, "task": 7, "n_prompt": 9, "n_decoded": 3}]
    assert summary["point"]["counters"]["llamacpp:tokens_predicted_total"] == 5 * (len(lines) - 1)
    assert summary["gauges"]["llamacpp:requests_processing"]["max"] == 2
    assert summary["scrape_errors"] == 0 and summary["scrape_latency_ms"]["p50"] > 0
    assert "iterations" not in summary  # /v1/iterations answered 404


def test_poller_records_unreachable_server(tmp_path):
    poller = ServerStatePoller(f"http://127.0.0.1:{free_port()}", hz=50)
    poller.start(RunClock(), tmp_path)
    time.sleep(0.2)
    summary = poller.stop(None)
    assert summary["samples"] >= 2 and summary["scrape_errors"] == summary["samples"]
    with pytest.raises(ValueError):
        ServerStatePoller("http://127.0.0.1:1", hz=0)


def test_sweep_servers_records_failures_and_goes_on(tmp_path):
    # one grid point serves (http.server), the other exits at once: two entries, the sweep completes
    template = ("python -c \"import runpy,sys; sys.argv=['s','{port}','--bind','127.0.0.1'];"
                " sys.exit(4) if '{mode}'=='die' else runpy.run_module('http.server', run_name='__main__')\"")
    points = server_grid(template, ["mode=die,ok"])
    assert [p.label for p in points] == ["modedie", "modeok"]
    calls = []

    def inner(base_url, gp, so_far):
        calls.append((gp.label, len(so_far)))
        return [{"point_id": f"{gp.label}/c001", "labels": gp.params}]

    results = sweep_servers(template, points, tmp_path, inner, health_path="/", health_timeout_s=20)
    assert calls == [("modeok", 1)]  # the failed point is already in the results it sees
    assert results[0]["failed"]["kind"] == "launch" and "code 4" in results[0]["failed"]["message"]
    assert results[0]["labels"] == {"mode": "die"} and "failed" not in results[1]
    assert results[1]["server_launch"]["params"] == {"mode": "ok"}
    assert results[1]["server_launch"]["startup_s"] > 0
    assert (tmp_path / "points" / "modeok" / "server.log").read_text().startswith("$ ")
    with pytest.raises(ValueError, match="no --grid"):
        server_grid("srv {np} {port}", [])


def test_cli_rejects_bad_server_sweeps(tmp_path):
    from typer.testing import CliRunner

    from loadgen.cli.app import app

    runner = CliRunner()
    cases = [
        (["--grid", "np=1,2"], "--grid needs --server"),
        (["--server", "srv {np} --port {port}"], "no --grid np"),
        (["--server", "srv --port {port}", "--grid", "np=1"], "not used"),
        (["--server", "srv {np} {port}", "--url", "http://127.0.0.1:1", "--grid", "np=1"], "drop --url"),
        (["--poll-hz", "-1"], "--poll-hz"),
    ]
    for args, message in cases:
        res = runner.invoke(app, ["sweep", "--output-dir", str(tmp_path), *args])
        assert res.exit_code == 2, (args, res.output)
        assert message in " ".join(res.output.split()), (args, res.output)


def test_poller_fetches_the_points_iterations(tmp_path):
    """Only iterations after the point started are fetched (in pages), with times on the run clock."""
    clock = RunClock()
    _FakeLlama.iterations = [{"i": i, "t_unix": clock.t0_unix + i, "decode_tokens": i} for i in range(3)]
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _FakeLlama)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        poller = ServerStatePoller(f"http://127.0.0.1:{httpd.server_port}", hz=20)
        poller.start(clock, tmp_path)
        _FakeLlama.iterations += [{"i": i, "t_unix": clock.t0_unix + i, "decode_tokens": i} for i in range(3, 8)]
        summary = poller.stop(None)
    finally:
        httpd.shutdown()
        _FakeLlama.iterations = None
    recs = [json.loads(x) for x in (tmp_path / "iterations.jsonl").read_text().splitlines()]
    assert summary["iterations"] == {"count": 5}
    assert [r["i"] for r in recs] == [3, 4, 5, 6, 7]
    assert [round(r["t"], 6) for r in recs] == [3.0, 4.0, 5.0, 6.0, 7.0]


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie waiting for a reaper that this container may not have."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_server_does_not_outlive_a_killed_parent():
    """A run killed with SIGKILL (no cleanup runs) leaves no server behind: the launcher's guard stops it.
    The server is started from a worker thread that ends first, and must live on until its process dies."""
    parent_code = (
        "import sys, threading, time\n"
        "from loadgen.testservers.null import NullServerProcess\n"
        "srv = NullServerProcess()\n"
        "t = threading.Thread(target=srv.start)\n"
        "t.start(); t.join()\n"
        "print(srv.proc.pid, srv.url, flush=True)\n"
        "time.sleep(300)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    try:
        pid_text, url = parent.stdout.readline().split()
        server = int(pid_text)
        time.sleep(1.0)  # the thread that started it is gone: the server still answers
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30
        while not _gone(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(server), f"server {server} outlived its killed parent"
    finally:
        parent.kill()
        parent.wait()
