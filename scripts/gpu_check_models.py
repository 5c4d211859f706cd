"""``make gpu-check``'s models: seeded weights in Llama shapes, written as GGUF files with the bundled model's
tokenizer, and the tokenizer-only GGUF that travels to the GPU machine."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch


@dataclass(frozen=True)
class Shape:
    """A Llama shape; the vocabulary is the tokenizer's."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int


SHAPES = {
    "smollm2-135m": Shape(30, 576, 9, 3, 1536),
    "llama-1b": Shape(16, 2048, 32, 8, 8192),  # Llama 3.2 1B's layers
    "llama-3b": Shape(28, 3072, 24, 8, 8192),  # Llama 3.2 3B's
    "llama-8b": Shape(32, 4096, 32, 8, 14336),  # Llama 3.1 8B's
    "tiny": Shape(2, 128, 4, 2, 256),  # the rehearsal's stand-ins
    "tiny-wide": Shape(2, 256, 8, 2, 512),
    "tiny-deep": Shape(4, 256, 8, 2, 512),
}
CONTEXT = 8192
ROPE_THETA = 500000.0


def _copy_metadata(src: Path, writer: gguf.GGUFWriter, skip: Callable[[str], bool]) -> int:
    """Every key/value of ``src`` but those ``skip`` names; returns the tokenizer's vocabulary size."""
    reader = gguf.GGUFReader(str(src))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or skip(key):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def _is_model_key(key: str) -> bool:
    return key.startswith("llama.") or key in ("general.file_type", "general.quantization_version", "general.name",
                                              "general.size_label")


def export_tokenizer(src: Path, out: Path) -> None:
    """A GGUF with ``src``'s tokenizer and other non-model metadata and no tensors (a few MB to carry)."""
    writer = gguf.GGUFWriter(str(out), "llama")
    _copy_metadata(src, writer, _is_model_key)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_seeded_gguf(tokenizer: Path, out: Path, name: str, shape: Shape, seed: int, device: str) -> Path:
    """A Llama GGUF (float16) of ``shape`` with seeded weights, drawn on ``device``, and ``tokenizer``'s vocabulary.

    Scales keep a random model well conditioned: each linear keeps its input's scale (std 1/sqrt(fan-in)),
    the residual branches shrink by sqrt(2 * layers), and the embedding (tied output head) gives logits a std
    of about 3, so greedy choices are decided by margins far above float32 rounding."""
    writer = gguf.GGUFWriter(str(out), "llama")
    vocab = _copy_metadata(tokenizer, writer, _is_model_key)
    head_dim = shape.hidden // shape.heads
    writer.add_name(f"seeded {name} (seed {seed})")
    writer.add_block_count(shape.layers)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    gen = torch.Generator(device).manual_seed(seed)
    branch = 1 / math.sqrt(2 * shape.layers)

    def normal(rows: int, cols: int, std: float) -> np.ndarray:
        t = torch.empty(rows, cols, device=device, dtype=torch.float32).normal_(0.0, std, generator=gen)
        return t.to(torch.float16).cpu().numpy()

    ones = np.ones(shape.hidden, dtype=np.float32)
    h, kvd = shape.hidden, shape.kv_heads * head_dim
    writer.add_tensor("token_embd.weight", normal(vocab, h, 3 / math.sqrt(h)))
    for i in range(shape.layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", ones)
        writer.add_tensor(p + "attn_q.weight", normal(h, h, h**-0.5))
        writer.add_tensor(p + "attn_k.weight", normal(kvd, h, h**-0.5))
        writer.add_tensor(p + "attn_v.weight", normal(kvd, h, h**-0.5))
        writer.add_tensor(p + "attn_output.weight", normal(h, h, h**-0.5 * branch))
        writer.add_tensor(p + "ffn_norm.weight", ones)
        writer.add_tensor(p + "ffn_gate.weight", normal(shape.ffn, h, h**-0.5))
        writer.add_tensor(p + "ffn_up.weight", normal(shape.ffn, h, h**-0.5))
        writer.add_tensor(p + "ffn_down.weight", normal(h, shape.ffn, shape.ffn**-0.5 * branch))
    writer.add_tensor("output_norm.weight", ones)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
