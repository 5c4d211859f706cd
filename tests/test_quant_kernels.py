"""Weight-only quantised linears (reference_server/model/quant.py, ``qlinear_bf16`` in csrc/cpu_kernels.c)
against float32 references: every block layout the loader takes (Q4_0, Q4_1, Q8_0 blocks, re-quantised
int4 groups, per-channel int8), odd shapes, a partial last group, 1..40 rows, the residual epilogue; for
decode-size rows both paths: the integer one (int8 activations, AVX512-VNNI) and the bf16 one."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_native_kernels import _logit_errors, dense_engine
from test_reference_engine import _weights

from reference_server.config import EngineConfig
from reference_server.kernels import native
from reference_server.model.model_runner import ModelRunner
from reference_server.model.quant import (
    NATIVE_MAX_ROWS,
    QuantLinear,
    QuantWeight,
    from_gguf_blocks,
    quantize_int4,
    quantize_int8,
)
from reference_server.model_files import default_model_path


def kernels() -> native.CpuKernels:
    k = native.cpu_kernels()
    assert not isinstance(k, str), f"native CPU kernels unavailable: {k}"
    return k


def int8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as the integer path takes it (qlinear with vnni, up to 3 rows): per block of 32, dx = max|x| /
    127 and q = round(x * (127 / max|x|)) (ties to even); returns q * dx and dx for every element, float32."""
    m, k = x.shape
    xb = F.pad(x.float(), (0, -(-k // 32) * 32 - k)).view(m, -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    q = torch.round(xb * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
    dx = (amax / 127).expand_as(xb)
    return (q * dx).reshape(m, -1)[:, :k], dx.reshape(m, -1)[:, :k]


def weight_parts(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 weight [N, K] as the part the integer path multiplies with the int8 activations and the
    part it multiplies with the bf16 x's own block sums: int4 ``(q - 8) * scale`` and ``minimum + 8 * scale``,
    int8 ``q * scale`` and zero."""
    deq = w.dequantize()
    if w.bits == 8:
        return deq, torch.zeros_like(deq)
    offset = (w.minimum + 8 * w.scale).repeat_interleave(w.group, dim=1)[:, : w.k]
    return deq - offset, offset


def reference(x: torch.Tensor, w: QuantWeight, residual: torch.Tensor | None, integer: bool = False) -> torch.Tensor:
    """float32 x @ W.T with W as the kernel holds it: the dequantised value rounded to bf16, or (integer: the
    VNNI path) the exact weight times x rounded to int8 activations as that path does."""
    if integer:
        qd, mins = weight_parts(w)
        y = int8_activations(x)[0] @ qd.t() + x.float() @ mins.t()
    else:
        y = x.float() @ w.dequantize().to(torch.bfloat16).float().t()
    return y if residual is None else y + residual.float()


def paths(rows: int) -> list[bool]:
    """The paths a qlinear of ``rows`` rows can take here: bf16 always, the integer one for up to 3 rows on
    a CPU with AVX512-VNNI."""
    return [False, True] if rows <= kernels().direct_rows and kernels().vnni else [False]


def check(w: QuantWeight, rows: int, seed: int, residual: bool = True) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, w.k + 3, generator=g).to(torch.bfloat16)[:, : w.k]  # strided rows
    res = torch.randn(rows, w.n, generator=g).to(torch.bfloat16) if residual else None
    for integer in paths(rows):
        out = kernels().qlinear(x, w, res, vnni=integer)
        ref = reference(x, w, res, integer)
        # float32 sums in another order, one bf16 rounding of the output
        tol = 2.0**-7 * ref.abs() + 4e-3 * (x.float().abs() @ w.dequantize().abs().t()).clamp_min(1)
        assert out.shape == ref.shape and out.dtype == torch.bfloat16
        assert ((out.float() - ref).abs() <= tol).all(), (integer, (out.float() - ref).abs().max())


def gguf_blocks(kind: gguf.GGMLQuantizationType, n: int, k: int, seed: int) -> tuple[QuantWeight, np.ndarray]:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = gguf.quants.quantize(w, kind)
    return from_gguf_blocks(raw, kind, n, k), gguf.quants.dequantize(raw, kind).reshape(n, k)


@pytest.mark.parametrize("kind", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
                                  gguf.GGMLQuantizationType.Q8_0])
@pytest.mark.parametrize(("n", "k"), [(7, 32), (64, 576), (13, 96)])
def test_gguf_blocks_match_gguf_dequantisation(kind, n, k):
    w, deq = gguf_blocks(kind, n, k, n + k)
    assert torch.equal(w.dequantize(), torch.from_numpy(deq))  # bit for bit what the bf16 path loads
    assert torch.equal(kernels().qdequant(w), torch.from_numpy(deq).to(torch.bfloat16))
    for rows in (1, 3, 4, 5, 16):
        check(w, rows, rows)


@pytest.mark.parametrize(("n", "k"), [(1, 1), (5, 31), (9, 33), (17, 100), (64, 576), (3, 1000)])
@pytest.mark.parametrize("bits", [4, 8])
def test_requantised_odd_shapes_and_partial_groups(n, k, bits):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * k))
    q = quantize_int4(w) if bits == 4 else quantize_int8(w)
    # the quantisation itself: within half a step of every weight
    step = (q.scale.repeat_interleave(q.group, 1)[:, :k]) * (1 if bits == 4 else 1)
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    for rows in (1, 2, 4, 7, 16, 33):
        check(q, rows, rows, residual=rows % 2 == 0)


@pytest.mark.parametrize("kind", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
                                  gguf.GGMLQuantizationType.Q8_0, "int4", "int8"])
@pytest.mark.parametrize(("n", "k"), [(9, 31), (37, 576), (6, 1000), (3, 1536)])
def test_integer_path_error_is_the_activations_rounding(kind, n, k):
    """Against the float32 product with the exact x: the integer path's only error beyond summation order
    and the bf16 output is x rounded to int8 per block, at most dx / 2 per element, so
    |out - x @ W.T| <= |q * scale| @ (dx / 2) (+ the output's bf16 rounding). The bound is reached by a
    fraction of it: the roundings' signs vary (measured here: at most 11 %, median 1-2 %)."""
    if isinstance(kind, str):
        wf = torch.randn(n, k, generator=torch.Generator().manual_seed(k))
        w = quantize_int4(wf) if kind == "int4" else quantize_int8(wf)
    elif k % 32:
        return  # GGUF blocks need K % 32 == 0
    else:
        w = gguf_blocks(kind, n, k, n)[0]
    g = torch.Generator().manual_seed(n + k)
    for rows in range(1, kernels().direct_rows + 1):
        x = (torch.randn(rows, k, generator=g) * torch.rand(rows, k, generator=g) * 4).to(torch.bfloat16)
        out = kernels().qlinear(x, w, vnni=True)
        bf16_path = kernels().qlinear(x, w, vnni=False)
        if not kernels().vnni:  # a CPU without AVX512-VNNI: asking for the integer path gives the bf16 one
            assert torch.equal(out, bf16_path)
            continue
        assert not torch.equal(out, bf16_path)  # the integer path ran
        exact = x.float() @ w.dequantize().t()
        qd, _ = weight_parts(w)
        bound = (int8_activations(x)[1] / 2) @ qd.abs().t()
        tol = bound + 2.0**-8 * exact.abs() + 1e-4 * (x.float().abs() @ w.dequantize().abs().t())
        assert ((out.float() - exact).abs() <= tol).all(), ((out.float() - exact).abs() - tol).max()


def test_int4_groups_wider_than_a_block():
    w = quantize_int4(torch.randn(6, 200, generator=torch.Generator().manual_seed(3)), group=64)
    check(w, 5, 1)
    # the integer path takes groups of 32 or one per row: these decode rows keep the bf16 path
    x = torch.randn(2, 200, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    assert torch.equal(kernels().qlinear(x, w, vnni=True), kernels().qlinear(x, w, vnni=False))


def test_layer_switches_to_dequantised_matmul_for_many_rows():
    w, _ = gguf_blocks(gguf.GGMLQuantizationType.Q4_1, 48, 576, 1)
    layer = QuantLinear(w, kernels())
    g = torch.Generator().manual_seed(0)
    for rows in (NATIVE_MAX_ROWS, NATIVE_MAX_ROWS + 1, 200):
        x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
        res = torch.randn(rows, 48, generator=g).to(torch.bfloat16)
        ref = reference(x, w, res)
        out = layer(x, res).float()
        assert ((out - ref).abs() <= 2.0**-7 * ref.abs() + 0.05).all()


def test_a_layer_given_no_rows_returns_none():
    """A step whose rows are all pooled (embeddings) asks the head for no logits: an empty answer, not the native
    kernel (which needs a row: it crashed the server on its first embeddings request)."""
    w, _ = gguf_blocks(gguf.GGMLQuantizationType.Q4_1, 48, 576, 1)
    out = QuantLinear(w, kernels())(torch.empty(0, 576, dtype=torch.bfloat16))
    assert out.shape == (0, 48) and out.dtype == torch.bfloat16


def test_bad_layout_is_refused():
    w = quantize_int8(torch.randn(4, 64))
    with pytest.raises(ValueError, match="layout"):
        kernels().qlinear(torch.randn(2, 64), w)  # float32, not bf16
    with pytest.raises(ValueError, match="layout"):
        kernels().qlinear(torch.randn(2, 63).to(torch.bfloat16), w)


def test_quantised_engines_against_float32():
    """The whole model with quantised linears against the float32 model (teacher-forced over a greedy
    run of 12 tokens: 60 scored rows each): int4 takes the GGUF's Q4_1 blocks as they are, so with bf16
    activations it is as close as the bf16 path (mean of the per-row max error 0.33, top-1 agreement 98 %);
    decode rows on a CPU with AVX512-VNNI round the activations to int8 per block of 32 as well (measured
    there: 0.390 / 100 %). int8 is re-quantised per channel from them, one more rounding of every weight.
    Measured here: int4 0.390 / 100 %, int8 0.980 / 98.3 % (bf16 activations: 0.325 and 0.960)."""
    dense = dense_engine()
    int4_err, int4_agree, mixed = _logit_errors("native", dense, max_tokens=12, quantization="int4")
    int8_err, int8_agree, _ = _logit_errors("native", dense, max_tokens=12, quantization="int8")
    assert mixed and len(int4_err) >= 50
    assert int4_err.mean() <= 0.45 and int4_agree >= 0.95
    assert int8_err.mean() <= 1.3 and int8_agree >= 0.93


def test_quantization_choice_and_refusal():
    spec, w = _weights()
    cfg = EngineConfig(model=default_model_path(), dtype="bf16", threads=1, quantization="auto", num_kv_blocks=64)
    runner = ModelRunner(cfg, spec, w)
    assert runner.quantization == "int4" and "Q4" not in runner.quantization_note  # the bundled GGUF is Q4_1
    assert "4-bit" in runner.quantization_note
    assert isinstance(runner.model.layers[0].qkv, QuantLinear)
    assert runner.model.lm_head.weight.bits == 8  # token_embd is Q8_0: taken as int8 blocks, not re-quantised
    fp32 = EngineConfig(model=default_model_path(), dtype="fp32", threads=1, quantization="int4", num_kv_blocks=64)
    with pytest.raises(ValueError, match="not available on this device"):
        ModelRunner(fp32, spec, w)
    auto32 = EngineConfig(model=default_model_path(), dtype="fp32", threads=1, quantization="auto", num_kv_blocks=64)
    assert ModelRunner(auto32, spec, w).quantization == "none"
    with pytest.raises(ValueError, match="unknown quantization"):
        EngineConfig(model=default_model_path(), quantization="int3")
