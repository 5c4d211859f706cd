"""A quantised weight as packed blocks: what the quantiser (model/quant.py) makes and the native kernels read."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantWeight:
    """A weight [N, K] as packed blocks of 32 along K (layout in csrc/cpu_kernels.c): ``qweight`` uint8
    [N, ceil(K / 32) * bits * 4] (int4: two nibbles a byte; int8: ``q + 128``, the unsigned operand of the
    integer dot product), ``scale`` / ``minimum`` float32 [N, groups]."""

    qweight: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    bits: int
    group: int
    k: int

    @property
    def n(self) -> int:
        return self.qweight.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scale, self.minimum))

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: ``q * scale + minimum`` (reference; the kernel rounds this to bf16)."""
        nblk = self.qweight.shape[1] // (self.bits * 4)
        q = self.qweight.view(self.n, nblk, self.bits * 4)
        if self.bits == 4:
            q = torch.cat((q & 15, q >> 4), dim=-1).float()  # low nibbles: elements 0..15, high: 16..31
        else:
            q = q.float() - 128
        q = q.reshape(self.n, nblk * 32)
        per = self.group
        s = self.scale.repeat_interleave(per, dim=1)[:, : nblk * 32]
        m = self.minimum.repeat_interleave(per, dim=1)[:, : nblk * 32]
        return (q * s + m)[:, : self.k]

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight:
        """Stack along N (the fused QKV and gate/up weights)."""
        first = parts[0]
        if any((p.bits, p.group, p.k) != (first.bits, first.group, first.k) for p in parts):
            raise ValueError("cannot fuse weights quantised differently")
        return QuantWeight(torch.cat([p.qweight for p in parts]), torch.cat([p.scale for p in parts]),
                           torch.cat([p.minimum for p in parts]), first.bits, first.group, first.k)

    def scaled(self, factor: float) -> QuantWeight:
        """The weight times ``factor`` (a power of two stays exact)."""
        return QuantWeight(self.qweight, self.scale * factor, self.minimum * factor, self.bits, self.group, self.k)
