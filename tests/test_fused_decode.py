"""The native decode step (reference_server/model/fused_decode.py, ``decode_forward`` in csrc/cpu_kernels.c) against
the per-op path it replaces: the same logits and the same KV cache bit for bit, for 1..5 sequences (the
direct and the tiled quantised kernels), contexts across block boundaries, int4 and int8 weights, bf16 and
int8 caches, the self-draft's first layers; and what it refuses."""

from __future__ import annotations

import pytest
import torch
from test_reference_engine import _codec, _weights

from reference_server.config import EngineConfig
from reference_server.engine.engine import Engine
from reference_server.engine.scheduler import ScheduledBatch
from reference_server.engine.sequence import SamplingParams
from reference_server.model.model_runner import ModelRunner
from reference_server.model_files import default_model_path


def quant_engine(quantization: str, kv_cache_dtype: str) -> Engine:
    spec, w = _weights()
    cfg = EngineConfig(model=default_model_path(), dtype="bf16", threads=2, quantization=quantization,
                       kv_cache_dtype=kv_cache_dtype, num_kv_blocks=64, enable_prefix_caching=False)
    return Engine(cfg, ModelRunner(cfg, spec, w), _codec())


def kv_snapshot(engine: Engine) -> list[torch.Tensor]:
    return [t.clone() for kv in engine.runner.kv_caches for t in kv if t is not None]


def kv_restore(engine: Engine, saved: list[torch.Tensor]) -> None:
    live = [t for kv in engine.runner.kv_caches for t in kv if t is not None]
    for t, s in zip(live, saved, strict=True):
        t.copy_(s)


@pytest.mark.parametrize(("quantization", "kv"), [("int4", "auto"), ("int8", "int8")])
def test_native_step_is_the_per_op_step_bit_for_bit(quantization, kv):
    engine = quant_engine(quantization, kv)
    runner = engine.runner
    assert runner.fused is not None
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for n in (5, 17, 33, 16, 40):  # contexts that end inside, and exactly at the end of, a block of 16
        engine.add_request([(11 * n + j) % 3000 + 50 for j in range(n)], params)
    engine.step()  # admits them (queued until a step) and prefills them: 111 tokens, one step's budget
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()
    seqs = [s for s, _ in engine.scheduler.schedule().items]  # (allocates each one's slot for its next token)
    assert len(seqs) == 5
    fused = runner.fused
    for members, num_layers in (([0], None), ([1, 3], None), ([0, 2, 4], None), ([0, 1, 2, 3, 4], None),
                                ([4, 1], 7)):
        batch = ScheduledBatch([(seqs[i], 1) for i in members])
        before = kv_snapshot(engine)
        got = runner.forward(batch, num_layers)
        got_kv = kv_snapshot(engine)
        kv_restore(engine, before)
        runner.fused = None  # the per-op path
        try:
            want = runner.forward(batch, num_layers)
        finally:
            runner.fused = fused
        assert got.shape == want.shape == (len(members), runner.spec.vocab) and got.dtype == torch.float32
        assert torch.equal(got, want), (members, (got - want).abs().max())
        assert all(torch.equal(a, b) for a, b in zip(got_kv, kv_snapshot(engine), strict=True))


def test_native_step_serves_decode_only_steps_and_refuses_bad_input():
    engine = quant_engine("int4", "auto")
    runner = engine.runner
    calls = []
    fused = runner.fused
    assert fused is not None

    def spy(*a: object, **kw: object) -> torch.Tensor:
        calls.append(a[0].shape[0])  # type: ignore[attr-defined]
        return fused(*a, **kw)  # type: ignore[arg-type]

    runner.fused = spy  # type: ignore[assignment]
    out = engine.generate([[100 + j for j in range(20)], [300 + j for j in range(9)]],
                          SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert [len(o) for o in out] == [6, 6]
    assert calls and set(calls) == {2}  # the prefill step took the per-op path, every decode step this one
    ids = torch.tensor([runner.spec.vocab], dtype=torch.long)  # a token id past the vocabulary
    one = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="out of range"):
        runner.native.decode_forward(fused.model, ids, one, one, torch.zeros((1, 1), dtype=torch.long), one + 1, 30)
    with pytest.raises(ValueError, match="layout"):
        runner.native.decode_forward(fused.model, one.int(), one, one, torch.zeros((1, 1), dtype=torch.long), one, 30)


def test_bf16_weights_keep_the_per_op_path():
    spec, w = _weights()
    cfg = EngineConfig(model=default_model_path(), dtype="bf16", quantization="none", threads=1, num_kv_blocks=64)
    assert ModelRunner(cfg, spec, w).fused is None
