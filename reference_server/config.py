"""The one engine configuration dataclass."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KERNELS = ("auto", "native", "triton", "torch")
QUANTIZATIONS = ("none", "int8", "int4", "auto")
KV_CACHE_DTYPES = ("auto", "bf16", "int8", "fp8")
DEFAULT_CPU_KV_BLOCKS = 2048  # the CPU's KV pool without --num-kv-blocks: the memory of 2048 x 16 tokens
# in the model's dtype (32k tokens; a quantised KV cache fits more blocks into it)


SPEC_METHODS = ("off", "ngram", "draft", "self")


def flag(default: Any, group: str, text: str) -> Any:
    """A field that is a server flag (``--field-name``): its default, and the ``group`` and help ``text`` of
    ``python -m reference_server --help`` (api/cli.py builds the parser from these; choices come from the
    tuples the field is checked against)."""
    return field(default=default, metadata={"group": group, "help": text})


@dataclass
class EngineConfig:
    """Everything the engine needs, each field a server flag with its meaning; the CLI maps flags 1:1."""

    model: Path
    device: str = flag("auto", "model", "where the model runs: auto (CUDA when available, else CPU), cpu, cuda, cuda:N")
    dtype: str = flag("auto", "model", "weight/activation dtype: auto (bf16 on CPUs with AVX512-BF16 and on CUDA, "
                      "else fp32), bf16, fp16 or fp32")
    threads: int | None = flag(None, "model", "torch intra-op threads on CPU (default: all cores when the machine "
                               "is idle at start, else 1)")
    kernels: str = flag("auto", "model", "auto: on CPU in bf16 the native kernels (paged decode attention, RMSNorm, "
                        "RoPE + KV write, SiLU) when the CPU has AVX-512 BF16, on CUDA the Triton paged-attention "
                        "kernel when Triton is installed, else PyTorch ops; native, triton or torch insist on one")
    quantization: str = flag("auto", "model", "weight-only quantised linears on the native CPU kernels: none (bf16), "
                             "int8 (per output channel; Q8_0 blocks as they are), int4 (groups of 32; Q4_0/Q4_1 "
                             "blocks as they are) or auto (from the GGUF's block types)")
    kv_cache_dtype: str = flag("auto", "engine", "KV cache storage: auto (the model's dtype), bf16, int8 (a float32 "
                               "scale per KV head and block: ~2x the tokens in the same memory) or fp8 (e4m3; "
                               "refused with the reason: no kernel here reads it)")
    block_size: int = flag(16, "engine", "tokens per KV-cache block (paged KV)")
    num_kv_blocks: int | None = flag(None, "engine", "KV pool size in blocks; tokens held = blocks x block size "
                                     "(default: on CUDA sized from free GPU memory by --gpu-memory-utilization, on "
                                     "CPU the memory of 2048 blocks in the model's dtype)")
    gpu_memory_utilization: float = flag(0.9, "engine", "CUDA: fraction of the GPU's memory this server may use, "
                                         "weights, activations and KV pool together; the pool takes what is left "
                                         "(0 < f <= 1; ignored with --num-kv-blocks)")
    cuda_graphs: bool = flag(True, "model", "CUDA: replay decode steps as CUDA graphs captured per batch-size bucket "
                             "(1, 2, 4, 8, 16, 32, ... up to --max-num-seqs); --no-cuda-graphs runs every step eagerly")
    max_num_batched_tokens: int = flag(512, "batching", "token budget of one engine step (prefill chunks + decodes)")
    max_num_seqs: int = flag(64, "batching", "most requests running at once")
    max_model_len: int | None = flag(None, "engine", "longest prompt + output in tokens (default: the model's "
                                     "context length)")
    enable_prefix_caching: bool = flag(True, "engine", "reuse the KV blocks of a shared prompt prefix (hash of full "
                                       "blocks)")
    enable_chunked_prefill: bool = flag(True, "batching", "split long prompts across steps so decodes keep running")
    max_waiting: int = flag(512, "scheduling", "bound of the waiting queue; beyond it requests get HTTP 429")
    iteration_log_size: int = flag(8192, "engine", "per-step records kept for GET /v1/iterations")
    batching: str = flag("continuous", "batching", "continuous: requests join and leave every step; dynamic: "
                         "batches start when full or after --batch-max-delay-ms; static: a batch runs until all its "
                         "requests end")
    batch_size: int = flag(16, "batching", "requests per batch (dynamic and static batching)")
    batch_max_delay_ms: float = flag(50.0, "batching", "dynamic batching: start a partial batch after this wait, ms")
    policy: str = flag("fifo", "scheduling", "order of the waiting queue: fifo, sjf (shortest prompt first) or "
                       "priority (the request's `priority` field)")
    aging_s: float = flag(10.0, "scheduling", "sjf/priority: seconds of waiting that count as one priority level "
                          "(or 64 prompt tokens), so nothing starves")
    spec: str = flag("off", "speculation", "speculative decoding: off, ngram (prompt lookup), draft (a smaller GGUF, "
                     "--draft-model) or self (the model's first --self-draft-layers layers)")
    spec_k: int = flag(6, "speculation", "most draft tokens proposed per step")
    spec_adaptive: bool = flag(True, "speculation", "adapt the draft length per request (grow after full "
                               "acceptance, shrink when nothing is kept), and cap it per step at what measures the "
                               "most output tokens/s (0 = off, 1, 2, 4, ..., --spec-k; per batch size; a "
                               "neighbouring cap re-tried one step in 16)")
    spec_max_batch: int = flag(4, "speculation", "speculate only while at most this many requests decode (a "
                               "bigger batch already fills the compute that speculation would use)")
    spec_ngram_max: int = flag(4, "speculation", "--spec ngram: the longest suffix looked up in the prompt and "
                               "output so far (tried first)")
    spec_ngram_min: int = flag(1, "speculation", "--spec ngram: the shortest suffix looked up")
    draft_model: str | None = flag(None, "speculation", "GGUF of the draft model for --spec draft (same vocabulary as the "
                            "model)")
    self_draft_layers: int = flag(20, "speculation", "--spec self: how many of the model's layers draft")
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
        if self.spec not in SPEC_METHODS:
            raise ValueError(f"unknown speculation method {self.spec!r}: choose one of {', '.join(SPEC_METHODS)}")
        if self.spec_k < 1 or self.spec_max_batch < 1 or self.self_draft_layers < 1:
            raise ValueError("spec_k, spec_max_batch and self_draft_layers must be >= 1")
        if not 1 <= self.spec_ngram_min <= self.spec_ngram_max:
            raise ValueError("need 1 <= spec_ngram_min <= spec_ngram_max")
        if self.spec == "draft" and not self.draft_model:
            raise ValueError("speculation method 'draft' needs a draft model GGUF path (--draft-model)")
