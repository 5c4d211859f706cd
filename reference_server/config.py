"""The one engine configuration dataclass."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

KERNELS = ("auto", "native", "triton", "torch")
QUANTIZATIONS = ("none", "int8", "int4", "auto")
KV_CACHE_DTYPES = ("auto", "bf16", "int8", "fp8")
DEFAULT_CPU_KV_BLOCKS = 2048  # the CPU's KV pool without --num-kv-blocks: the memory of 2048 x 16 tokens
# in the model's dtype (32k tokens; a quantised KV cache fits more blocks into it)


@dataclass
class EngineConfig:
    """Everything the engine needs; the server's CLI maps flags 1:1 onto these fields."""

    model: Path
    device: str = "auto"  # "auto" -> cuda when available, else cpu
    dtype: str = "auto"  # "auto" -> bf16 on CPUs with AVX512-BF16 and on CUDA, else fp32
    threads: int | None = None  # torch intra-op threads on CPU (None: all cores if idle at start, else 1)
    kernels: str = "auto"  # auto | native (CPU bf16, native.py) | triton (CUDA, triton_attention.py) | torch
    quantization: str = "none"  # weight-only: none | int8 (per channel) | int4 (groups of 32) | auto (from the GGUF); quant.py
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | bf16 | int8 (per-block scales) | fp8 (refused); kv_cache.py
    block_size: int = 16
    num_kv_blocks: int | None = None  # KV pool size in blocks; None: from GPU memory on CUDA, DEFAULT_CPU_KV_BLOCKS on CPU
    gpu_memory_utilization: float = 0.9  # CUDA: share of the GPU's memory for weights + activations + KV pool
    cuda_graphs: bool = True  # CUDA: decode steps as CUDA graphs per batch-size bucket (cuda_graphs.py)
    max_num_batched_tokens: int = 512  # token budget of one engine step
    max_num_seqs: int = 64  # most requests running at once
    max_model_len: int | None = None  # None: the model's context length
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_waiting: int = 512  # queue bound; over it the server answers 429
    iteration_log_size: int = 8192  # per-iteration records kept for GET /v1/iterations
    batching: str = "continuous"  # continuous | dynamic | static (see batching.py)
    batch_size: int = 16  # static/dynamic: requests per batch
    batch_max_delay_ms: float = 50.0  # dynamic: start a partial batch after this wait
    policy: str = "fifo"  # fifo | sjf | priority (see policies.py)
    aging_s: float = 10.0  # sjf/priority: waiting this long counts as one priority level / 64 tokens
    spec: str = "off"  # speculative decoding: off | ngram | draft | self
    spec_k: int = 6  # most draft tokens per step (adapted per request, capped per step by the governor)
    spec_adaptive: bool = True
    spec_max_batch: int = 4  # speculate only while at most this many requests decode
    draft_model: str = ""  # GGUF for --spec draft (same vocabulary as the model)
    self_draft_layers: int = 20  # --spec self: layers of the model that draft
    step_sleep_ms: float = float(os.environ.get("SERVELAB_ENGINE_SLEEP_MS", "0") or 0)
    """Test-only: extra sleep per engine iteration (env SERVELAB_ENGINE_SLEEP_MS) to slow the engine on purpose."""

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_blocks", "max_num_batched_tokens", "max_num_seqs", "iteration_log_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kernels not in KERNELS:
            raise ValueError(f"unknown kernels {self.kernels!r}: choose one of {', '.join(KERNELS)}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {self.quantization!r}: choose one of {', '.join(QUANTIZATIONS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv cache dtype {self.kv_cache_dtype!r}: choose one of {', '.join(KV_CACHE_DTYPES)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_waiting < 0 or (self.threads is not None and self.threads < 1):
            raise ValueError("max_waiting must be >= 0 and threads >= 1")
