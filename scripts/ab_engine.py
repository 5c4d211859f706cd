"""Engine A/B with the steps interleaved: a git revision's reference server vs the working tree.

    .venv/bin/python scripts/ab_engine.py REV [--rounds 4] [--concurrency 16] [--output-tokens 128]

This VM's speed drifts by 10-15 % from minute to minute, so two runs one after the other cannot tell a
5 % change from noise. Here both engines live in one process (REV's ``reference_server/`` is copied to a
temporary package ``rs_base``), each gets the same ``--concurrency`` greedy requests per round, and their
decode steps alternate (base, new, new, base, ...), so drift hits both alike. Prints the mean step time of
each and the new/base ratio (< 1: the working tree is faster). ``REV`` = ``HEAD`` with a clean tree is an
A/A check of the method (measured here: 0.991)."""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _copy_revision(rev: str, dest: Path) -> None:
    """``reference_server/`` at ``rev`` (with its ``csrc/`` kernel sources) as package ``rs_base`` under ``dest``."""
    names = subprocess.check_output(["git", "ls-tree", "-r", "--name-only", rev, "reference_server/"], cwd=ROOT,
                                    text=True)
    for name in names.split():
        if name.endswith((".py", ".c")):
            src = subprocess.check_output(["git", "show", f"{rev}:{name}"], cwd=ROOT, text=True)
            target = dest / "rs_base" / Path(name).relative_to("reference_server")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(src.replace("reference_server.", "rs_base.") if name.endswith(".py") else src)


def _engine(pkg: str, concurrency: int) -> tuple[Any, Any]:
    config = importlib.import_module(f"{pkg}.config")
    # REV may predate the split of reference_server/ into rooms (engine/, model/, ...): its modules are flat then
    room = "engine." if hasattr(importlib.import_module(f"{pkg}.engine"), "__path__") else ""
    engine = importlib.import_module(f"{pkg}.{room}engine")
    sequence = importlib.import_module(f"{pkg}.{room}sequence")
    model = importlib.import_module("reference_server.model_files").default_model_path()
    e = engine.Engine(config.EngineConfig(model=model, threads=2, enable_prefix_caching=False,
                                          max_num_seqs=max(64, concurrency)))
    return e, sequence


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rev", help="git revision to compare the working tree against")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--output-tokens", type=int, default=128)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        _copy_revision(args.rev, Path(tmp))
        sys.path.insert(0, tmp)
        sys.path.insert(0, str(ROOT))
        engines = {"base": _engine("rs_base", args.concurrency), "new": _engine("reference_server", args.concurrency)}
        total = {k: 0.0 for k in engines}
        steps = {k: 0 for k in engines}
        ratios: list[float] = []
        for r in range(args.rounds):
            for e, sequence in engines.values():
                params = sequence.SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
                for i in range(args.concurrency):
                    e.add_request([(7 * i + j + r) % 4000 + 100 for j in range(32)], params)
                e.step()  # the prefill is not timed: decode steps are what is compared
            while any(e.scheduler.has_work() for e, _ in engines.values()):
                order = ["base", "new"] if len(ratios) % 2 == 0 else ["new", "base"]
                dt: dict[str, float] = {}
                for k in order:
                    e = engines[k][0]
                    if e.scheduler.has_work():
                        t0 = time.perf_counter()
                        e.step()
                        dt[k] = time.perf_counter() - t0
                        total[k] += dt[k]
                        steps[k] += 1
                if len(dt) == 2:
                    ratios.append(dt["new"] / dt["base"])
    for k in engines:
        kernels = getattr(engines[k][0].runner, "kernels", "torch")  # revisions before the native kernels
        print(f"{k:4s} ({args.rev if k == 'base' else 'working tree'}, kernels {kernels}): mean decode step "
              f"{total[k] / steps[k] * 1000:6.2f} ms over {steps[k]} steps")
    mean_ratio = (total["new"] / steps["new"]) / (total["base"] / steps["base"])
    print(f"new/base step time: ratio of means {mean_ratio:.3f}, median of paired ratios {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
