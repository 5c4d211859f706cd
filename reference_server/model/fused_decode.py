"""A decode step of the quantised CPU model as one native call (``decode_forward`` in csrc/cpu_kernels.c).

Op by op, a single-stream decode step is ~10 small kernel calls per layer (norm, QKV, RoPE + KV write,
attention, O, norm, gate/up, SiLU, down): 300 calls through Python, ctypes and a fresh OpenMP region
each, around kernels that take 2-100 us. At one stream that overhead was about a fifth of the step. The
native step runs the same kernels in the same order inside one parallel region, so its logits are those
of the per-op path bit for bit; it serves decode-only steps of up to ``quant.NATIVE_MAX_ROWS`` sequences
(the rows the per-op path gives to the same kernels), and the runner keeps the per-op path for the rest."""

from __future__ import annotations

import torch

from reference_server.kernels.native import CpuKernels, QLayer, QMat, QModel
from reference_server.kernels.quant_weight import QuantWeight
from reference_server.model.kv_cache import LayerKV
from reference_server.model.model import AttnBatch, LlamaModel
from reference_server.model.quant import NATIVE_MAX_ROWS, QuantLinear


def _qmat(linear: torch.nn.Module) -> QMat:
    assert isinstance(linear, QuantLinear)
    w: QuantWeight = linear.weight
    return QMat(w.qweight.data_ptr(), w.scale.data_ptr(), w.minimum.data_ptr(), w.n, w.k, w.bits, w.group)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedDecode:
    """The model's weights and KV cache as ``decode_forward`` reads them: pointers, taken once (the model and
    the caches are kept referenced here, and neither moves)."""

    def __init__(self, model: LlamaModel, kv_caches: list[LayerKV], native: CpuKernels) -> None:
        s = model.spec
        _, num_blocks, block_size, _ = kv_caches[0].k.shape
        layers = (QLayer * s.n_layers)(*[
            QLayer(layer.attn_norm.weight.data_ptr(), layer.ffn_norm.weight.data_ptr(), _qmat(layer.qkv),
                   _qmat(layer.o), _qmat(layer.gate_up), _qmat(layer.down), kv.k.data_ptr(), kv.v.data_ptr(),
                   _ptr(kv.k_scale), _ptr(kv.v_scale))
            for layer, kv in zip(model.layers, kv_caches, strict=True)])
        head = model.lm_head
        self.model = QModel(s.n_layers, s.hidden, s.ffn, s.n_heads, s.n_kv_heads, s.head_dim,
                            model.embed.shape[0], num_blocks, block_size, int(native.vnni), s.rms_eps, model.rope_cos.shape[0],
                            model.embed.data_ptr(), model.rope_cos.data_ptr(), model.rope_sin.data_ptr(),
                            model.norm.weight.data_ptr(), _qmat(head), layers)
        self._keep = (model, kv_caches, layers)
        self.native = native
        self.num_layers = s.n_layers

    @staticmethod
    def available(model: LlamaModel, native: CpuKernels | None) -> bool:
        """Whether every linear of ``model`` is quantised on the native kernels (what the native step runs)."""
        return native is not None and all(isinstance(m, QuantLinear) for m in
                                          [model.lm_head] + [getattr(layer, name) for layer in model.layers
                                                             for name in ("qkv", "o", "gate_up", "down")])

    @staticmethod
    def serves(batch: AttnBatch, num_rows: int, logits_rows: list[int]) -> bool:
        """Whether a step is one the native step runs: every row a decode row whose logits are wanted."""
        return (not batch.prefills and batch.decode_tables is not None and num_rows <= NATIVE_MAX_ROWS
                and len(logits_rows) == num_rows)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, batch: AttnBatch,
                 num_layers: int | None = None) -> torch.Tensor:
        """Float32 logits [B, vocab] for a step that :meth:`serves` accepts."""
        assert batch.decode_tables is not None and batch.decode_lens is not None
        return self.native.decode_forward(self.model, ids, positions, batch.slot_mapping, batch.decode_tables,
                                          batch.decode_lens, self.num_layers if num_layers is None else num_layers)

