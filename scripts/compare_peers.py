"""Do `bench run` and vLLM's `bench serve` measure the same thing? Same server, same traffic, same time.

    .venv/bin/python scripts/compare_peers.py [--servers reference,llama-server] [--concurrency 1,4,16]
        [--rounds 4] [--design paired|interleaved] [--out results/peers-<time>] [--lock FILE]

For each server (the bundled reference server and llama-server, started here on a free loopback port
with 2 threads; ``null``, loadgen.nullserver pacing a known stream, checks the definitions alone) and
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
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from backends.launcher import ServerProcess, bundled_model, free_port, llama_server_binary  # noqa: E402
from workloads.loader import load_workload  # noqa: E402

PROMPT, OUTPUT = 32, 128
# Requests per tool and concurrency: 12-24 waves, so that one wave's TTFT does not set the median (at c = 1 each
# request is one tool's alone: its TTFT varies most).
REQUESTS = {1: 24, 4: 32, 16: 96}
FIGURES = ("ttft_ms", "tpot_ms", "itl_ms", "output_tok_s")
NULL_PACE = {"ttft": 0.05, "itl": 0.01}  # the null server's stream: TTFT 50 ms, then a token every 10 ms
# Paired: the first wave released in pairs this far apart, so that each engine step's group holds as many
# requests of one tool as of the other (a closed loop of equal requests keeps its first wave's groups: docs/metrics.md).
STAGGER_S = 0.1
PRIMER = "The server is busy with this request while the first pair of requests arrives. " * 2
# Taking turns (c = 1): a request starts this long after the other tool's ended, once that tool's own work after
# its request (records, its next task) is done and cannot slow the next prefill on the shared cores.
SETTLE_S = 0.05
CHILDREN: list[subprocess.Popen[str]] = []  # every client started, so that none outlives the script
WORKLOAD = f"""description = "Peer agreement: {PROMPT}-token prompts, exactly {OUTPUT} output tokens."
api = "completions"
[[classes]]
name = "peer"
prompt = {PROMPT}
output = {OUTPUT}
ignore_eos = true
temperature = 0.0
"""
# Shared by both drivers: the start barrier, then the gate each request of the first wave (or, at c = 1, every
# request: the turn) passes before its start time is taken. FIFOs under PEERS_GATE (unset: neither): a tool waits
# for a byte without using the CPU (with a file polled every 0.5 ms, vLLM's requests ran 3x slower).
GATE = """
import asyncio
import os
gate, me, other = os.environ.get("PEERS_GATE", ""), os.environ.get("PEERS_ME", ""), os.environ.get("PEERS_OTHER", "")
turns, wave = os.environ.get("PEERS_TURNS") == "1", int(os.environ.get("PEERS_WAVE", "0"))
settle = float(os.environ.get("PEERS_SETTLE_S", "0"))
# this tool's own FIFOs stay open from the start, so a byte given before it waits is kept
mine = {name: os.open(gate + "." + name + "-" + me, os.O_RDWR) for name in ("go", "turn", "wave")} if gate else {}
calls, in_line = [0], asyncio.Lock()  # one reader per FIFO at a time: waiters take their bytes in order
async def take(name):
    async with in_line:
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        loop.add_reader(mine[name], ready.set_result, None)
        try:
            await ready
        finally:
            loop.remove_reader(mine[name])
        os.read(mine[name], 1)
def give(name):
    fd = os.open(gate + "." + name, os.O_RDWR)
    os.write(fd, b"x")
    os.close(fd)
async def at_barrier():
    open(gate + "." + me, "w").close()  # after its FIFOs are open
    await take("go")
def gated(send, timed=lambda args: args):
    # turns: every request waits for its turn, then settles (the other client's work after its request ends);
    # otherwise the first wave's requests wait for their pair's release. `timed` restarts the request's clock.
    async def run(*args, **kwargs):
        k, calls[0] = calls[0], calls[0] + 1
        if turns or k < wave:
            if k == wave - 1 and not turns:  # the first wave's earlier requests are at the gate already
                open(gate + ".waiting-" + me, "w").close()
            await take("turn" if turns else "wave")
            if turns:
                await asyncio.sleep(settle)
            args = timed(args)
        try:
            return await send(*args, **kwargs)
        finally:
            if turns:
                give("turn-" + other)
    return run
"""
VLLM_DRIVER = GATE + """
import sys
import aiohttp
from vllm.benchmarks import serve
if os.environ.get("PEERS_FORCE_CLOSE") == "1":
    class Closing(aiohttp.TCPConnector):  # a new connection per request (serve.py builds its connector by name)
        def __init__(self, *args, **kwargs):
            kwargs.pop("keepalive_timeout", None)  # aiohttp refuses it together with force_close
            super().__init__(*args, **{**kwargs, "force_close": True})
    aiohttp.TCPConnector = Closing
if gate:  # serve.benchmark reads the server's metrics once just before its clock starts: wait there
    fetch, waited = serve.fetch_diffusion_metrics, []
    async def fetch_then_wait(*args, **kwargs):
        got = await fetch(*args, **kwargs)
        if not waited:
            waited.append(True)
            await at_barrier()
        return got
    serve.fetch_diffusion_metrics = fetch_then_wait
if gate:  # the gate is passed before the request function takes its start time
    serve.ASYNC_REQUEST_FUNCS["openai"] = gated(serve.ASYNC_REQUEST_FUNCS["openai"])
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser()
serve.add_cli_args(p)
serve.main(p.parse_args(sys.argv[1:]))
"""
BENCH_DRIVER = GATE + """
import sys
from loadgen import cli, engine
if gate:  # the closed loop's slots start here, the point set up (its rates count from the first send)
    closed = engine._Dispatch.closed
    async def wait_then_run(self):
        await at_barrier()
        return await closed(self)
    engine._Dispatch.closed = wait_then_run
if gate:  # the gate is passed before the session's intended time (the wait for it is not the server's)
    # session(self, sess, warmup, index, intended, first request): the closed loop's intended time is a[4]
    engine._Dispatch.session = gated(engine._Dispatch.session, lambda a: (*a[:4], a[0].clock.now(), a[5]))
sys.argv[0] = "bench"
cli.main()
"""


def server_argv(name: str, port: int) -> list[str]:
    if name == "reference":
        return [str(ROOT / ".venv/bin/python"), "-m", "reference_server", "--threads", "2", "--port", str(port)]
    if name == "llama-server":
        return [llama_server_binary(), "-m", str(bundled_model()), "--host", "127.0.0.1", "--port", str(port),
                "-np", "16", "-c", "32768", "--metrics", "-t", "2"]  # fmt: skip
    if name == "null":  # loadgen.nullserver pacing a known stream: a check of the definitions alone
        return [str(ROOT / ".venv/bin/python"), "-m", "loadgen.nullserver", "--port", str(port),
                "--behaviour", json.dumps(NULL_PACE)]  # fmt: skip
    raise SystemExit(f"unknown server {name!r}: reference, llama-server or null")


def vllm_setup() -> tuple[str, str]:
    out = subprocess.run(["bash", str(ROOT / "scripts/setup_vllm.sh")], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"vLLM setup failed (scripts/setup_vllm.sh):\n{out.stderr[-2000:]}")
    python, hf_dir = out.stdout.strip().splitlines()[-2:]
    return python, hf_dir


@dataclass
class Tool:
    """One client's run: how to start it, where it writes, how to read its figures."""

    name: str
    argv: list[str]
    out: Path
    env: dict[str, str]

    def start(self) -> subprocess.Popen[str]:
        log = self.out.with_name(self.out.name + ".log").open("w")
        proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, text=True, env=self.env)
        CHILDREN.append(proc)
        return proc

    def result(self, proc: subprocess.Popen[str]) -> dict[str, float]:
        if proc.wait(timeout=900) != 0:
            log = self.out.with_name(self.out.name + ".log").read_text()
            raise SystemExit(f"{self.name} failed (exit {proc.returncode}):\n{log[-4000:]}")
        return read_vllm(self.out) if self.name == "vllm" else read_bench(self.out)


def vllm_tool(python: str, hf_dir: str, url: str, model: str, c: int, n: int, seed: int, workload: Path, out: Path,
              force_close: bool) -> Tool:
    prompts = out.with_name(out.stem + "-prompts.jsonl")
    write_prompts(workload, seed, n, prompts)
    argv = [python, "-c", VLLM_DRIVER, "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", hf_dir, "--served-model-name", model, "--tokenizer", hf_dir, "--dataset-name", "custom",
            "--dataset-path", str(prompts), "--custom-output-len", str(OUTPUT), "--skip-chat-template",
            "--ignore-eos", "--max-concurrency", str(c), "--num-prompts", str(n), "--request-rate", "inf",
            "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result",
            "--save-detailed", "--result-dir", str(out.parent), "--result-filename", out.name,
            "--disable-tqdm"]  # fmt: skip
    # llama-server closes a kept-alive connection after a stream while aiohttp may already reuse it: vLLM's
    # client then loses the request (no retry), so against it vLLM opens a connection per request.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PEERS_FORCE_CLOSE": "1" if force_close else "0"}
    return Tool("vllm", argv, out, env)


def write_prompts(workload: Path, seed: int, n: int, path: Path) -> None:
    """The prompts `bench run` would send with ``seed``, as vLLM's custom dataset: both tools send the same
    prompts (same token counts, same kind of text, a fresh seed per run)."""
    sessions = load_workload(workload).sessions(seed)
    with path.open("w") as f:
        for sess in itertools.islice(sessions, n):
            f.write(json.dumps({"prompt": sess.first().prompt}) + "\n")


def read_vllm(out: Path) -> dict[str, float]:
    r = json.loads(out.read_text())
    return {"ttft_ms": r["median_ttft_ms"], "tpot_ms": r["median_tpot_ms"], "itl_ms": r["median_itl_ms"],
            "output_tok_s": r["output_throughput"], "errors": r["num_prompts"] - r["completed"]}  # fmt: skip


def bench_tool(url: str, c: int, n: int, seed: int, workload: Path, out: Path) -> Tool:
    argv = [str(ROOT / ".venv/bin/python"), "-c", BENCH_DRIVER, "run", "--url", url, "--workload", str(workload),
            "--concurrency", str(c), "--num-requests", str(n), "--seed", str(seed), "--output-dir", str(out.parent),
            "--run-id", out.name, "--poll-hz", "0"]  # fmt: skip
    return Tool("bench", argv, out, dict(os.environ))


def read_bench(out: Path) -> dict[str, float]:
    s = json.loads(next(out.glob("points/*/summary.json")).read_text())
    lat = s["latency"]
    return {"ttft_ms": lat["ttft"]["p50"] * 1e3, "tpot_ms": lat["tpot"]["p50"] * 1e3,
            "itl_ms": lat["chunk_gap"]["p50"] * 1e3, "itl_token_ms": lat["itl"]["p50"] * 1e3,
            "output_tok_s": s["throughput"]["whole"]["output_tok_per_s"],
            "errors": s["counts"]["errors"] + s["counts"]["incomplete"]}  # fmt: skip


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


def stop_children() -> None:
    for proc in CHILDREN:
        if proc.poll() is None:
            proc.kill()


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


def report(rows_path: Path, out: Path, tol: float) -> int:
    rows: dict[str, dict[str, dict[str, list[dict[str, float]]]]] = {}
    for line in rows_path.read_text().splitlines():
        r = json.loads(line)
        rows.setdefault(r["server"], {}).setdefault(str(r["c"]), {}).setdefault(r["tool"], []).append(r)
    rounds = max(len(t) for per_c in rows.values() for tools in per_c.values() for t in tools.values())
    lines = ["| server | c | design | figure | vLLM bench serve | bench run | diff |", "|---|---|---|---|---|---|---|"]
    failed = False
    summary: dict = {}
    for server, per_c in rows.items():
        for c, tools in per_c.items():
            design = "/".join(sorted({r.get("design", "interleaved") for t in tools.values() for r in t}))
            pairs = {r["round"]: r for r in tools["vllm"]}
            for fig in FIGURES:
                v = statistics.median(r[fig] for r in tools["vllm"])
                b = statistics.median(r[fig] for r in tools["bench"])
                if design == "paired":  # the rounds' own differences: each round holds both tools' conditions
                    diff = statistics.median(r[fig] / pairs[r["round"]][fig] - 1 for r in tools["bench"])
                else:
                    diff = b / v - 1 if v else float("nan")
                failed |= not abs(diff) <= tol
                summary.setdefault(server, {}).setdefault(c, {"design": design})[fig] = {"vllm": v, "bench": b,
                                                                                          "diff": diff}
                lines.append(f"| {server} | {c} | {design} | {fig} | {v:.2f} | {b:.2f} | {diff:+.1%} |")
            tok = statistics.median(r["itl_token_ms"] for r in tools["bench"])
            summary[server][c]["itl_token_ms"] = tok
            errors = sum(r["errors"] for t in tools.values() for r in t)
            summary[server][c]["errors"] = errors
            failed |= errors > 0
    text = "\n".join(lines) + (f"\n\nmedians over {rounds} rounds (diff, paired: the median of the rounds' own differences); "
                               f"load average at the end {os.getloadavg()[0]:.2f}\n")  # fmt: skip
    (out / "peers.md").write_text(text)
    (out / "peers.json").write_text(json.dumps(summary, indent=1))
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
