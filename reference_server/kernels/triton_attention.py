"""Paged attention for the GPU as one Triton kernel: decode rows and prefill chunks (with prefix hits) in
one launch, K/V read in place through the block table.

Every sequence of the step brings ``n_new`` query tokens (1 for decode, a chunk for prefill) at the end of
its ``ctx_len`` tokens of context, whose K/V (the new tokens' included) are already in the paged cache
``[KVH, num_blocks, block_size, D]``. Query ``i`` of a sequence sits at position ``ctx_len - n_new + i``
and sees keys ``0 .. ctx_len - n_new + i`` (causal within the chunk, the whole cached prefix before it).

One program handles one (sequence, KV head, tile of ``BLOCK_M`` query tokens): its rows are those tokens
times the ``G`` query heads sharing the KV head (GQA: each K/V block is loaded once for all of them), so a
decode step reads every block of every context exactly once per KV head. Blocks are walked through the
block table one at a time (``BLOCK_N`` = the block size) with an online softmax in float32, as in
FlashAttention / vLLM's paged attention; keys past the tile's last query are never loaded. Q, K and V are
widened to float32 before the two ``tl.dot``: on NVIDIA GPUs that is a TF32 tensor-core dot, exact for
bf16/fp16 inputs (10 mantissa bits hold their 7/10), and the probabilities keep TF32 instead of bf16
precision; at decode the kernel is bound by reading K/V, not by the dot's rate. A float32 cache (a float32
model: correctness runs, e.g. greedy identity with the CPU) gets IEEE float32 dots instead: TF32 would round
its inputs to 10 mantissa bits. (Triton 3.7.1's and 3.8.0's interpreter
also multiplies bf16 operands as raw integers: widening keeps the tested kernel the one that runs.)

Without a GPU the same kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors,
which is how the test suite checks it (tests/test_triton_attention.py)."""

# ruff: noqa: ANN001, ANN202  (Triton kernel arguments are untyped pointers and scalars)
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, q_start_ptr, n_new_ptr, ctx_len_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kh, stride_kb, stride_kn, stride_tb,
    scale,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    tile = tl.program_id(2)
    n_new = tl.load(n_new_ptr + seq)
    if tile * BLOCK_M >= n_new:
        return
    ctx_len = tl.load(ctx_len_ptr + seq)
    q_start = tl.load(q_start_ptr + seq)
    rows = tl.arange(0, BLOCK_M * G_PAD)
    tok = tile * BLOCK_M + rows // G_PAD  # query token within the sequence's new tokens
    head = kvh * G + rows % G_PAD
    row_ok = (tok < n_new) & (rows % G_PAD < G)
    q_pos = ctx_len - n_new + tok  # its position in the sequence
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    m = tl.full([BLOCK_M * G_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * G_PAD, BLOCK_D], tl.float32)
    # keys up to the last query of this tile: causal, so later blocks are never read
    kv_end = tl.minimum(ctx_len, ctx_len - n_new + (tile + 1) * BLOCK_M)
    n = tl.arange(0, BLOCK_N)
    kv_base = k_ptr + kvh.to(tl.int64) * stride_kh  # a large pool's head stride overflows int32 products
    v_base = v_ptr + kvh.to(tl.int64) * stride_kh
    for b in range(0, tl.cdiv(kv_end, BLOCK_N)):
        block = tl.load(tables_ptr + seq * stride_tb + b).to(tl.int64)
        k_pos = b * BLOCK_N + n
        k_ok = k_pos < kv_end
        offs = block * stride_kb + n[:, None] * stride_kn + d[None, :]
        k = tl.load(kv_base + offs, mask=k_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        v = tl.load(v_base + offs, mask=k_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT) * scale
        s = tl.where(row_ok[:, None] & k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet (padding rows)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT)
        m = m_new
    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    tl.store(o_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                    q_start: torch.Tensor, n_new: torch.Tensor, ctx_len: torch.Tensor, max_new: int,
                    scale: float = 1.0, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of every new token over its sequence's paged context.

    ``q`` [T, H, D] (rows may be strided, heads contiguous): the step's new tokens, sequence after
    sequence; caches [KVH, blocks, block_size, D] contiguous; ``tables`` [S, nblk] int32 block ids;
    ``q_start``/``n_new``/``ctx_len`` [S] int32: each sequence's first row in ``q``, its number of new
    tokens and its context length (new tokens included, their K/V already written). ``max_new``: the
    largest ``n_new`` (sizes the grid; a CUDA graph captures it as a constant). Returns [T, H, D]."""
    t, h, d = q.shape
    kvh, _, bs, _ = k_cache.shape
    if not (q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
            and v_cache.shape == k_cache.shape and k_cache.shape[3] == d and h % kvh == 0
            and tables.dim() == 2 and tables.stride(1) == 1 and bs >= 16 and bs & (bs - 1) == 0):
        raise ValueError("paged attention: unexpected tensor layout (block size must be a power of two >= 16)")
    g = h // kvh
    g_pad = triton.next_power_of_2(g)
    # at least 16 rows per tile (tl.dot's minimum); prefill tiles up to 64 rows
    block_m = max(16 // g_pad, 1) if max_new == 1 else max(min(64 // g_pad, triton.next_power_of_2(max_new)), 16 // g_pad, 1)
    if out is None:
        out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    grid = (tables.shape[0], kvh, triton.cdiv(max_new, block_m))
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, tables, q_start, n_new, ctx_len,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        scale, G=g, G_PAD=g_pad, BLOCK_M=block_m, BLOCK_N=bs, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d),
        DOT="ieee" if k_cache.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out
