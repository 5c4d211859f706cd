"""The one engine configuration dataclass."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass
class EngineConfig:
    """Everything the engine needs; the server's CLI maps flags 1:1 onto these fields."""

    model: Path
    device: str = "auto"  # "auto" -> cuda when available, else cpu
    dtype: str = "auto"  # "auto" -> bf16 on CPUs with AVX512-BF16 and on CUDA, else fp32
    threads: int | None = None  # torch intra-op threads on CPU (None: all cores)
    block_size: int = 16
    num_kv_blocks: int = 2048  # KV pool size in blocks (2048 x 16 = 32k tokens)
    max_num_batched_tokens: int = 512  # token budget of one engine step
    max_num_seqs: int = 64  # most requests running at once
    max_model_len: int | None = None  # None: the model's context length
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_waiting: int = 512  # queue bound; over it the server answers 429
    iteration_log_size: int = 8192  # per-iteration records kept for GET /v1/iterations
    step_sleep_ms: float = float(os.environ.get("SERVELAB_ENGINE_SLEEP_MS", "0") or 0)
    """Test-only: extra sleep per engine iteration (env SERVELAB_ENGINE_SLEEP_MS) to slow the engine on purpose."""
