"""Logits of the reference model vs an independent implementation: transformers loading the same GGUF."""

from __future__ import annotations

import pytest
import torch
import transformers

from reference_server.config import EngineConfig
from reference_server.engine.engine import Engine
from reference_server.engine.sequence import SamplingParams, Sequence
from reference_server.model_files import default_model_path


@pytest.mark.slow
def test_logits_match_transformers_fp32():
    path = default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    engine = Engine(EngineConfig(model=path, dtype="fp32", threads=1, num_kv_blocks=64))
    ids = engine.codec.encode("<|im_start|>user\nName three colours of the rainbow.<|im_end|>\n<|im_start|>assistant\n")
    seq = Sequence(ids, SamplingParams(temperature=0.0))
    engine.scheduler.add(seq)
    ours = engine.runner.forward(engine.scheduler.schedule())[0]
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0, -1].float()
    assert ours.argmax() == theirs.argmax()
    torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("rows", [1, 3, 16, 200])
def test_float32_linear_on_cpu_is_packed_and_agrees_with_the_plain_matmul(rows: int):
    """The float32 weights are held in oneDNN's blocked layout (decode steps 1.5-1.9x faster on an AVX2 CPU); only the
    summation order may differ from ``x @ W.T`` (+ residual in the epilogue)."""
    from reference_server.model.model import Linear

    g = torch.Generator().manual_seed(rows)
    w = torch.randn(1536, 576, generator=g) * 0.05
    x, res = torch.randn(rows, 576, generator=g), torch.randn(rows, 1536, generator=g)
    layer = Linear(w.clone())
    assert layer.packed == torch.backends.mkldnn.is_available()
    torch.testing.assert_close(layer(x), x @ w.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x, res), res + x @ w.T, rtol=1e-5, atol=1e-5)
