"""``make gpu-check``'s plan (the GPU's sizes or the rehearsal's), the log and the state its checks share."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
Record = dict[str, Any]
CHECKS = ("pytest", "identity", "decode", "batching", "sweep")
PYTEST_FILES = ("tests/test_reference_engine.py", "tests/test_triton_attention.py")


@dataclass(frozen=True)
class Plan:
    """Sizes of one run: the GPU's, or the rehearsal's."""

    device: str
    small: str
    big: str  # the batching comparison's and the sweep's model
    decode: tuple[str, ...]  # the decode check's shapes, the last judged against its bandwidth bound
    concurrency: int  # the decode and batching point
    requests: int  # the batching comparison's requests (a multiple of ``concurrency``)
    prompt: int
    output: tuple[int, int]  # the batching comparison's output lengths, uniform in [lo, hi]
    sweep: tuple[int, ...]
    sweep_s: float  # dispatch seconds per sweep point
    identity_prompts: int
    identity_tokens: int
    pytest: tuple[str, ...]


GPU_PLAN = Plan("cuda", "smollm2-135m", "llama-1b", ("smollm2-135m", "llama-1b", "llama-8b"), 64, 128, 128, (32, 256), (1, 16, 64, 256), 12.0, 16, 32,
                PYTEST_FILES)
REHEARSAL_PLAN = Plan("cpu", "tiny", "tiny-wide", ("tiny", "tiny-deep"), 4, 8, 16, (4, 12), (1, 4), 1.5, 4, 8,
                      ("tests/test_triton_attention.py::test_rejects_layouts_it_cannot_read",
                       "tests/test_reference_engine.py::test_greedy_same_with_prefix_cache_and_chunked_prefill"))


class Log:
    """Lines to stdout and to the log file, each stamped with the seconds since the start."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("w")
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        line = f"[{time.perf_counter() - self.t0:7.1f}s] {msg}"
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()


@dataclass
class Context:
    """What every check gets: the plan, the folders, the log, the deadline and what the setup made."""

    plan: Plan
    out: Path
    work: Path
    log: Log
    deadline: float
    tokenizer: Path = Path()
    small_path: Path = Path()
    big_path: Path = Path()
    bandwidth: float = 0.0

    def left(self) -> float:
        return max(1.0, self.deadline - time.perf_counter())


def dig(rec: Any, keys: tuple[str, ...]) -> Any:
    """``rec[k1][k2]...``, or None where a key is missing."""
    for k in keys:
        if not isinstance(rec, dict) or k not in rec:
            return None
        rec = rec[k]
    return rec
