"""Does llama.cpp's backend still need ``Connection: close``? Interleaved A/B against one llama-server.

    .venv/bin/python scripts/keepalive_ab.py --rounds 3 --concurrency 16 --num-requests 64

Side ``close``: the ``llamacpp`` backend as it is (``Connection: close``: one fresh connection per
request). Side ``keepalive``: the same backend without that header (pooled connections, with the client's
one retry when llama-server has closed the pooled connection). Same server, workload (32-token prompts, exactly 128
output tokens) and client; rounds alternate the order. Prints one JSON line per run and the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from backends.base import HttpCall
from backends.launcher import ServerProcess, free_port, render_command
from backends.llamacpp import NO_KEEPALIVE, LlamaCppBackend
from loadgen.dispatch.engine import PointOptions, run_point
from loadgen.dispatch.loadspec import LoadSpec
from loadgen.dispatch.signals import run_async
from loadgen.timing.clock import RunClock
from workloads.contracts import GenRequest, read_jsonl
from workloads.loader import load_workload

SERVER = "llama-server -m {model} -t 1 -c 8192 -np 16 --metrics --host 127.0.0.1 --port {port}"
WAVES = """
[[classes]]
name = "waves"
prompt = { dist = "fixed", value = 32 }
output = { dist = "fixed", value = 128 }
"""


class KeepAliveLlamaCpp(LlamaCppBackend):
    """The backend with pooled keep-alive connections."""

    def build(self, req: GenRequest) -> HttpCall:
        call = super().build(req)
        for name in NO_KEEPALIVE:
            call.headers.pop(name)
        return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--client", default="aiohttp")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="keepalive-ab-"))
    (tmp / "waves.toml").write_text(WAVES)
    wl = load_workload(str(tmp / "waves.toml"))
    port = free_port()
    rows: dict[str, list[dict[str, float]]] = {"keepalive": [], "close": []}
    with ServerProcess(render_command(SERVER, {}, port), port, tmp / "server.log", health_timeout_s=120) as srv:
        sides = {"keepalive": KeepAliveLlamaCpp(srv.base_url, model="smol"),
                 "close": LlamaCppBackend(srv.base_url, model="smol")}  # fmt: skip
        for k in range(args.rounds):
            for side in ("keepalive", "close") if k % 2 == 0 else ("close", "keepalive"):
                out = tmp / f"{side}-{k}"
                load = LoadSpec(concurrency=args.concurrency, num_requests=args.num_requests, timeout=300)
                s = run_async(run_point(sides[side], wl, load, out, RunClock(),
                                        options=PointOptions(client_kind=args.client)))
                recs = read_jsonl(out / "requests.jsonl")
                row = {
                    "out_tok_s": s["throughput"]["steady"]["output_tok_per_s"],
                    "ttft_p50_ms": s["latency"]["ttft"]["p50"] * 1e3, "e2e_p50_s": s["latency"]["e2e"]["p50"],
                    "errors": s["counts"]["errors"], "retries": sum(r["retries"] for r in recs),
                    "client_cpu": s["client"].get("cpu"),
                }  # fmt: skip
                rows[side].append(row)
                print(json.dumps({"round": k, "side": side, **row}), flush=True)
    med = {side: {key: statistics.median(r[key] for r in rs) for key in ("out_tok_s", "ttft_p50_ms", "e2e_p50_s")}
           | {"errors": sum(r["errors"] for r in rs), "retries": sum(r["retries"] for r in rs)}
           for side, rs in rows.items()}  # fmt: skip
    print(json.dumps({"medians": med}, indent=1))


if __name__ == "__main__":
    main()
