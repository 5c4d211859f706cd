"""Do `bench run` and vLLM's `bench serve` measure the same thing? Same server, same traffic, same time.

    .venv/bin/python scripts/compare_peers.py [--servers reference,llama-server] [--concurrency 1,4,16]
        [--rounds 4] [--design paired|interleaved] [--out results/peers-<time>] [--lock FILE]

For each server (the bundled reference server and llama-server, started here on a free loopback port
with 2 threads; ``null``, loadgen.testservers.null pacing a known stream, checks the definitions alone) and
concurrency c it runs, per round, vLLM's `bench serve` (``vllm.benchmarks.serve.main`` in the venv of
scripts/setup_vllm.sh) and `bench run`, both closed loop on ``/v1/completions`` with the same traffic:
32-token prompts drawn from a fresh seed per run (vLLM reads `bench run`'s prompts as its custom dataset),
exactly 128 output tokens (EOS ignored), greedy.

* ``paired`` (the default, for even c): both tools at once, each at c / 2 with the same number of
  requests, so the server runs c streams and both clients measure the *same* batches. Each tool does its
  own start-up and then waits at a barrier just before its clock starts (vLLM: where serve.benchmark reads
  the server's metrics the last time before it; ours: where the closed loop's slots start); both are let go
  together, and their first waves go in pairs (one request of each tool, into a busy server), so that every
  engine step holds both tools alike. This cancels what makes two runs on this machine differ: the
  servers' speed drifts 10-40 % within minutes on 2 shared cores, and in a closed loop of equal-length
  requests the way the first wave splits over engine steps persists for the whole run (docs/metrics.md).
  At c = 1 the two take turns instead: each waits for its turn before a request (before vLLM's request
  function takes its start time, before our session's intended time) and hands it over when the request
  ends (the next one starts ``SETTLE_S`` later), so they alternate request by request and the server sees one
  stream, as at c = 1.
* ``interleaved`` (and odd c > 1): one tool after the other, the order alternating between rounds, each at c.

Then it compares the medians over rounds of each tool's TTFT p50, TPOT p50, ITL p50 and output tok/s
(for paired rounds: each tool's own, i.e. half the server's), aligned on vLLM's definitions
(docs/metrics.md, "Agreement with vLLM's bench serve"):

* TTFT: both from the request's send to the first chunk with choices (ours: with content; the same
  chunk here, as /v1/completions has no role chunk);
* TPOT: ours (last − first content event) / (out − tokens of the first read); vLLM's (latency − TTFT) /
  (out − 1) where latency ends at the last chunk with choices;
* ITL: vLLM's is the gap between consecutive chunks with choices: ours `chunk_gap` (and `itl`, per token);
* output tok/s: vLLM's total output tokens / benchmark duration = our `throughput.whole`.

Writes every measurement to ``rows.jsonl`` as it is taken, then ``peers.json`` and ``peers.md`` (the
table) under ``--out`` (``--report-only`` redoes them from ``rows.jsonl``); exits 1 when a request failed
or a figure differs by more than ``--tolerance`` (3 %). ``--lock`` holds that file (flock) while a server
runs; SIGTERM stops the server it started.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import httpx

# first: compare_peers_clients puts ROOT on sys.path for the project's imports below
from compare_peers_clients import ROOT, WORKLOAD, Tool, bench_tool, stop_children, vllm_tool
from compare_peers_report import report

from backends.launcher import ServerProcess, bundled_model, free_port, llama_server_binary

# Requests per tool and concurrency: 12-24 waves, so that one wave's TTFT does not set the median (at c = 1 each
# request is one tool's alone: its TTFT varies most).
REQUESTS = {1: 24, 4: 32, 16: 96}
NULL_PACE = {"ttft": 0.05, "itl": 0.01}  # the null server's stream: TTFT 50 ms, then a token every 10 ms
# Paired: the first wave released in pairs this far apart, so that each engine step's group holds as many
# requests of one tool as of the other (a closed loop of equal requests keeps its first wave's groups: docs/metrics.md).
STAGGER_S = 0.1
PRIMER = "The server is busy with this request while the first pair of requests arrives. " * 2
# Taking turns (c = 1): a request starts this long after the other tool's ended, once that tool's own work after
# its request (records, its next task) is done and cannot slow the next prefill on the shared cores.
SETTLE_S = 0.05


def server_argv(name: str, port: int) -> list[str]:
    if name == "reference":
        return [str(ROOT / ".venv/bin/python"), "-m", "reference_server", "--threads", "2", "--port", str(port)]
    if name == "llama-server":
        return [llama_server_binary(), "-m", str(bundled_model()), "--host", "127.0.0.1", "--port", str(port),
                "-np", "16", "-c", "32768", "--metrics", "-t", "2"]  # fmt: skip
    if name == "null":  # loadgen.testservers.null pacing a known stream: a check of the definitions alone
        return [str(ROOT / ".venv/bin/python"), "-m", "loadgen.testservers.null", "--port", str(port),
                "--behaviour", json.dumps(NULL_PACE)]  # fmt: skip
    raise SystemExit(f"unknown server {name!r}: reference, llama-server or null")


def vllm_setup() -> tuple[str, str]:
    out = subprocess.run(["bash", str(ROOT / "scripts/setup_vllm.sh")], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"vLLM setup failed (scripts/setup_vllm.sh):\n{out.stderr[-2000:]}")
    python, hf_dir = out.stdout.strip().splitlines()[-2:]
    return python, hf_dir


def wait_for(what: str, ready: Callable[[], bool], procs: list[subprocess.Popen[str]], timeout_s: float) -> None:
    """Poll ``ready`` every millisecond or so; a client that exits first or a timeout ends the script."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise SystemExit(f"gave up waiting for {what} (a client exited or {timeout_s:.0f} s passed)")
        time.sleep(0.001)


def paired(tools: tuple[Tool, Tool], gate: Path, per_tool: int, turns: bool, url: str, model: str
           ) -> dict[str, dict[str, float]]:  # fmt: skip
    """Both clients at once: each waits at the barrier just before its clock starts, both are let go together.
    With ``turns`` they alternate request by request, ``tools[0]`` first, each request starting ``SETTLE_S`` after
    the other's ended; otherwise their first waves go in pairs (one request of each tool), ``STAGGER_S`` apart,
    into a busy server."""
    kinds = ("", "go-", "turn-", "wave-", "waiting-")
    names = [kind + t.name for t in tools for kind in kinds]
    at = {name: gate.with_name(f"{gate.name}.{name}") for name in names}
    for name, path in at.items():
        path.unlink(missing_ok=True)
        if name.startswith(("go-", "turn-", "wave-")):
            os.mkfifo(path)
    for me, other in (tools, tools[::-1]):
        me.env.update(PEERS_GATE=str(gate), PEERS_ME=me.name, PEERS_OTHER=other.name, PEERS_TURNS=str(int(turns)),
                      PEERS_WAVE=str(per_tool), PEERS_SETTLE_S=str(SETTLE_S))  # fmt: skip
    procs = [t.start() for t in tools]
    wait_for("both clients at the barrier", lambda: all(at[t.name].exists() for t in tools), procs, 600)
    for t in tools:
        give(at[f"go-{t.name}"])
    primer = None
    if turns:
        give(at[f"turn-{tools[0].name}"])
    else:  # released only once both first waves wait at their gates (our client took 7.7 ms longer to get there)
        wait_for("both first waves at their gates", lambda: all(at[f"waiting-{t.name}"].exists() for t in tools),
                 procs, 600)  # fmt: skip
        primer = keep_busy(url, model)
        for k in range(per_tool):
            for t in tools if k % 2 == 0 else tools[::-1]:
                give(at[f"wave-{t.name}"])
            time.sleep(STAGGER_S)
    got = {t.name: t.result(p) for t, p in zip(tools, procs, strict=True)}
    if primer:
        primer.join()
    return got


def keep_busy(url: str, model: str) -> threading.Thread:
    """Start a short request of our own and return once the server streams it: an idle engine steps as soon as
    one request arrives, so the first pair, arriving a fraction of a millisecond apart, would be split over two
    steps, and in a closed loop of equal requests that split lasts the whole run (seen: vLLM's first request
    prefilled alone at 47 ms, ours joined the next step at 100 ms, and every wave after kept that order)."""
    streaming = threading.Event()

    def run() -> None:
        body = {"model": model, "prompt": PRIMER, "max_tokens": 8, "ignore_eos": True, "temperature": 0.0,
                "stream": True}  # fmt: skip
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for _ in r.iter_bytes():
                    streaming.set()
        finally:
            streaming.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    streaming.wait(60)
    return thread


def give(fifo: Path) -> None:
    fd = os.open(fifo, os.O_RDWR)  # read-write: opening never waits for the reader
    os.write(fd, b"x")
    os.close(fd)


def seed(rnd: int, c: int, tool: str) -> int:
    """A seed of its own for every run: prompts never repeat between runs, so neither server's prefix / prompt
    cache (the reference server's prefix caching, llama-server's per-slot prompt cache) shortens a prefill."""
    return 1 + 100_000 * (rnd + 1) + 100 * c + ("vllm", "bench").index(tool)


def model_id(url: str) -> str:
    return str(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", default="reference,llama-server")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--design", choices=("paired", "interleaved"), default="paired",
                    help="paired: both clients at once, each at c/2 (c even); interleaved: one after the other")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / time.strftime("peers-%Y%m%dT%H%M%SZ", time.gmtime()))
    ap.add_argument("--lock", type=Path, default=None, help="hold this file (flock) while a server runs")
    ap.add_argument("--tolerance", type=float, default=0.03)
    ap.add_argument("--report-only", action="store_true", help="only redo the table from --out/rows.jsonl")
    args = ap.parse_args(argv)
    rows_path = args.out / "rows.jsonl"
    if args.report_only:
        return report(rows_path, args.out, args.tolerance)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the servers started here are stopped
    concs = [int(c) for c in args.concurrency.split(",")]
    python, hf_dir = vllm_setup()
    args.out.mkdir(parents=True, exist_ok=True)
    workload = args.out / "peer.toml"
    workload.write_text(WORKLOAD)
    for server in args.servers.split(","):
        with ExitStack() as stack:
            if args.lock:
                lock = stack.enter_context(args.lock.open("a"))
                fcntl.flock(lock, fcntl.LOCK_EX)
            port = free_port()
            srv = stack.enter_context(ServerProcess(server_argv(server, port), port, args.out / f"{server}.log",
                                                    health_timeout_s=600))  # fmt: skip
            url, model = srv.base_url, model_id(srv.base_url)
            stack.callback(stop_children)  # clients still running when the script is stopped (SIGTERM) end too
            warm = bench_tool(url, 4, 4, seed(-1, 4, "bench"), workload, args.out / f"{server}-warmup")
            warm.result(warm.start())  # warm the server up once
            for rnd in range(args.rounds):
                for c in concs:
                    n = REQUESTS.get(c, 2 * c)
                    tag = f"{server}-c{c}-r{rnd}"
                    pair = args.design == "paired" and (c == 1 or c % 2 == 0)
                    per_tool = max(c // 2, 1) if pair else c
                    vllm = vllm_tool(python, hf_dir, url, model, per_tool, n, seed(rnd, c, "vllm"), workload,
                                     args.out / f"{tag}-vllm.json", force_close=server == "llama-server")
                    bench = bench_tool(url, per_tool, n, seed(rnd, c, "bench"), workload, args.out / f"{tag}-bench")
                    order = (vllm, bench) if rnd % 2 == 0 else (bench, vllm)  # who goes first alternates
                    if pair:
                        got = paired(order, args.out / f"{tag}.gate", per_tool, c == 1, url, model)
                    else:
                        got = {t.name: t.result(t.start()) for t in order}
                    for tool, figs in got.items():
                        row = {"server": server, "c": c, "round": rnd, "tool": tool,
                               "design": "paired" if pair else "interleaved", **figs}  # fmt: skip
                        with rows_path.open("a") as f:
                            f.write(json.dumps(row) + "\n")
                        print(f"{tag} {tool}: " + ", ".join(f"{k} {v:.2f}" for k, v in figs.items()), flush=True)
    return report(rows_path, args.out, args.tolerance)


if __name__ == "__main__":
    sys.exit(main())
