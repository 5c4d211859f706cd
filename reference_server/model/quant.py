"""Weight-only quantised linear layers for the CPU path (``--quantization``).

Single-stream decode reads every weight once per step, so its speed is bytes per weight: bf16 reads 16 bits,
int8 8 (+ one float32 scale per output channel), int4 4.5-5 (a scale and a minimum per 32 weights).

* ``int4``: group-wise, 32 weights per group, ``w = q * d + m`` with ``q`` in 0..15. Tensors the GGUF holds
  as Q4_0 / Q4_1 are taken block for block (no re-quantisation: the weights are the very values the bf16
  path dequantises to), Q8_0 tensors as int8 blocks (never below what the GGUF holds); other tensors are
  re-quantised (asymmetric, min/max of each group).
* ``int8``: Q8_0 tensors block for block (int8, a scale per 32); others per output channel, symmetric
  (``w = q * s``, ``q`` in -127..127), re-quantised from the GGUF's values.

The native kernel (``qlinear_bf16`` in csrc/cpu_kernels.c), for up to 3 rows (decode at low concurrency):
on CPUs with AVX512-VNNI, integer dot products of the weights' bytes with x quantised to int8 per block of
32 (as llama.cpp's Q8_1 activations: the activations' rounding is this path's accuracy cost), else the
weights unpacked to bf16 in registers and VDPBF16PS; for 4-32 rows weights dequantised to bf16 tiles in
L1 and VDPBF16PS; for more (prefill) the layer dequantises the whole weight once into bf16 and lets oneDNN
run the matmul."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from reference_server.kernels.native import CpuKernels
from reference_server.kernels.quant_weight import QuantWeight
from reference_server.model.gguf_loader import ModelSpec, gguf_reader, unpermute

GROUP = 32  # int4 group size: GGUF's block
NATIVE_MAX_ROWS = 32  # up to this many rows the native kernel; above, dequantise once + a bf16 matmul
_Q4 = {gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1}
_FLOAT = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}


def quantize_int4(w: torch.Tensor, group: int = GROUP) -> QuantWeight:
    """Asymmetric group-wise int4 of a float weight [N, K] (a partial last group is padded with zeros)."""
    n, k = w.shape
    kp = -(-k // 32) * 32
    wp = F.pad(w.float(), (0, -(-k // group) * group - k)).view(n, -1, group)  # group % 32 == 0
    lo, hi = wp.amin(-1), wp.amax(-1)
    d = (hi - lo) / 15
    q = torch.where(d[..., None] > 0, torch.round((wp - lo[..., None]) / d.clamp_min(1e-30)[..., None]), 0).clamp(0, 15)
    q = q.to(torch.uint8).view(n, -1)[:, :kp].reshape(n, kp // 32, 32)
    packed = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, -1).contiguous()
    return QuantWeight(packed, d.contiguous(), lo.contiguous(), 4, group, k)


def quantize_int8(w: torch.Tensor) -> QuantWeight:
    """Symmetric per-output-channel int8 of a float weight [N, K]."""
    n, k = w.shape
    kp = -(-k // 32) * 32
    s = w.float().abs().amax(-1) / 127
    q = torch.round(w.float() / s.clamp_min(1e-30)[:, None]).clamp(-127, 127).to(torch.int8)
    packed = (F.pad(q, (0, kp - k)).view(torch.uint8) ^ 128).contiguous()
    return QuantWeight(packed, s[:, None].contiguous(), torch.zeros(n, 1), 8, kp, k)


def from_gguf_blocks(raw: np.ndarray, kind: gguf.GGMLQuantizationType, n: int, k: int) -> QuantWeight:
    """The GGUF blocks of an [N, K] tensor (K % 32 == 0) as they are: Q4_0 (f16 d, 16 bytes of nibbles,
    ``w = (q - 8) d``), Q4_1 (f16 d, f16 m, 16 bytes, ``w = q d + m``) or Q8_0 (f16 d, 32 int8, ``w = q d``;
    held as ``q + 128``)."""
    head = {gguf.GGMLQuantizationType.Q4_0: 2, gguf.GGMLQuantizationType.Q4_1: 4, gguf.GGMLQuantizationType.Q8_0: 2}[kind]
    bits = 8 if kind == gguf.GGMLQuantizationType.Q8_0 else 4
    blocks = raw.reshape(n, k // 32, head + bits * 4)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == gguf.GGMLQuantizationType.Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        m = -8 * d if bits == 4 else np.zeros_like(d)
    qs = np.ascontiguousarray(blocks[..., head:]).reshape(n, -1) ^ (128 if bits == 8 else 0)
    return QuantWeight(torch.from_numpy(qs), torch.from_numpy(d), torch.from_numpy(np.ascontiguousarray(m)), bits, 32, k)


def auto_quantization(path: Path) -> tuple[str, str]:
    """What ``--quantization auto`` picks for this GGUF, and why: int4 when its linear weights are 4-bit
    blocks, none when they are float, else int8."""
    reader = gguf_reader(path)
    kinds = [t.tensor_type for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    q4 = sum(kind in _Q4 or "Q4" in kind.name for kind in kinds)
    fl = sum(kind in _FLOAT for kind in kinds)
    if q4 * 2 > len(kinds):
        return "int4", f"{q4}/{len(kinds)} linear weights are 4-bit in the GGUF"
    if fl * 2 > len(kinds):
        return "none", f"{fl}/{len(kinds)} linear weights are float in the GGUF"
    return "int8", "the GGUF's linear weights are 5-8 bit"


class Quantizer:
    """Builds the quantised layers of one model from its GGUF (raw blocks) and float weights."""

    def __init__(self, mode: str, path: Path, spec: ModelSpec, weights: dict[str, torch.Tensor], native: CpuKernels):
        self.mode = mode
        self.native = native
        self.weights = weights
        self.raw: dict[str, tuple[gguf.GGMLQuantizationType, np.ndarray]] = {}
        taken = _Q4 | {gguf.GGMLQuantizationType.Q8_0} if mode == "int4" else {gguf.GGMLQuantizationType.Q8_0}
        for t in gguf_reader(path).tensors:
            if t.tensor_type in taken and len(t.shape) == 2 and int(t.shape[0]) % 32 == 0:
                data = np.asarray(t.data).reshape(int(t.shape[1]), -1)
                if t.name.endswith("attn_q.weight"):
                    data = unpermute(data, spec.n_heads)
                elif t.name.endswith("attn_k.weight"):
                    data = unpermute(data, spec.n_kv_heads)
                self.raw[t.name] = (t.tensor_type, data)

    def weight(self, name: str, factor: float = 1.0) -> QuantWeight:
        """Tensor ``name`` quantised, times ``factor`` (a power of two: exact)."""
        w = self.weights[name]
        if name in self.raw:
            kind, data = self.raw[name]
            return from_gguf_blocks(data, kind, *w.shape).scaled(factor)
        return quantize_int8(w * factor) if self.mode == "int8" else quantize_int4(w * factor)

    def linear(self, parts: list[tuple[str, float]]) -> QuantLinear:
        """The fused linear of the named tensors stacked along N, each times its factor."""
        return QuantLinear(QuantWeight.cat([self.weight(name, f) for name, f in parts]), self.native)


def linear_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's linear weights (layers and head) as they are held: what one decode step reads."""
    total = 0
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            total += mod.weight.nbytes
        elif type(mod).__name__ == "Linear" and isinstance(getattr(mod, "weight", None), torch.Tensor):
            total += mod.weight.numel() * mod.weight.element_size()
    return total


class QuantLinear(torch.nn.Module):
    """``y = x @ W.T (+ residual)`` with W quantised (bf16 activations in and out, float32 sums)."""

    def __init__(self, weight: QuantWeight, native: CpuKernels) -> None:
        super().__init__()
        self.weight = weight
        self.native = native

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] == 0:  # no rows (the head of a step whose rows are all pooled): the native kernel needs one
            return x.new_empty((0, self.weight.n))
        if x.shape[0] <= NATIVE_MAX_ROWS:
            return self.native.qlinear(x, self.weight, residual)
        w = self.native.qdequant(self.weight)
        if residual is not None:
            return torch.addmm(residual, x, w.t())
        return F.linear(x, w)
