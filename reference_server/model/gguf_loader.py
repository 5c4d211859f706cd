"""Read a Llama-architecture GGUF: hyper-parameters plus weights dequantized once to float32 tensors."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from reference_server.model_files import attention_shape


@dataclass(frozen=True)
class ModelSpec:
    """Llama hyper-parameters read from GGUF metadata."""

    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_theta: float
    rms_eps: float
    context_length: int
    bos_id: int | None
    eos_id: int | None


def _field(reader: gguf.GGUFReader, key: str, default: object = None) -> object:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_spec(reader: gguf.GGUFReader) -> ModelSpec:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}: the reference server runs Llama models")
    att = attention_shape(lambda key: _field(reader, key))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    bos, eos = _field(reader, "tokenizer.ggml.bos_token_id"), _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelSpec(
        n_layers=att.layers,
        hidden=att.hidden,
        n_heads=att.heads,
        n_kv_heads=att.kv_heads,
        head_dim=att.head_dim,
        ffn=int(_field(reader, "llama.feed_forward_length")),
        vocab=int(_field(reader, "llama.vocab_size", len(tokens.data))),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        context_length=int(_field(reader, "llama.context_length", 2048)),
        bos_id=None if bos is None else int(bos),
        eos_id=None if eos is None else int(eos),
    )


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation so RoPE can rotate halves (the HF layout)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@functools.lru_cache(maxsize=1)
def gguf_reader(path: Path) -> gguf.GGUFReader:
    """The file's reader (memory-mapped, read-only), made once per process: indexing its fields takes
    seconds (the tokenizer's arrays), and the loader and the quantiser both read the tensors."""
    return gguf.GGUFReader(str(path))


def load_gguf(path: Path) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """Return the spec and all tensors as float32, keyed by GGUF name (``blk.N.attn_q.weight``...)."""
    reader = gguf_reader(path)
    spec = read_spec(reader)
    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape))
        data = data.reshape(shape)
        if t.name.endswith("attn_q.weight"):
            data = unpermute(data, spec.n_heads)
        elif t.name.endswith("attn_k.weight"):
            data = unpermute(data, spec.n_kv_heads)
        weights[t.name] = torch.from_numpy(np.array(data, dtype=np.float32))  # own, writable copy
    return spec, weights
