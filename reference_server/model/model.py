"""Llama forward over a flattened, variable-length batch with a paged KV cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from reference_server.kernels.native import CpuKernels
from reference_server.model import kv_cache
from reference_server.model.gguf_loader import ModelSpec
from reference_server.model.kv_cache import LayerKV

if TYPE_CHECKING:
    from reference_server.model.quant import Quantizer


@dataclass
class PrefillGroup:
    """One sequence computing ``rows`` new tokens; it attends to the first ``ctx`` slots of its blocks."""

    rows: slice
    cache_rows: torch.Tensor  # [KVH * nblk] its blocks as rows of the flat cache (see AttnBatch)
    ctx: int
    mask: torch.Tensor | None  # [n, ctx] bool, None when the chunk is the whole context (pure causal)


@dataclass
class AttnBatch:
    """Per-step attention metadata, built once per step and shared by all layers.

    Without the native kernel (and for every prefill chunk), keys and values are gathered by whole blocks
    from the cache viewed as ``[KVH * blocks, block_size * D]``:
    row ``h * num_blocks + b`` is block ``b`` of KV head ``h``. One dim-0 ``index_select`` over those rows
    (a memcpy per row) is ~40 % faster than selecting blocks along dim 1 of ``[KVH, blocks, ...]`` (measured
    here: a layer's decode attention at 16 x 128 tokens 753 -> 464 us; a whole decode step at 16 streams
    4-10 % shorter, engine steps interleaved with the previous version's), and the rows come out in any
    order the matmuls want."""

    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    prefills: list[PrefillGroup]
    decode_rows: torch.Tensor | None = None  # rows with exactly one new token
    # decode rows by the native kernel (kernels/native.py): it reads the blocks in place
    decode_tables: torch.Tensor | None = None  # [B, nblk] int64 block tables padded to the longest
    decode_lens: torch.Tensor | None = None  # [B] int64 context lengths
    # decode rows by PyTorch ops: blocks gathered, padding masked
    decode_cache_rows: torch.Tensor | None = None  # [B * KVH * nblk] the padded block tables as cache rows
    decode_bias: torch.Tensor | None = None  # [B * KVH, 1, maxctx] in the model's dtype: 0 = attend, -inf = padding
    # every row by the paged GPU kernel (kernels/triton_attention.py), decode and prefill alike: per sequence
    paged: PagedBatch | None = None


@dataclass
class PagedBatch:
    """Per-sequence metadata of the paged GPU kernel (int32, on the device); see kernels/triton_attention.py."""

    tables: torch.Tensor  # [S, nblk] block tables padded with block 0
    q_start: torch.Tensor  # [S] first row of each sequence's new tokens
    n_new: torch.Tensor  # [S] new tokens (1 for decode)
    ctx_len: torch.Tensor  # [S] context length, the new tokens included
    max_new: int


PagedAttention = Callable[..., torch.Tensor]
"""``triton_attention.paged_attention`` (imported only where it runs: on CUDA with Triton installed)."""


class Linear(torch.nn.Module):
    """``y = x @ W.T``. On CPU the weight is reordered once into oneDNN's blocked layout: the plain layout is
    repacked on every call. In bf16 that cost ~35 % of the matmul time at 1-16 rows (measured here: a step's 121
    matmuls at 16 rows 21.2 -> 13.6 ms, at 1 row 12.9 -> 7.2 ms; results bit-identical); in float32 on an AVX2 CPU
    (AMD Zen 3) the plain path ran the 121 matmuls of a 2-4 row decode step in 66-127 ms, the packed one in 21-43 ms
    (sums in another order: 1e-6 relative). oneDNN's bf16 needs AVX512-BW/VL/DQ or AVX-NE-CONVERT: without them
    the bf16 reorder raised, so there bf16 stays plain."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.packed = (weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
                       and (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16
                                                             and torch.ops.mkldnn._is_mkldnn_bf16_supported())))
        if self.packed:  # an opaque oneDNN tensor, CPU only: a plain attribute (.to() cannot move it anyway)
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 16)
        else:  # a parameter, so that it is seen, and moved, with the module
            self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T``, plus ``residual`` added inside the matmul's epilogue (one kernel, no extra pass)."""
        if self.packed:
            if residual is not None:
                return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, None, "add")
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        if residual is not None:
            return torch.addmm(residual, x, self.weight.t())
        return F.linear(x, self.weight)


class RMSNorm(torch.nn.Module):
    """``x / sqrt(mean(x^2) + eps) * w``: the native kernel when given, else LayerNorm over ``[x, -x]``: that
    row has zero mean by construction, so LayerNorm's variance is ``mean(x^2)`` and its first half is exactly
    the RMS norm. On CPU ``F.rms_norm`` is a composite of ~9 kernels; this is 2 (measured here at 16 x 576 in
    bf16, norm + the next matmul: 110 -> 95 us; outputs bit-identical). The returned tensor is then a
    strided view, which the matmuls read in place. On other devices ``F.rms_norm`` is one fused kernel."""

    def __init__(self, weight: torch.Tensor, eps: float, native: CpuKernels | None = None) -> None:
        super().__init__()
        self.fused = weight.device.type != "cpu"
        plain = native is not None or self.fused
        self.weight = torch.nn.Parameter(weight if plain else torch.cat((weight, weight)), requires_grad=False)
        self.eps = eps
        self.native = native

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return self.native.rms_norm(x, self.weight, self.eps)
        if self.fused:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        n = x.shape[-1]
        return F.layer_norm(torch.cat((x, -x), dim=-1), (2 * n,), self.weight, None, self.eps)[..., :n]


def make_linear(w: dict[str, torch.Tensor], parts: list[tuple[str, float]], dtype: torch.dtype,
                quant: Quantizer | None) -> torch.nn.Module:
    """The linear of the named weights stacked along N, each times its factor: quantised (quant.py) when
    ``quant`` is given, else converted to ``dtype`` after the float32 products."""
    if quant is not None:
        return quant.linear(parts)
    return Linear(torch.cat([w[name].float() * f if f != 1.0 else w[name] for name, f in parts]).to(dtype))


class Layer(torch.nn.Module):
    """One decoder block; Q/K/V and gate/up are fused into single matmuls, the residual adds into the
    output projections, and the attention scale 1/sqrt(head_dim) into the Q rows of the QKV weight
    (a power of two for head_dim 64, 256, ...: exact in any dtype)."""

    def __init__(self, spec: ModelSpec, w: dict[str, torch.Tensor], i: int, dtype: torch.dtype,
                 native: CpuKernels | None = None, paged: PagedAttention | None = None,
                 quant: Quantizer | None = None) -> None:
        super().__init__()
        p = f"blk.{i}."
        self.spec = spec
        self.attn_norm = RMSNorm(w[p + "attn_norm.weight"].to(dtype), spec.rms_eps, native)
        self.ffn_norm = RMSNorm(w[p + "ffn_norm.weight"].to(dtype), spec.rms_eps, native)
        qkv = [(p + "attn_q.weight", spec.head_dim**-0.5), (p + "attn_k.weight", 1.0), (p + "attn_v.weight", 1.0)]
        self.qkv = make_linear(w, qkv, dtype, quant)
        self.o = make_linear(w, [(p + "attn_output.weight", 1.0)], dtype, quant)
        self.gate_up = make_linear(w, [(p + "ffn_gate.weight", 1.0), (p + "ffn_up.weight", 1.0)], dtype, quant)
        self.down = make_linear(w, [(p + "ffn_down.weight", 1.0)], dtype, quant)
        self.q_size = spec.n_heads * spec.head_dim
        self.kv_size = spec.n_kv_heads * spec.head_dim
        self.native = native
        self.paged = paged

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: LayerKV,
        batch: AttnBatch,
    ) -> torch.Tensor:
        s = self.spec
        t = x.shape[0]
        qkv = self.qkv(self.attn_norm(x))
        if self.native is not None and kv.k_scale is None:  # Q rotated in place, K rotated and V into the cache
            self.native.rope_write_kv(qkv, cos, sin, batch.slot_mapping, kv.k, kv.v, s.n_heads)
            q = qkv[:, : self.q_size].view(t, s.n_heads, s.head_dim)
        elif self.native is not None:  # int8 cache: Q and K rotated in place, then K and V quantised into it
            assert kv.k_scale is not None and kv.v_scale is not None
            self.native.rope_write_kv(qkv, cos, sin, batch.slot_mapping, None, None, s.n_heads)
            kv_end = self.q_size + self.kv_size
            self.native.kv_write_int8(qkv[:, self.q_size : kv_end], batch.slot_mapping, kv.k, kv.k_scale)
            self.native.kv_write_int8(qkv[:, kv_end:], batch.slot_mapping, kv.v, kv.v_scale)
            q = qkv[:, : self.q_size].view(t, s.n_heads, s.head_dim)
        else:  # one RoPE over the Q and K heads together (fewer kernels: dispatch dominates at this size)
            qk = _rope(qkv[:, : self.q_size + self.kv_size].view(t, s.n_heads + s.n_kv_heads, s.head_dim), cos, sin)
            q, k = qk.split([s.n_heads, s.n_kv_heads], dim=1)
            v = qkv[:, self.q_size + self.kv_size :].view(t, s.n_kv_heads, s.head_dim)
            kv_cache.write(kv, k, v, batch.slot_mapping)
        if batch.paged is not None:
            assert self.paged is not None, "paged metadata for a model built without the paged kernel"
            pb = batch.paged
            attn = self.paged(q, kv.k, kv.v, pb.tables, pb.q_start, pb.n_new, pb.ctx_len, pb.max_new)
        else:
            attn = _attention(q, kv, batch, self.native)
        x = self.o(attn.reshape(t, self.q_size), residual=x)
        gate_up = self.gate_up(self.ffn_norm(x))
        if self.native is not None:
            return self.down(self.native.silu_mul(gate_up), residual=x)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down(F.silu(gate) * up, residual=x)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE ``x * cos + [-x2, x1] * sin`` as ``x * cos + [x2, x1] * [-sin1, sin1]``: ``sin`` comes
    with the sign folded into its first half, so the rotation is one ``roll``. ``cos``/``sin``: [T, 1, D]."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


def _attention(q: torch.Tensor, kv: LayerKV, batch: AttnBatch, native: CpuKernels | None = None) -> torch.Tensor:
    """Attention over the paged cache ``[KVH, blocks, block_size, D]`` (GQA; bf16, or int8 with per-block
    scales: kv_cache.py); ``q`` comes pre-scaled by 1/sqrt(D) (folded into the weights).

    All single-token (decode) rows go in one call: the native kernel when given (it reads the blocks in
    place, see kernels/native.py), else two batched matmuls over (sequence, KV head) on gathered
    blocks: the gather is ordered so that it already is ``[B * KVH, ctx, D]``, which makes the queries'
    ``[B, H, D]`` a free view ``[B * KVH, G, D]`` and the output come back as ``[B, H, D]`` with no permuted
    copy. Each prefill chunk runs as its own SDPA call on its gathered blocks (causal within the chunk,
    full view of its cached prefix)."""
    decode_only = not batch.prefills
    out = q if decode_only else torch.empty_like(q)
    kvh, _, _, d = kv.k.shape
    if batch.decode_rows is not None:
        qd = q if decode_only else q.index_select(0, batch.decode_rows)  # [B, H, D]
        if native is not None:
            assert batch.decode_tables is not None and batch.decode_lens is not None
            o = native.paged_attention(qd, kv.k, kv.v, batch.decode_tables, batch.decode_lens, kv.k_scale, kv.v_scale)
        else:
            assert batch.decode_cache_rows is not None and batch.decode_bias is not None
            b, h, _ = qd.shape
            kd = kv_cache.gather_blocks(kv.k, kv.k_scale, batch.decode_cache_rows, q.dtype).view(b * kvh, -1, d)
            vd = kv_cache.gather_blocks(kv.v, kv.v_scale, batch.decode_cache_rows, q.dtype).view(b * kvh, -1, d)
            # one query per sequence and head: two batched matmuls beat SDPA's flash kernel (built for long
            # queries); the padding bias (0 or -inf) is added by the matmul
            scores = torch.baddbmm(batch.decode_bias, qd.reshape(b * kvh, h // kvh, d), kd.transpose(1, 2))
            probs = torch.softmax(scores, dim=-1)  # float32 inside the kernel, written in the model's dtype
            o = torch.bmm(probs, vd).view(b, h, d)
        if decode_only:
            return o
        out.index_copy_(0, batch.decode_rows, o)
    for grp in batch.prefills:
        qp = q[grp.rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        kp = kv_cache.gather_blocks(kv.k, kv.k_scale, grp.cache_rows, q.dtype).view(kvh, -1, d)[:, : grp.ctx]
        vp = kv_cache.gather_blocks(kv.v, kv.v_scale, grp.cache_rows, q.dtype).view(kvh, -1, d)[:, : grp.ctx]
        kp, vp = kp.unsqueeze(0), vp.unsqueeze(0)  # [1, KVH, ctx, D]
        if grp.mask is None:
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True, scale=1.0)
        else:
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=grp.mask, enable_gqa=True, scale=1.0)
        out[grp.rows] = o.squeeze(0).transpose(0, 1)
    return out


class LlamaModel(torch.nn.Module):
    """Llama with tied (or separate) output head; weights converted once to ``dtype`` on the device the
    weights ``w`` are on (every parameter, buffer and table lands there). ``native``: the CPU kernels
    (kernels/native.py) for the norms, RoPE + KV write, decode attention and SiLU-and-multiply; ``paged``: the GPU
    paged-attention kernel (kernels/triton_attention.py) for all attention rows; ``quant``: weight-only quantised
    linears (quant.py) for the layers and the output head."""

    def __init__(self, spec: ModelSpec, w: dict[str, torch.Tensor], dtype: torch.dtype,
                 native: CpuKernels | None = None, paged: PagedAttention | None = None,
                 quant: Quantizer | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.dtype = dtype
        self.embed = torch.nn.Parameter(w["token_embd.weight"].to(dtype), requires_grad=False)
        self.lm_head = make_linear(w, [("output.weight" if "output.weight" in w else "token_embd.weight", 1.0)], dtype, quant)
        self.layers = torch.nn.ModuleList(Layer(spec, w, i, dtype, native, paged, quant) for i in range(spec.n_layers))
        self.norm = RMSNorm(w["output_norm.weight"].to(dtype), spec.rms_eps, native)
        # cos/sin for every position, computed once in float64 (gathered per step, not recomputed)
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, spec.head_dim, 2, dtype=torch.float64) / spec.head_dim))
        freqs = torch.arange(spec.context_length, dtype=torch.float64)[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        dev = self.embed.device
        self.register_buffer("rope_cos", torch.cat((cos, cos), dim=-1).to(dev, dtype)[:, None, :], persistent=False)
        self.register_buffer("rope_sin", torch.cat((-sin, sin), dim=-1).to(dev, dtype)[:, None, :], persistent=False)

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, head_dim] cos and sin for ``positions``."""
        return self.rope_cos.index_select(0, positions), self.rope_sin.index_select(0, positions)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKV],
        batch: AttnBatch,
        logits_rows: torch.Tensor,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """Run all new tokens; return float32 logits only for ``logits_rows``.

        ``num_layers`` runs only the first layers (then norm + head): a self-draft for speculation."""
        return self.logits(self.hidden(input_ids, positions, kv_caches, batch, num_layers), logits_rows)

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKV], batch: AttnBatch,
               num_layers: int | None = None) -> torch.Tensor:
        """The last layer's output for every new token, before the final norm."""
        cos, sin = self.rope_tables(positions)
        x = F.embedding(input_ids, self.embed)
        for layer, kv in zip(self.layers[:num_layers], kv_caches, strict=False):
            x = layer(x, cos, sin, kv, batch)
        return x

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Float32 logits of ``rows`` of :meth:`hidden`'s output."""
        return self.lm_head(self.norm(hidden.index_select(0, rows))).float()
