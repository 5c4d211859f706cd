"""KV-cache budget: how many tokens and concurrent requests fit in the memory left after the weights.

The arithmetic behind "an 80 GB GPU holding a 40 GB model": every token of every request keeps one key
and one value vector per layer and per KV head, so

    bytes_per_token = 2 * layers * kv_heads * head_dim * dtype_bytes
    max_tokens      = (memory * utilization - weights) // bytes_per_token

A paged cache allocates whole blocks, so a request of ``L`` tokens holds ``ceil(L / block) * block``
slots. A quantised cache may also keep scales: int8 here is the bundled reference server's layout
(``--kv-cache-dtype int8``), one float32 scale per KV head and block for K and for V, i.e.
``4 / (block * head_dim)`` more bytes per element; fp8 is counted with per-tensor scales (vLLM's), none. Without GQA every query head has its own KV head (``kv_heads = heads``). With prefix sharing the
full blocks of a common prefix are stored once and referenced by every request. The command, ``bench
kv-budget``, and its tables are :mod:`loadgen.cli.kvbudget`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from reference_server.model_files import attention_shape

DTYPE_BYTES: dict[str, float] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1, "int4": 0.5}
SCALE_BYTES: dict[str, int] = {"int8": 4}  # per KV head and block, for K and for V (see the module docstring)
KV_CHOICES = ("bf16", "fp8", "int8")  # the KV cache dtypes compared side by side (--kv-cache-dtype's)
DEFAULT_CONTEXTS = (512, 2048, 4096, 8192, 32768, 131072)

_UNITS = {
    "": 1e9,  # a bare number means GB
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "k": 1e3,
    "m": 1e6,
    "g": 1e9,
    "t": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """``"80GB"``, ``"40 GiB"``, ``"512MiB"``, ``"80"`` (GB) -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise ValueError(f"cannot read size {text!r}: use e.g. 80GB, 40GiB, 512MiB or a bare number of GB")
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a model that decide its KV footprint."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    name: str = "model"

    def __post_init__(self) -> None:
        for field_name in ("layers", "heads", "kv_heads", "head_dim"):
            if getattr(self, field_name) < 1:
                raise ValueError(f"{field_name} must be >= 1, got {getattr(self, field_name)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")


def shape_from_gguf(path: Path) -> tuple[ModelShape, int]:
    """Model shape and tensor-data size in bytes (the weights as stored) read from GGUF metadata."""
    from gguf import GGUFReader

    if not path.is_file():
        raise ValueError(f"GGUF file not found: {path}")
    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # gguf raises bare ValueError/struct errors on non-GGUF input
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc

    def field(key: str) -> object | None:
        f = reader.fields.get(key)
        return f.contents() if f is not None else None

    try:
        att = attention_shape(field)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    shape = ModelShape(layers=att.layers, heads=att.heads, kv_heads=att.kv_heads, head_dim=att.head_dim,
                       name=str(field("general.name") or path.stem))  # fmt: skip
    weight_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    return shape, weight_bytes


def bytes_per_token(shape: ModelShape, dtype_bytes: float, gqa: bool = True) -> float:
    kv_heads = shape.kv_heads if gqa else shape.heads
    return 2 * shape.layers * kv_heads * shape.head_dim * dtype_bytes


@dataclass
class BudgetRow:
    context: int
    concurrent: int  # with GQA (the model as it is)
    concurrent_no_gqa: int  # as if kv_heads == heads
    concurrent_shared_prefix: int  # with GQA and the shared prefix stored once


@dataclass
class DtypeRow:
    """One KV cache dtype in the same memory: its footprint and what fits (with GQA)."""

    dtype: str
    bytes_per_token: float
    max_tokens: int
    concurrent: list[int]  # max concurrent requests per context length, in ``KVBudget.rows`` order


@dataclass
class KVBudget:
    model: str
    memory_bytes: int
    weight_bytes: int
    kv_bytes: int
    dtype: str
    block_size: int
    shared_prefix: int
    bytes_per_token: float
    bytes_per_token_no_gqa: float
    max_tokens: int
    max_tokens_no_gqa: int
    rows: list[BudgetRow]
    dtypes: list[DtypeRow]  # the chosen dtype and KV_CHOICES, the same memory each


def _blocks(tokens: int, block: int) -> int:
    return math.ceil(tokens / block)


def element_bytes(dtype: str, shape: ModelShape, block_size: int) -> float:
    """Bytes per cached element, the dtype's scales included."""
    return DTYPE_BYTES[dtype] + SCALE_BYTES.get(dtype, 0) / (block_size * shape.head_dim)


def kv_budget(
    shape: ModelShape,
    memory_bytes: int,
    weight_bytes: int,
    dtype: str = "bf16",
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS,
    block_size: int = 16,
    shared_prefix: int = 0,
    utilization: float = 1.0,
) -> KVBudget:
    """The budget table. Token capacities are whole blocks; concurrency is whole requests."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {dtype!r}: choose one of {', '.join(DTYPE_BYTES)}")
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    if block_size < 1 or shared_prefix < 0 or any(c < 1 for c in contexts):
        raise ValueError("block size and context lengths must be >= 1 and the shared prefix >= 0")
    kv_bytes = int(memory_bytes * utilization) - weight_bytes
    if kv_bytes <= 0:
        raise ValueError(
            f"the weights ({weight_bytes / 1e9:.2f} GB) leave no memory for the KV cache out of "
            f"{memory_bytes * utilization / 1e9:.2f} GB: give more memory or a smaller model"
        )
    db = element_bytes(dtype, shape, block_size)
    bpt, bpt_mha = bytes_per_token(shape, db, True), bytes_per_token(shape, db, False)
    blocks = int(kv_bytes // (bpt * block_size))
    blocks_mha = int(kv_bytes // (bpt_mha * block_size))
    dtypes = []
    for name in dict.fromkeys((dtype, *KV_CHOICES)):
        per_token = bytes_per_token(shape, element_bytes(name, shape, block_size), True)
        nblk = int(kv_bytes // (per_token * block_size))
        dtypes.append(DtypeRow(name, per_token, nblk * block_size, [nblk // _blocks(c, block_size) for c in contexts]))
    rows = []
    for ctx in contexts:
        per_req = _blocks(ctx, block_size)
        # only full blocks can be shared, and a request's last block (where it writes) is its own
        shared = min(shared_prefix, ctx - 1) // block_size
        with_prefix = max(0, (blocks - shared) // (per_req - shared))
        rows.append(BudgetRow(ctx, blocks // per_req, blocks_mha // per_req, with_prefix))
    return KVBudget(
        model=shape.name,
        memory_bytes=memory_bytes,
        weight_bytes=weight_bytes,
        kv_bytes=kv_bytes,
        dtype=dtype,
        block_size=block_size,
        shared_prefix=shared_prefix,
        bytes_per_token=bpt,
        bytes_per_token_no_gqa=bpt_mha,
        max_tokens=blocks * block_size,
        max_tokens_no_gqa=blocks_mha * block_size,
        rows=rows,
        dtypes=dtypes,
    )
