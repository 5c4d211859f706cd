"""`bench capacity` live: searches against the service-model server on loopback, the CLI's exit codes, one
capacity per server configuration with the gate on it, and Ctrl-C mid-search."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.service_models import LIVE
from support.signals import sigint_default

from backends.openai import OpenAIBackend
from loadgen.capacity.config import SearchConfig
from loadgen.capacity.live import LiveProber
from loadgen.capacity.probe import pilot_requests
from loadgen.capacity.search import search
from loadgen.defaults import REQUESTS_FILE
from loadgen.dispatch.signals import run_async
from loadgen.dispatch.sweep import run_seed
from loadgen.exitcodes import ExitCode
from loadgen.experiments.calibrate import FixedWorkload
from loadgen.metrics.slo import parse_slos
from loadgen.testservers.servicemodel import ServiceModel, ServiceModelProcess, true_capacity

LIVE_WL = FixedWorkload(max_tokens=8, prompt="w " * 60)
LIVE_CASES = [
    ("concurrency", "constant", "tpot_p50=30ms"),  # TPOT = 3 + 6c ms: capacity 4 (27 ms; 5 sessions: 33 ms)
    ("rate", "constant", "ttft_p90=60ms"),  # TTFT 7.5 ms until the slots saturate (~22 req/s), then the queue grows
]


@pytest.mark.parametrize(("mode", "process", "slo"), LIVE_CASES)
def test_live_search_finds_the_known_capacity(tmp_path, mode, process, slo):
    """One search per mode against the live server on loopback: its interval contains the model's capacity,
    at the stated resolution, with no failed request, within its budget (a closed-loop probe's warm-up wave,
    outside the probe's time, used to overrun it)."""
    slos = parse_slos(slo, percentiles=True)
    truth = true_capacity(LIVE, (60, 8), slos, mode, process, requests=3000)
    with ServiceModelProcess(LIVE) as url:
        prober = LiveProber(OpenAIBackend(url, model="null"), LIVE_WL, slos, tmp_path, process=process, timeout=30)
        res = run_async(search(prober, slos, SearchConfig(mode, budget_s=50, max_probe_s=10, max_samples=400)))
    table = [(p.load, p.verdict, p.confident, p.requests, p.reason) for p in res.probes]
    assert all(p.errors == 0 for p in res.probes), table
    assert res.probe_seconds <= 50 * 1.05, (res.probe_seconds, [p.seconds for p in res.probes])
    lo, hi = res.interval
    assert res.status == "ok" and res.resolution_met, (res.message, table)
    assert lo <= truth and (truth < hi if mode == "concurrency" else truth <= hi), (truth, res.interval, table)


def test_a_pilots_sessions_keep_sending_until_its_judged_requests_ended(tmp_path):
    """A pilot judges its second wave; its sessions go on sending until that wave has ended, and the requests still
    running then are cancelled, not judged. A loop that stopped at the judged count drained under its last wave
    (fewer in the batch, no new prefills): on the reference server a pilot at 64 sessions read TPOT p90 129-147 ms
    where the steady state gives ~177, and passed there."""
    slos = parse_slos("tpot_p90=1s", percentiles=True)
    c = 4
    with ServiceModelProcess(LIVE) as url:  # a wave of 64 tokens: ~1.7 s at 4 sessions, ticks of 0.25 s
        prober = LiveProber(OpenAIBackend(url, model="null"), FixedWorkload(max_tokens=64, prompt="w " * 60), slos,
                            tmp_path, timeout=30)  # fmt: skip
        p = run_async(prober.probe("concurrency", c, None, 30.0, 0, "pilot"))
    recs = [json.loads(line) for line in (Path(p.dir) / REQUESTS_FILE).read_text().splitlines()]
    kinds = [(r["error"] or {}).get("kind") for r in recs]
    assert p.verdict == "pass" and p.errors == 0 and p.requests == pilot_requests(c), (p, kinds)
    assert kinds.count(None) == pilot_requests(c) and kinds.count("cancelled") == c, kinds


def _bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-c", "from loadgen.cli.app import main; main()", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_cli_exit_codes(tmp_path):
    wl = tmp_path / "fixed.toml"
    wl.write_text('description = "fixed"\n[[classes]]\nname = "fixed"\nprompt = 60\noutput = 8\n')
    common = ["--workload", str(wl), "--output-dir", str(tmp_path), "--mode", "concurrency", "--budget", "40"]
    bad = _bench("capacity", "--url", "http://127.0.0.1:9", "--slo", "ttft_p99=1s,tbt_p99=5ms", *common)
    assert bad.returncode == ExitCode.USAGE and "tbt_p99" in bad.stderr
    gone = _bench("capacity", "--url", "http://127.0.0.1:9", "--slo", "ttft_p99=1s", *common)
    assert gone.returncode == ExitCode.SERVER_GONE and "unreachable" in gone.stderr
    no_tokenizer = ("--url", "http://127.0.0.1:9", "--slo", "ttft_p99=1s", "--tokenizer", "none.json")
    notok = _bench("capacity", *no_tokenizer, *common)
    assert notok.returncode == ExitCode.USAGE, notok.stdout + notok.stderr
    assert "--tokenizer: tokenizer 'none.json' not found" in notok.stderr
    with ServiceModelProcess(LIVE) as url:
        # --tokenizer auto (the default): the server has no tokenize endpoint to confirm the bundled one
        never = _bench("capacity", "--url", url, "--slo", "ttft_p90=1ms", "--run-id", "never", *common)
        assert never.returncode == ExitCode.SLO_UNREACHABLE, never.stdout + never.stderr
        assert "unreachable" in never.stdout and "no tokenize endpoint" in " ".join(never.stderr.split())
        easy = _bench("capacity", "--url", url, "--slo", "e2e_p90=60s", "--run-id", "easy", "--max-concurrency", "4",
                      "--tokenizer", "bundled", "--seed", "7", *common)  # fmt: skip
        assert easy.returncode == ExitCode.NOT_SATURATED, easy.stdout + easy.stderr
        assert "still hold" in easy.stdout and "no tokenize endpoint" not in " ".join(easy.stderr.split())
    assert json.loads((tmp_path / "easy" / "capacity.json").read_text())["config"]["tokenizer"] == "bundled"
    # each run its own prompts (a second run against one server read the first's from its cache), --seed repeats them
    seeds = {run: json.loads((tmp_path / run / "capacity.json").read_text())["config"]["seed"] for run in ("never", "easy")}
    assert seeds == {"never": run_seed("never"), "easy": 7}, seeds
    for run in ("never", "easy"):
        doc = json.loads((tmp_path / run / "capacity.json").read_text())["result"]
        assert doc["probes"] and all(p["errors"] == 0 for p in doc["probes"]), (run, doc["probes"])


def test_cli_capacity_per_server_configuration_and_gate(tmp_path):
    """--server/--grid gives one capacity per slot count (known: the slots, as the queue breaks the TTFT SLO),
    and bench gate on capacity passes a result against itself and fails a capacity drop."""
    wl = tmp_path / "fixed.toml"
    wl.write_text('description = "fixed"\n[[classes]]\nname = "fixed"\nprompt = 60\noutput = 8\n')
    slo = "ttft_p90=40ms"
    model = json.dumps({k: v for k, v in vars(LIVE).items() if k != "slots"}).replace("{", "{{").replace("}", "}}")
    server = f"python -m loadgen.testservers.servicemodel --host 127.0.0.1 --port {{port}} --slots {{np}} --model '{model}'"
    r = _bench("capacity", "--server", server, "--grid", "np=2,4", "--slo", slo, "--mode", "concurrency",
               "--workload", str(wl), "--budget", "60", "--output-dir", str(tmp_path), "--run-id", "grid")  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads((tmp_path / "grid" / "capacity.json").read_text())
    got = {e["labels"]["np"]: e for e in doc["configs"]}
    assert sorted(got) == ["2", "4"] and "probes: np2" in r.stdout and "probes: np4" in r.stdout
    assert (tmp_path / "grid" / "capacity.html").stat().st_size > 100_000
    for np_, e in got.items():
        truth = true_capacity(ServiceModel(**{**vars(LIVE), "slots": int(np_)}), (60, 8), parse_slos(slo, percentiles=True), "concurrency")
        lo, hi = e["interval"]
        assert e["status"] == "ok" and lo <= truth < hi, (np_, truth, e["interval"])
        assert e["capacity"] == lo and e["goodput"] > 0 and f"np{np_}: capacity {int(lo)} concurrency" in r.stdout
        assert all(p["errors"] == 0 for p in e["probes"])
    # the gate: the same result passes; a candidate whose capacity fell by half is a regression
    same = _bench("gate", "--baseline", str(tmp_path / "grid"), "--candidate", str(tmp_path / "grid"),
                  "--metric", "capacity:-10%")  # fmt: skip
    assert same.returncode == 0, same.stdout + same.stderr
    worse = tmp_path / "worse"
    worse.mkdir()
    for e in doc["configs"]:
        e["interval"] = [x / 2 for x in e["interval"]]
    (worse / "capacity.json").write_text(json.dumps(doc))
    drop = _bench("gate", "--baseline", str(tmp_path / "grid"), "--candidate", str(worse), "--metric", "capacity:-10%")
    assert drop.returncode == 1, drop.stdout + drop.stderr
    other = _bench("gate", "--baseline", str(tmp_path / "grid"), "--candidate", str(worse), "--metric", "capacity:+10%")
    assert other.returncode == 2 and "capacity:-X%" in other.stdout + other.stderr


def test_cli_sigint_stops_the_search_and_keeps_the_probes(tmp_path):
    """Ctrl-C mid-search: exit 130, capacity.json says interrupted and keeps the probes that finished."""
    wl = tmp_path / "fixed.toml"
    wl.write_text('description = "fixed"\n[[classes]]\nname = "fixed"\nprompt = 60\noutput = 8\n')
    with ServiceModelProcess(LIVE) as url:
        cmd = [sys.executable, "-c", "from loadgen.cli.app import main; main()", "capacity", "--url", url, "--slo",
               "tpot_p50=30ms", "--mode", "concurrency", "--workload", str(wl), "--output-dir", str(tmp_path),
               "--run-id", "int"]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=sigint_default)  # fmt: skip
        path = tmp_path / "int" / "probes"
        deadline = time.monotonic() + 60
        while not (path.exists() and len(list(path.iterdir())) >= 2) and time.monotonic() < deadline:
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == ExitCode.INTERRUPTED, out + err
    doc = json.loads((tmp_path / "int" / "capacity.json").read_text())["result"]
    assert doc["status"] == "interrupted" and "SIGINT" in doc["message"] and len(doc["probes"]) >= 1
    assert all(p["errors"] == 0 for p in doc["probes"])
