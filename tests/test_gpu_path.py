"""The reference server's GPU code path, the parts a CPU machine can check: every tensor of a model built for
another device lands on it (``meta`` stands in for ``cuda``: same code path, no memory), the per-step
metadata follows, CUDA-graph bucket selection, and the KV pool's sizing arithmetic."""

from __future__ import annotations

import pytest
import torch
from test_reference_engine import _codec, _weights

from reference_server.config import DEFAULT_CPU_KV_BLOCKS, EngineConfig
from reference_server.engine.engine import Engine
from reference_server.engine.scheduler import ScheduledBatch
from reference_server.engine.sequence import SamplingParams, Sequence
from reference_server.model.cuda_graphs import MAX_GRAPH_BATCH, graph_buckets, pick_bucket
from reference_server.model.kv_cache import block_bytes as kv_block_bytes
from reference_server.model.model_runner import ModelRunner, kv_blocks_for_memory
from reference_server.model_files import default_model_path


def _tensors(obj: object, name: str, seen: set[int]):
    """(name, tensor) for every tensor reachable from ``obj``: module parameters and buffers, and plain
    attributes holding tensors, lists/tuples/dicts of them, or further modules and objects of this package."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield name, obj
    elif isinstance(obj, torch.nn.Module):
        for n, t in obj.named_parameters(recurse=False):
            yield f"{name}.{n}", t
        for n, t in obj.named_buffers(recurse=False):
            yield f"{name}.{n}", t
        for n, child in obj.named_children():
            yield from _tensors(child, f"{name}.{n}", seen)
        for n, v in vars(obj).items():
            if not n.startswith("_"):
                yield from _tensors(v, f"{name}.{n}", seen)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{name}[{i}]", seen)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{name}[{k!r}]", seen)
    elif type(obj).__module__.startswith("reference_server") and hasattr(obj, "__dict__"):
        for n, v in vars(obj).items():
            yield from _tensors(v, f"{name}.{n}", seen)


def _meta_runner(**kw) -> ModelRunner:
    spec, w = _weights()
    return ModelRunner(EngineConfig(model=default_model_path(), device="meta", dtype="bf16", **kw), spec, w)


def test_every_tensor_of_a_model_built_for_another_device_is_on_it():
    runner = _meta_runner()
    found = list(_tensors(runner, "runner", set()))
    names = {n for n, _ in found}
    # the walk sees what matters: weights of every kind, the RoPE tables, the KV cache
    for expected in ("runner.model.embed", "runner.model.lm_head.weight", "runner.model.layers.0.qkv.weight",
                     "runner.model.layers.29.down.weight", "runner.model.norm.weight", "runner.model.rope_cos",
                     "runner.kv_caches[29][1]"):
        assert expected in names
    elsewhere = [(n, str(t.device)) for n, t in found if t.device.type != "meta"]
    assert not elsewhere, f"tensors left off the device: {elsewhere[:10]}"
    assert all(t.dtype == torch.bfloat16 for n, t in found if "model." in n)
    assert runner.kernels.startswith("torch") and runner.native is None  # no oneDNN prepacking, no CPU kernels
    assert not any(getattr(m, "packed", False) for m in runner.model.modules())
    assert runner.num_blocks == DEFAULT_CPU_KV_BLOCKS  # sized from memory only on CUDA


def test_a_step_on_another_device_keeps_its_tensors_there():
    """prepare() builds the step's metadata on the device, for the PyTorch path and the paged-kernel path;
    the forward runs there (on ``meta``: shapes only) and returns logits there."""
    runner = _meta_runner(block_size=16)
    prompt, decoding = Sequence(list(range(40)), SamplingParams()), Sequence(list(range(20)), SamplingParams())
    prompt.block_table, decoding.block_table = [3, 4, 5], [7, 8]
    prompt.num_computed_tokens, decoding.num_computed_tokens = 16, 19  # a prefix hit, then a decode row
    batch = ScheduledBatch([(prompt, 24), (decoding, 1)])
    ids, pos, attn, rows = runner.prepare(batch)
    placed = [t for _, t in _tensors([ids, pos, attn], "step", set())]
    assert placed and all(t.device.type == "meta" for t in placed)
    logits = runner.forward(batch)
    assert logits.device.type == "meta" and logits.shape == (2, runner.spec.vocab) and logits.dtype == torch.float32

    from reference_server.kernels.triton_attention import paged_attention

    runner.paged = paged_attention  # the CUDA path's metadata: one row per sequence, int32, on the device
    ids, pos, attn, rows = runner.prepare(batch)
    assert attn.paged is not None and attn.prefills == [] and attn.decode_rows is None
    placed = [t for _, t in _tensors(attn.paged, "paged", set())]
    assert len(placed) == 4 and all(t.device.type == "meta" and t.dtype == torch.int32 for t in placed)
    assert attn.paged.tables.shape == (2, 3) and attn.paged.max_new == 24 and rows == [23, 24]


def test_graph_buckets_and_their_selection():
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_buckets(1) == [1]
    assert graph_buckets(5) == [1, 2, 4, 5]
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_buckets(10_000)[-1] == MAX_GRAPH_BATCH
    buckets = graph_buckets(256)
    assert [pick_bucket(buckets, n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 200, 256)] == [1, 2, 4, 8, 8, 16, 16, 32, 208, 256]
    assert pick_bucket(buckets, 257) is None  # larger batches run eagerly
    for n in range(1, 257):  # the padding never exceeds 15 rows
        assert 0 <= pick_bucket(buckets, n) - n < 16


def test_kv_pool_sizing_arithmetic():
    spec, _ = _weights()
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims, K and V: 23040 bytes per token in bf16
    assert kv_block_bytes(spec, 16, torch.bfloat16) == 16 * 2 * 30 * 3 * 64 * 2
    assert kv_block_bytes(spec, 32, torch.float32) == 2 * kv_block_bytes(spec, 16, torch.bfloat16) * 2
    gib = 2**30
    block = kv_block_bytes(spec, 16, torch.bfloat16)
    # an 80 GiB GPU at 0.9 with 1.5 GiB used (weights + context) and a 0.5 GiB step peak
    blocks = kv_blocks_for_memory(80 * gib, int(1.5 * gib), gib // 2, 0.9, block)
    assert blocks == (int(80 * gib * 0.9) - int(1.5 * gib) - gib // 2) // block
    assert blocks * 16 > 3_000_000  # millions of tokens: max_model_len is no longer what the pool caps
    assert kv_blocks_for_memory(80 * gib, 79 * gib, gib, 0.9, block) == 0  # nothing left: none, not negative
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(model=default_model_path(), gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        EngineConfig(model=default_model_path(), num_kv_blocks=0)


def test_max_model_len_follows_the_pool_not_a_fixed_count():
    spec, w = _weights()
    cfg = EngineConfig(model=default_model_path(), dtype="fp32", threads=1, num_kv_blocks=64)
    small = Engine(cfg, ModelRunner(cfg, spec, w), _codec())
    assert small.max_model_len == 64 * 16 and small.block_manager.num_blocks == 64
    cfg = EngineConfig(model=default_model_path(), dtype="fp32", threads=1)
    default = Engine(cfg, ModelRunner(cfg, spec, w), _codec())
    assert default.block_manager.num_blocks == DEFAULT_CPU_KV_BLOCKS
    assert default.max_model_len == spec.context_length  # the model's own limit, not the pool's
