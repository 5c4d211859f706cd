"""The paged KV cache's storage: ``--kv-cache-dtype auto|bf16|int8|fp8``.

Per layer, K and V are ``[kv_heads, num_blocks, block_size, head_dim]``. ``auto`` stores them in the
model's dtype. ``int8`` stores each element as ``q * scale`` with ``|q| <= 127`` and one float32 scale per
(KV head, block) for K and one for V (``[kv_heads, num_blocks]``): a token then takes
``head_dim + 4 / block_size`` bytes per head and K or V instead of ``2 * head_dim`` in bf16, 1.99x the
tokens in the same memory at head_dim 64 and blocks of 16. The scale of a block is set by the rows written
into it (:func:`quantize_into`): a block that starts again takes its new rows' absmax / 127, later rows
raise it when they must, and then the block's earlier rows are re-rounded to the raised scale.

The attention kernels read int8 blocks where they lie: the native decode kernel (csrc/cpu_kernels.c)
converts each tile in registers and applies the K scale to its scores and the V scale to its softmax
weights; the PyTorch path dequantises only the blocks it gathers for a step (:func:`gather_blocks`), never
the pool. ``fp8`` (e4m3) is refused: no CPU has fp8 arithmetic, and the CUDA kernel (kernels/triton_attention.py)
reads bf16/fp16 only."""

from __future__ import annotations

from typing import NamedTuple

import torch

from reference_server.config import KV_CACHE_DTYPES
from reference_server.model.gguf_loader import ModelSpec

SCALE_BYTES = 4  # one float32 scale per (KV head, block) for K and for V
QMAX = 127


class LayerKV(NamedTuple):
    """One layer's cache; the scales are ``[kv_heads, num_blocks]`` float32 for an int8 cache, else None."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


def pick_kv_dtype(choice: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The cache's element dtype for ``--kv-cache-dtype``; a choice this device or model cannot run is
    refused with the reason."""
    if choice not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv cache dtype {choice!r}: choose one of {', '.join(KV_CACHE_DTYPES)}")
    if choice == "auto":
        return model_dtype
    if choice == "bf16":
        if model_dtype != torch.bfloat16:
            raise ValueError(f"--kv-cache-dtype bf16 needs the bf16 model (this one runs in "
                             f"{str(model_dtype).removeprefix('torch.')}); use --kv-cache-dtype auto or int8")
        return torch.bfloat16
    if choice == "fp8":
        if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
            why = "this GPU has fp8, but the Triton paged-attention kernel reads bf16/fp16 caches only"
        elif device.type == "cuda":
            why = "fp8 needs a GPU of compute capability 8.9 or newer"
        else:
            why = f"no fp8 arithmetic on {device.type}"
        raise ValueError(f"--kv-cache-dtype fp8 (e4m3) is not available: {why}; use --kv-cache-dtype int8")
    return torch.int8


def kv_dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int8: "int8"}[dtype]


def block_bytes(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block across all layers: K and V, ``kv_heads x block_size x head_dim`` elements each,
    plus the per-(head, block) scales of an int8 cache."""
    elems = block_size * spec.head_dim * torch.empty((), dtype=dtype).element_size()
    return 2 * spec.n_layers * spec.n_kv_heads * (elems + (SCALE_BYTES if dtype == torch.int8 else 0))


def allocate(spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype,
             device: torch.device) -> list[LayerKV]:
    shape = (spec.n_kv_heads, num_blocks, block_size, spec.head_dim)

    def one() -> LayerKV:
        k, v = torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
        if dtype != torch.int8:
            return LayerKV(k, v)
        scales = torch.zeros((2, spec.n_kv_heads, num_blocks), dtype=torch.float32, device=device)
        return LayerKV(k, v, scales[0], scales[1])

    return [one() for _ in range(spec.n_layers)]


def capacity_line(spec: ModelSpec, block_size: int, pool_bytes: int, chosen: torch.dtype, model_dtype: torch.dtype,
                  max_model_len: int) -> str:
    """Bytes per token, tokens and ``max_model_len`` sequences that ``pool_bytes`` holds for the chosen
    cache dtype and the others this model could use, e.g. ``int8 11,565 B/token: 65,280 tokens = 7
    sequences of 8,192 (bf16 23,040 B/token: 32,768 tokens = 4)``."""

    def one(dtype: torch.dtype) -> str:
        blocks = pool_bytes // block_bytes(spec, block_size, dtype)
        per_token = block_bytes(spec, block_size, dtype) / block_size
        return (f"{kv_dtype_name(dtype)} {per_token:,.0f} B/token: {blocks * block_size:,} tokens = "
                f"{blocks * block_size // max_model_len:,} sequences")

    others = [one(d) for d in dict.fromkeys((model_dtype, torch.int8)) if d != chosen]
    return f"{one(chosen)} of {max_model_len:,}" + (f" ({'; '.join(others)})" if others else "")


def quantize_into(cache: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
    """Write ``x`` [T, KVH, D] into the int8 ``cache`` [KVH, blocks, block_size, D] at ``slots`` [T],
    updating ``scales`` [KVH, blocks]: per block written, a block whose first new row is at offset 0 takes
    ``absmax(new rows) / 127`` (its older rows are stale), else ``max(scale, absmax / 127)``, its older
    rows re-rounded when the scale grows. The native ``kv_write_int8`` computes the same numbers."""
    kvh, nb, bs, d = cache.shape
    blk, off = slots // bs, slots % bs
    blocks, run = torch.unique(blk, return_inverse=True)
    first = torch.full(blocks.shape, bs, dtype=off.dtype, device=off.device).scatter_reduce_(0, run, off, "amin")
    xf = x.float()
    amax = torch.zeros((blocks.numel(), kvh), device=x.device).scatter_reduce_(
        0, run[:, None].expand(-1, kvh), xf.abs().amax(-1), "amax")
    old = torch.where((first > 0)[:, None], scales[:, blocks].t(), 0.0)  # [R, KVH]
    s = torch.maximum(old, amax / QMAX)
    grown = (old > 0) & (s > old)
    if bool(grown.any()):
        ratio = torch.where(grown, old / s, 1.0).t()[:, :, None, None]  # [KVH, R, 1, 1]
        cache[:, blocks] = (cache[:, blocks].float() * ratio).round().to(torch.int8)
    scales[:, blocks] = s.t()
    inv = torch.where(s > 0, 1.0 / s, 0.0)[run]  # [T, KVH]
    q = (xf * inv[:, :, None]).round().clamp(-QMAX, QMAX).to(torch.int8)
    cache.view(kvh, nb * bs, d).index_copy_(1, slots, q.transpose(0, 1))


def write(kv: LayerKV, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """The new tokens' ``k``, ``v`` [T, KVH, D] into their ``slots`` [T] (PyTorch ops)."""
    kvh, _, _, d = kv.k.shape
    if kv.k_scale is None or kv.v_scale is None:
        kv.k.view(kvh, -1, d).index_copy_(1, slots, k.transpose(0, 1))
        kv.v.view(kvh, -1, d).index_copy_(1, slots, v.transpose(0, 1))
        return
    quantize_into(kv.k, kv.k_scale, k, slots)
    quantize_into(kv.v, kv.v_scale, v, slots)


def gather_blocks(cache: torch.Tensor, scales: torch.Tensor | None, rows: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """Rows ``h * num_blocks + b`` (block ``b`` of KV head ``h``) of ``cache`` viewed as
    ``[KVH * blocks, block_size * D]``, in ``dtype``: an int8 cache's gathered blocks are dequantised
    (only those: the pool stays int8)."""
    kvh, nb, bs, d = cache.shape
    out = cache.view(kvh * nb, bs * d).index_select(0, rows)
    if scales is None:
        return out
    return (out.float() * scales.reshape(-1).index_select(0, rows)[:, None]).to(dtype)
