"""Write the small sample traces shipped in workloads/data/ (seeded, reproducible).

    .venv/bin/python scripts/make_sample_traces.py [--requests 200] [--seconds 6]

sample_mooncake.jsonl: Mooncake format (timestamp ms, input_length, output_length, hash_ids of 512-token
blocks). A few "system prompts" / documents of 1-2 blocks are shared by most requests, so the trace
exercises prefix caching, as the real Mooncake traces do.
sample_azure.csv: Azure LLM inference trace format (TIMESTAMP, ContextTokens, GeneratedTokens).
Both have Poisson arrivals over about ``--seconds`` and short outputs, so a replay is quick.
"""

from __future__ import annotations

import argparse
import json
import random
from datetime import datetime, timedelta
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "workloads" / "data"
BLOCK = 512


def mooncake(n: int, seconds: float, rng: random.Random) -> list[dict[str, object]]:
    shared = [[0], [1, 2], [3], [4, 5]]  # prefixes (hash-id runs) that several requests start with
    next_id = 100
    t = 0.0
    rows = []
    for _ in range(n):
        prefix = rng.choice(shared) if rng.random() < 0.8 else []
        own = rng.randint(1, 1200)
        input_length = BLOCK * len(prefix) + own
        ids = list(prefix)
        for _ in range(-(-own // BLOCK)):
            ids.append(next_id)
            next_id += 1
        rows.append(
            {
                "timestamp": int(t * 1000),
                "input_length": input_length,
                "output_length": rng.randint(2, 24),
                "hash_ids": ids,
            }
        )
        t += rng.expovariate(n / seconds)
    return rows


def azure(n: int, seconds: float, rng: random.Random) -> list[str]:
    start = datetime(2023, 11, 16, 18, 15, 46)
    t = 0.0
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for _ in range(n):
        ts = start + timedelta(seconds=t)
        stamp = ts.strftime("%Y-%m-%d %H:%M:%S.%f") + str(rng.randint(0, 9))  # 7 digits, as in the real trace
        lines.append(f"{stamp},{max(1, int(rng.lognormvariate(6.0, 0.8)))},{rng.randint(2, 24)}")
        t += rng.expovariate(n / seconds)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--seed", type=int, default=9)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    DATA.mkdir(parents=True, exist_ok=True)
    moon = DATA / "sample_mooncake.jsonl"
    moon.write_text("".join(json.dumps(r) + "\n" for r in mooncake(args.requests, args.seconds, rng)))
    az = DATA / "sample_azure.csv"
    az.write_text("\n".join(azure(args.requests, args.seconds, rng)) + "\n")
    print(f"wrote {moon} and {az}")


if __name__ == "__main__":
    main()
