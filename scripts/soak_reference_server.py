"""Soak the reference server: a bounded run of mixed traffic with faults injected by the client.

Starts ``python -m reference_server`` (default flags, a free loopback port), then keeps ``--concurrency``
clients busy for ``--duration`` seconds with completions and chat requests, streaming and not, of varied
lengths, some sharing a prefix. About ``--drop`` of the streams are dropped by the client at a random
point, a few non-streaming requests are abandoned by a short client timeout, and ``--malformed`` of the
requests are malformed (bad JSON, wrong types, out-of-range numbers, unsupported fields, oversized
bodies). At the end: every KV block free, the engine alive, the server's resident memory over the run
(start, 1 and 5 minutes, end, the slope over the second half), and every error that was not injected.
Writes a JSON summary; exits 1 on a leaked block, an unexpected error, or resident memory still
climbing over the second half of the run (``--max-rss-slope``).

    .venv/bin/python scripts/soak_reference_server.py --duration 600
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil

from backends.launcher import free_port

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches in "
         "a small town near the sea where ships sail at dawn and bells ring twice").split()
SHARED = "You are a helpful assistant. Answer briefly and precisely, in plain English. " * 3

MALFORMED: list[tuple[str, bytes | dict[str, Any]]] = [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}'),
    ("/v1/completions", b"[" * 50000 + b"]" * 50000),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}),
    ("/v1/completions", {"prompt": "hi", "seed": 10**27}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}),
    ("/v1/completions", {"prompt": "hi", "logprobs": 3}),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}),
    ("/v1/completions", {"prompt": "\ud800"}),
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 100}),
    ("/v1/completions", {"prompt": "a" * (5 << 20)}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3}),
]


def at(series: list[tuple[float, float]], t: float) -> float:
    """The first sample at or after ``t`` seconds (the last one if the run was shorter)."""
    return next((mb for ts, mb in series if ts >= t), series[-1][1])


def slope(series: list[tuple[float, float]]) -> float:
    """Least-squares slope of ``(t, value)`` samples, per second (0 for fewer than two)."""
    n = len(series)
    if n < 2:
        return 0.0
    mt, mv = sum(t for t, _ in series) / n, sum(v for _, v in series) / n
    var = sum((t - mt) ** 2 for t, _ in series)
    return sum((t - mt) * (v - mv) for t, v in series) / var if var else 0.0


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


class Soak:
    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url, self.args = url, args
        self.rng = random.Random(args.seed)
        self.counts: Counter[str] = Counter()
        self.errors: list[str] = []  # not injected
        self.tokens = 0

    def _valid(self) -> tuple[str, dict[str, Any]]:
        rng = self.rng
        words = " ".join(rng.choices(WORDS, k=rng.choice((4, 16, 64, 200))))
        prompt = (SHARED if rng.random() < 0.4 else "") + words
        body: dict[str, Any] = {"max_tokens": rng.choice((8, 32, 64, 128)), "stream": rng.random() < 0.7}
        if rng.random() < 0.5:
            body.update(temperature=0.8, top_p=0.95, seed=rng.randrange(2**63))
        else:
            body["temperature"] = 0
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        if rng.random() < 0.5:
            return "/v1/completions", {"prompt": prompt, **body}
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], **body}

    async def one(self, client: httpx.AsyncClient) -> None:
        rng = self.rng
        if rng.random() < self.args.malformed:
            path, body = rng.choice(MALFORMED)
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = await client.post(path, content=content, headers={"content-type": "application/json"})
            self.counts["malformed"] += 1
            if not 400 <= r.status_code < 500:
                self.errors.append(f"malformed {path} {content[:80]!r} -> {r.status_code} {r.text[:200]}")
            return
        path, body = self._valid()
        if not body["stream"]:
            if rng.random() < 0.05:  # abandoned by the client: the server must abort it
                self.counts["abandoned"] += 1
                try:
                    await client.post(path, json=body, timeout=rng.uniform(0.05, 1.0))
                except httpx.TimeoutException:
                    pass
                return
            r = await client.post(path, json=body)
            self.counts["non-stream"] += 1
            if r.status_code != 200:
                self.errors.append(f"{path} -> {r.status_code} {r.text[:200]}")
                return
            self.tokens += r.json()["usage"]["completion_tokens"]
            return
        drop_after = rng.randrange(0, 40) if rng.random() < self.args.drop else None
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                self.errors.append(f"{path} stream -> {r.status_code} {(await r.aread())[:200]!r}")
                return
            events = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if drop_after is not None and events >= drop_after:
                    self.counts["dropped"] += 1
                    return  # leaving the block closes the connection mid-stream
                events += 1
                data = line[6:]
                if data == "[DONE]":
                    self.counts["stream"] += 1
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    self.errors.append(f"{path} stream error event {data[:200]}")
                    return
                if chunk.get("usage") and not chunk["choices"]:
                    self.tokens += chunk["usage"]["completion_tokens"]
            self.errors.append(f"{path} stream ended without [DONE]")

    async def worker(self, client: httpx.AsyncClient, end: float) -> None:
        while time.monotonic() < end:
            try:
                await self.one(client)
            except (httpx.HTTPError, ValueError, KeyError) as e:
                self.errors.append(f"client: {type(e).__name__}: {e}")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "reference_server", "--host", "127.0.0.1", "--port", str(port), *args.server_arg]
    log_path = args.server_log
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300, connect=10),
                                     limits=httpx.Limits(max_connections=args.concurrency * 2)) as client:
            deadline = time.monotonic() + 300
            while True:
                assert proc.poll() is None, f"server exited: {log_path.read_text()[-2000:]}"
                try:
                    if (await client.get("/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "server did not come up"
                await asyncio.sleep(1)
            ps = psutil.Process(proc.pid)
            soak = Soak(url, args)
            t0 = time.monotonic()
            end = t0 + args.duration
            rss: list[tuple[float, float]] = []

            async def sample() -> None:
                while time.monotonic() < end:
                    rss.append((round(time.monotonic() - t0), ps.memory_info().rss / 2**20))
                    await asyncio.sleep(10)

            await asyncio.gather(sample(), *(soak.worker(client, end) for _ in range(args.concurrency)))
            wall = time.monotonic() - t0
            settle = time.monotonic() + 120
            while True:  # the engine drains what is left (aborts of the last dropped streams)
                m = (await client.get("/metrics")).text
                if metric(m, "servelab_requests_running") == metric(m, "servelab_requests_waiting") == 0:
                    break
                assert time.monotonic() < settle, "the engine did not go idle"
                await asyncio.sleep(0.5)
            await asyncio.sleep(1)
            m = (await client.get("/metrics")).text
            health = (await client.get("/health")).status_code
            rss.append((round(time.monotonic() - t0), ps.memory_info().rss / 2**20))
    finally:
        proc.terminate()
        proc.wait(30)
    warm = at(rss, 60)
    half = [(t, mb) for t, mb in rss if t >= rss[-1][0] / 2]
    reasons = {r: metric(m, f'servelab_requests_finished_total{{finish_reason="{r}"}}')
               for r in ("stop", "length", "abort", "error") if f'finish_reason="{r}"' in m}
    return {
        "command": " ".join(sys.argv), "duration_s": round(wall, 1), "concurrency": args.concurrency,
        "requests": dict(soak.counts), "output_tokens": soak.tokens,
        "output_tok_per_s": round(soak.tokens / wall, 1), "finished_by_reason": reasons,
        "kv_blocks_used_at_end": metric(m, "servelab_kv_blocks_used"),
        "kv_blocks_total": metric(m, "servelab_kv_blocks_total"),
        "requests_open_at_end": metric(m, "servelab_requests_open"),
        "engine_alive": metric(m, "servelab_engine_alive"), "health": health,
        "rss_mb": {"start": round(rss[0][1], 1), "after_1_min": round(warm, 1), "after_5_min": round(at(rss, 300), 1),
                   "end": round(rss[-1][1], 1), "max": round(max(mb for _, mb in rss), 1),
                   "growth_after_1_min": round(rss[-1][1] - warm, 1),
                   "slope_second_half_mb_per_min": round(60 * slope(half), 2)},
        "max_rss_slope_mb_per_min": args.max_rss_slope,
        "rss_series_mb": [(t, round(mb, 1)) for t, mb in rss],
        "unexpected_errors": len(soak.errors), "first_errors": soak.errors[:20],
        "server_log_tracebacks": log_path.read_text().count("Traceback"), "server_log": str(log_path),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600, help="seconds of load (default 600)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--drop", type=float, default=0.3, help="fraction of streams the client drops mid-way")
    p.add_argument("--malformed", type=float, default=0.1, help="fraction of requests that are malformed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-rss-slope", type=float, default=6.0,
                   help="fail when resident memory still climbs faster than this over the second half of the "
                        "run, MB per minute (default 6: a leak of 0.1 MB/s fails; the first half is warm-up)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON summary here too")
    p.add_argument("--server-arg", action="append", default=[], help="extra server flag (repeatable)")
    p.add_argument("--server-log", type=Path, default=Path("results/soak-server.log"), help="the server's output")
    args = p.parse_args()
    summary = asyncio.run(run(args))
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    ok = (summary["unexpected_errors"] == 0 and summary["kv_blocks_used_at_end"] == 0 and summary["health"] == 200
          and summary["engine_alive"] == 1 and summary["requests_open_at_end"] == 0
          and summary["rss_mb"]["slope_second_half_mb_per_min"] <= args.max_rss_slope)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
