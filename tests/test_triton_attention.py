"""The Triton paged-attention kernel (reference_server/kernels/triton_attention.py) against the float32 reference the
native CPU kernel is tested with: decode rows and prefill chunks with prefix hits, block sizes 16/32, GQA
ratios 1/3/8, partial blocks, blocks scattered over the pool. Without a GPU it runs under Triton's
interpreter on CPU tensors (the same kernel source, executed op by op); with one, compiled on CUDA."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported: the interpreter is chosen at @triton.jit time
    os.environ["TRITON_INTERPRET"] = "1"

from test_native_kernels import BF16_ULP, dense_attention

from reference_server.kernels.triton_attention import paged_attention
from reference_server.model.cuda_graphs import DecodeGraphs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(kvh: int, heads: int, d: int, bs: int, chunks: list[tuple[int, int]], seed: int):
    """Caches, tables and queries for sequences given as (context length, new tokens at its end)."""
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-ctx // bs) for ctx, _ in chunks) + 7
    k_cache = torch.randn(kvh, nb, bs, d, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(kvh, nb, bs, d, generator=g).to(torch.bfloat16)
    width = max(-(-ctx // bs) for ctx, _ in chunks)
    perm = torch.randperm(nb, generator=g)  # blocks scattered over the pool, none shared
    tables = torch.zeros(len(chunks), width, dtype=torch.int64)
    used = 0
    for i, (ctx, _) in enumerate(chunks):
        k = -(-ctx // bs)
        tables[i, :k] = perm[used : used + k]
        used += k
    t = sum(n for _, n in chunks)
    # q as the model hands it over: a strided view of the fused QKV rows, scaled by 1/sqrt(d)
    qkv = (torch.randn(t, (heads + 2 * kvh) * d, generator=g) * d**-0.5).to(torch.bfloat16)
    return k_cache, v_cache, tables, qkv[:, : heads * d].view(t, heads, d)


def _reference(q, k_cache, v_cache, tables, chunks) -> torch.Tensor:
    """Each new token as a decode query over the keys up to its own position (causal within its chunk)."""
    seq_of, lens = [], []
    for i, (ctx, n) in enumerate(chunks):
        seq_of += [i] * n
        lens += range(ctx - n + 1, ctx + 1)
    return dense_attention(q, k_cache, v_cache, tables[seq_of], torch.tensor(lens))


def _run(q, k_cache, v_cache, tables, chunks) -> torch.Tensor:
    dev = DEVICE
    n_new = torch.tensor([n for _, n in chunks], dtype=torch.int32)
    starts = torch.cumsum(n_new, 0, dtype=torch.int32) - n_new
    out = paged_attention(q.to(dev), k_cache.to(dev), v_cache.to(dev), tables.to(dev, torch.int32), starts.to(dev),
                          n_new.to(dev), torch.tensor([c for c, _ in chunks], dtype=torch.int32, device=dev),
                          max(n for _, n in chunks))
    return out.cpu()


# GQA 1 (4/4), 3 (9/3: SmolLM2's shape), 8 (16/2); head dims 64 and 32
SHAPES = [(4, 4, 64), (3, 9, 64), (2, 16, 32)]


@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize(("kvh", "heads", "d"), SHAPES)
def test_decode_matches_float32(kvh, heads, d, bs):
    # one token, a partial first block, exactly one block, one past it, many blocks with a partial last one
    chunks = [(1, 1), (bs - 1, 1), (bs, 1), (bs + 1, 1), (5 * bs + 3, 1)]
    k_cache, v_cache, tables, q = _case(kvh, heads, d, bs, chunks, seed=kvh * 100 + d + bs)
    got = _run(q, k_cache, v_cache, tables, chunks)
    want = _reference(q, k_cache, v_cache, tables, chunks)
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=BF16_ULP)
    assert (got.float() - want).abs().mean() < 2e-3
    # a single-token context is that token's value exactly (up to rounding)
    torch.testing.assert_close(got[0].float(), v_cache[:, tables[0, 0], 0].float().repeat_interleave(heads // kvh, 0))


@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize(("kvh", "heads", "d"), SHAPES)
def test_chunked_prefill_with_prefix_hits_matches_float32(kvh, heads, d, bs):
    """A step mixing prefill chunks and decode rows: a whole prompt, a chunk after a cached prefix of whole
    blocks (a prefix hit), a chunk starting mid-block (chunked prefill), a one-token tail, decode rows."""
    chunks = [(bs + 5, bs + 5), (3 * bs + 7, bs + 7), (2 * bs + 9, 20), (2 * bs, 1), (bs + 2, 2), (7, 1)]
    k_cache, v_cache, tables, q = _case(kvh, heads, d, bs, chunks, seed=kvh * 10 + d + bs + 1)
    got = _run(q, k_cache, v_cache, tables, chunks)
    want = _reference(q, k_cache, v_cache, tables, chunks)
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=BF16_ULP)
    assert (got.float() - want).abs().mean() < 2e-3


def test_rejects_layouts_it_cannot_read():
    cache = torch.zeros(3, 8, 8, 64, dtype=torch.bfloat16)  # block size 8: below tl.dot's 16
    q = torch.zeros(2, 9, 64, dtype=torch.bfloat16)
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="block size"):
        paged_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32), one * 0, one, one, 1)


def test_engine_with_the_kernel_matches_the_torch_path():
    """The kernel wired into the model (PagedBatch metadata from the model runner, every attention row through
    it): chunked prefill (a chunk ending mid-block), decode steps, then a prompt that hits two cached blocks,
    give the tokens of the PyTorch path and logits within float32 rounding of them. Decode steps go through
    the CUDA-graph buffers (static inputs, bucket of 2 for one sequence: a padding row on the scratch block),
    replayed eagerly here."""
    if DEVICE == "cpu":
        assert os.environ.get("TRITON_INTERPRET") == "1"
    from test_reference_engine import _codec, capture_logits, make_engine

    from reference_server.engine.sequence import SamplingParams

    kw = {"enable_prefix_caching": True, "max_num_batched_tokens": 24, "num_kv_blocks": 64, "device": DEVICE}
    paged, torch_ops = make_engine(kernels="triton", **kw), make_engine(kernels="torch", **kw)
    assert paged.runner.kernels == "triton" and paged.runner.paged is paged_attention
    runner = paged.runner
    runner.kv_caches = runner._allocate_kv(runner.num_blocks + 1)  # + the scratch block, as with graphs on CUDA
    runner.graphs = DecodeGraphs(lambda i, p, a, r: runner.model(i, p, runner.kv_caches, a, r), [2, 4],
                                 -(-runner.max_model_len // runner.block_size), runner.num_blocks,
                                 runner.block_size, runner.device, capture=False)
    got_logits, want_logits = capture_logits(paged), capture_logits(torch_ops)
    ids = _codec().encode("The quick brown fox jumps over the lazy dog, and then it runs into the forest to "
                          "find the other foxes of its family, who are waiting by the old oak tree")[:40]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for engine in (paged, torch_ops):
        engine.generate([ids], params)
        engine.generate([ids[:36] + ids[:5]], params)  # the first 32 tokens (two blocks) are cached
    assert paged.block_manager.prefix_hits == 32 == torch_ops.block_manager.prefix_hits
    assert len(got_logits) == len(want_logits) >= 6
    assert runner.graphs.num_replays == 4  # two decode steps per request
    for (rows_a, a), (rows_b, b) in zip(got_logits, want_logits, strict=True):
        assert rows_a == rows_b  # same tokens fed, step after step: the greedy outputs agree
        torch.testing.assert_close(a.cpu(), b.cpu(), atol=2e-3, rtol=1e-3)
