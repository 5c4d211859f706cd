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
