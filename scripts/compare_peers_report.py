"""``compare_peers.py``'s table: the medians over rounds of each tool's figures, side by side, and the verdict."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

FIGURES = ("ttft_ms", "tpot_ms", "itl_ms", "output_tok_s")


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
