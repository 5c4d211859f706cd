"""The accuracy cost of a configuration against the float32 model, on a fixed text.

``python -m reference_server.tools.accuracy --quantization int4`` (or ``--kv-cache-dtype int8``, or both) prints
one JSON object:

* ``top1_agreement``: teacher-forced, the share of positions of the text where the configuration's most
  likely next token is the float32 model's;
* ``mean_logit_error``: the mean |logit - float32 logit| over those positions and the whole vocabulary;
* ``greedy_identical``: the share of prompts whose greedy continuation is token for token the float32 one.

Each position is scored by a request for the text up to it: with prefix caching only its last block is
computed, so the rows go through the decode-size kernels as in serving, and they attend to a cache that
earlier requests wrote (quantised, with an int8 KV cache, block by block as in serving)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from reference_server.config import KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig
from reference_server.engine.engine import Engine
from reference_server.engine.scheduler import ScheduledBatch
from reference_server.engine.sequence import SamplingParams
from reference_server.model.kv_cache import kv_dtype_name
from reference_server.model_files import default_model_path

TEXT = ("The history of the lighthouse begins in the ancient world, when fires were lit on hilltops to guide "
        "ships into harbour. The most famous was the Pharos of Alexandria, built in the third century BC, which "
        "stood for more than a thousand years. Modern lighthouses use a lens to focus the light into a beam "
        "that can be seen from many miles away, and each one flashes in its own pattern so that sailors can "
        "tell them apart at night.")
PROMPTS = ["<|im_start|>user\nWrite one sentence about the sea.<|im_end|>\n<|im_start|>assistant\n",
           "def fibonacci(n):\n    ", "The capital of France is", "1, 2, 3, 4, 5, 6, 7,"]  # fmt: skip


def _position_logits(engine: Engine, tokens: list[int]) -> torch.Tensor:
    """[len(tokens) - 1, V] float32: the logits after each prefix tokens[:i], i = 1..len - 1."""
    captured: list[torch.Tensor] = []
    forward = engine.runner.forward

    def spy(batch: ScheduledBatch, *a: object, **kw: object) -> torch.Tensor:
        out = forward(batch, *a, **kw)
        captured.append(out)
        return out

    engine.runner.forward = spy  # type: ignore[method-assign]
    rows = []
    for i in range(1, len(tokens)):
        captured.clear()
        seq = engine.add_request(tokens[:i], SamplingParams(temperature=0.0, max_tokens=1))
        while seq.finish_reason is None:
            engine.step()
        rows.append(captured[-1][-1])
    engine.runner.forward = forward  # type: ignore[method-assign]
    return torch.stack(rows)


def _greedy(engine: Engine, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seqs = [engine.add_request(engine.codec.encode(p), params) for p in PROMPTS]
    while any(s.finish_reason is None for s in seqs):
        engine.step()
    return [s.token_ids[s.num_prompt_tokens :] for s in seqs]


def measure(config: EngineConfig, max_tokens: int = 32) -> dict[str, float | str]:
    """Score ``config`` against the float32 model (PyTorch ops, unquantised weights and KV cache) of the same
    GGUF."""
    ref = Engine(replace(config, dtype="fp32", kernels="torch", quantization="none", kv_cache_dtype="auto"))
    engine = Engine(config)
    tokens = engine.codec.encode(TEXT)
    want, got = _position_logits(ref, tokens), _position_logits(engine, tokens)
    greedy_ref, greedy = _greedy(ref, max_tokens), _greedy(engine, max_tokens)
    return {
        "weights": engine.runner.quantization_note,
        "kv_cache": kv_dtype_name(engine.runner.kv_dtype),
        "positions": len(tokens) - 1,
        "top1_agreement": (want.argmax(-1) == got.argmax(-1)).float().mean().item(),
        "mean_logit_error": (want - got).abs().mean().item(),
        "greedy_identical": sum(a == b for a, b in zip(greedy_ref, greedy, strict=True)) / len(PROMPTS),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m reference_server.tools.accuracy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="Llama GGUF (default: the bundled SmolLM2-135M)")
    p.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                   help="weight quantisation to score (default: none)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV cache storage to score (default: auto, the model's dtype)")
    p.add_argument("--dtype", default="auto", help="model dtype to score (default: auto)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: as the server)")
    args = p.parse_args(argv)
    config = EngineConfig(model=args.model or default_model_path(), dtype=args.dtype, threads=args.threads,
                          quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, num_kv_blocks=256)
    print(json.dumps(measure(config)))


if __name__ == "__main__":
    main()
