"""The two clients ``compare_peers.py`` runs against one server: vLLM's `bench serve` and `bench run`, each
started as a driver program (the shared start barrier and request gate, then the tool), on the same traffic."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the project from this tree, for compare_peers.py too
from workloads.loader import load_workload  # noqa: E402

PROMPT, OUTPUT = 32, 128
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
from loadgen.cli import app as cli
from loadgen.dispatch import dispatcher as dispatch
if gate:  # the closed loop's slots start here, the point set up (its rates count from the first send)
    closed = dispatch.Dispatch.closed
    async def wait_then_run(self):
        await at_barrier()
        return await closed(self)
    dispatch.Dispatch.closed = wait_then_run
if gate:  # the gate is passed before the session's intended time (the wait for it is not the server's)
    # session(self, sess, warmup, index, intended, first request): the closed loop's intended time is a[4]
    dispatch.Dispatch.session = gated(dispatch.Dispatch.session, lambda a: (*a[:4], a[0].clock.now(), a[5]))
sys.argv[0] = "bench"
cli.main()
"""


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


def stop_children() -> None:
    for proc in CHILDREN:
        if proc.poll() is None:
            proc.kill()
