"""Do `bench run` and vLLM's `bench serve` measure the same thing? Same server, same traffic, interleaved.

    .venv/bin/python scripts/compare_peers.py [--servers reference,llama-server] [--concurrency 1,4,16]
        [--rounds 3] [--out results/peers-<time>] [--lock FILE]

For each server (the bundled reference server and llama-server, started here on a free loopback port
with 2 threads; ``null``, loadgen.nullserver pacing a known stream, checks the definitions alone) it runs, per round and concurrency, vLLM's `bench serve` (``vllm.benchmarks.serve.main``
in the venv of scripts/setup_vllm.sh: random 32-token prompts, exactly 128 output tokens with
``--ignore-eos``, ``--max-concurrency c``) and `bench run` (a workload of 32-token prompts, 128 output
tokens, EOS ignored, closed loop at c), both on ``/v1/completions`` with the same number of requests; the
order of the two alternates between rounds so the machine's drift hits both alike. Then it compares the
medians over rounds of each tool's TTFT p50, TPOT p50, ITL p50 and output tok/s, aligned on vLLM's
definitions (docs/metrics.md, "Agreement with vLLM's bench serve"):

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
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from backends.launcher import ServerProcess, bundled_model, free_port, llama_server_binary  # noqa: E402

PROMPT, OUTPUT = 32, 128
REQUESTS = {1: 10, 4: 32, 16: 128}  # per concurrency: 8-10 waves; fewer let one wave's TTFT swing the median
FIGURES = ("ttft_ms", "tpot_ms", "itl_ms", "output_tok_s")
NULL_PACE = {"ttft": 0.05, "itl": 0.01}  # the null server's stream: TTFT 50 ms, then a token every 10 ms
WORKLOAD = f"""description = "Peer agreement: {PROMPT}-token prompts, exactly {OUTPUT} output tokens."
api = "completions"
[[classes]]
name = "peer"
prompt = {PROMPT}
output = {OUTPUT}
ignore_eos = true
temperature = 0.0
"""
VLLM_DRIVER = """
import os
import sys
import aiohttp
from vllm.benchmarks import serve
if os.environ.get("PEERS_FORCE_CLOSE") == "1":
    class Closing(aiohttp.TCPConnector):  # a new connection per request (serve.py builds its connector by name)
        def __init__(self, *args, **kwargs):
            kwargs.pop("keepalive_timeout", None)  # aiohttp refuses it together with force_close
            super().__init__(*args, **{**kwargs, "force_close": True})
    aiohttp.TCPConnector = Closing
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser()
serve.add_cli_args(p)
serve.main(p.parse_args(sys.argv[1:]))
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


def run_vllm(python: str, hf_dir: str, url: str, model: str, c: int, n: int, out: Path,
             force_close: bool = False) -> dict[str, float]:
    argv = [python, "-c", VLLM_DRIVER, "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", hf_dir, "--served-model-name", model, "--tokenizer", hf_dir, "--dataset-name", "random",
            "--random-input-len", str(PROMPT), "--random-output-len", str(OUTPUT), "--random-range-ratio", "0",
            "--ignore-eos", "--max-concurrency", str(c), "--num-prompts", str(n), "--request-rate", "inf",
            "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result",
            "--save-detailed", "--result-dir", str(out.parent), "--result-filename", out.name,
            "--disable-tqdm"]  # fmt: skip
    # llama-server closes a kept-alive connection after a stream while aiohttp may already reuse it: vLLM's
    # client then loses the request (no retry), so against it vLLM opens a connection per request.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PEERS_FORCE_CLOSE": "1" if force_close else "0"}
    res = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"vLLM bench serve failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    r = json.loads(out.read_text())
    return {"ttft_ms": r["median_ttft_ms"], "tpot_ms": r["median_tpot_ms"], "itl_ms": r["median_itl_ms"],
            "output_tok_s": r["output_throughput"], "errors": r["num_prompts"] - r["completed"]}  # fmt: skip


def run_bench(url: str, c: int, n: int, workload: Path, out: Path) -> dict[str, float]:
    argv = [str(ROOT / ".venv/bin/bench"), "run", "--url", url, "--backend", "openai", "--workload", str(workload),
            "--concurrency", str(c), "--num-requests", str(n), "--output-dir", str(out.parent),
            "--run-id", out.name, "--poll-hz", "0"]  # fmt: skip
    res = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"bench run failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    s = json.loads(next(out.glob("points/*/summary.json")).read_text())
    lat = s["latency"]
    return {"ttft_ms": lat["ttft"]["p50"] * 1e3, "tpot_ms": lat["tpot"]["p50"] * 1e3,
            "itl_ms": lat["chunk_gap"]["p50"] * 1e3, "itl_token_ms": lat["itl"]["p50"] * 1e3,
            "output_tok_s": s["throughput"]["whole"]["output_tok_per_s"],
            "errors": s["counts"]["errors"] + s["counts"]["incomplete"]}  # fmt: skip


def model_id(url: str) -> str:
    return str(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", default="reference,llama-server")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=3)
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
            model = model_id(srv.base_url)
            run_bench(srv.base_url, 4, 4, workload, args.out / f"{server}-warmup")  # warm the server up once
            for rnd in range(args.rounds):
                for c in concs:
                    n = REQUESTS.get(c, 2 * c)
                    tag = f"{server}-c{c}-r{rnd}"
                    for tool in ("vllm", "bench") if rnd % 2 == 0 else ("bench", "vllm"):
                        if tool == "vllm":
                            got = run_vllm(python, hf_dir, srv.base_url, model, c, n, args.out / f"{tag}-vllm.json",
                                           force_close=server == "llama-server")
                        else:
                            got = run_bench(srv.base_url, c, n, workload, args.out / f"{tag}-bench")
                        row = {"server": server, "c": c, "round": rnd, "tool": tool, **got}
                        with rows_path.open("a") as f:
                            f.write(json.dumps(row) + "\n")
                        print(f"{tag} {tool}: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()), flush=True)
    return report(rows_path, args.out, args.tolerance)


def report(rows_path: Path, out: Path, tol: float) -> int:
    rows: dict[str, dict[str, dict[str, list[dict[str, float]]]]] = {}
    for line in rows_path.read_text().splitlines():
        r = json.loads(line)
        rows.setdefault(r["server"], {}).setdefault(str(r["c"]), {}).setdefault(r["tool"], []).append(r)
    rounds = max(len(t) for per_c in rows.values() for tools in per_c.values() for t in tools.values())
    lines = ["| server | c | figure | vLLM bench serve | bench run | diff |", "|---|---|---|---|---|---|"]
    failed = False
    summary: dict = {}
    for server, per_c in rows.items():
        for c, tools in per_c.items():
            for fig in FIGURES:
                v = statistics.median(r[fig] for r in tools["vllm"])
                b = statistics.median(r[fig] for r in tools["bench"])
                diff = b / v - 1 if v else float("nan")
                failed |= not abs(diff) <= tol
                summary.setdefault(server, {}).setdefault(c, {})[fig] = {"vllm": v, "bench": b, "diff": diff}
                lines.append(f"| {server} | {c} | {fig} | {v:.2f} | {b:.2f} | {diff:+.1%} |")
            tok = statistics.median(r["itl_token_ms"] for r in tools["bench"])
            summary[server][c]["itl_token_ms"] = tok
            errors = sum(r["errors"] for t in tools.values() for r in t)
            summary[server][c]["errors"] = errors
            failed |= errors > 0
    text = "\n".join(lines) + (f"\n\nmedians over {rounds} interleaved rounds; "
                               f"load average at the end {os.getloadavg()[0]:.2f}\n")  # fmt: skip
    (out / "peers.md").write_text(text)
    (out / "peers.json").write_text(json.dumps(summary, indent=1))
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
