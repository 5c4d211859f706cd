"""Reference engine correctness: paged/chunked/prefix-cached forward vs dense recompute, greedy invariance
across scheduling configurations and preemption, block-manager invariants, sampler and detokenizer."""

from __future__ import annotations

import functools

import pytest
import torch

from reference_server.config import EngineConfig
from reference_server.engine.block_manager import BlockManager
from reference_server.engine.engine import Engine
from reference_server.engine.scheduler import ScheduledBatch, Scheduler
from reference_server.engine.sequence import SamplingParams, Sequence
from reference_server.model.gguf_loader import load_gguf
from reference_server.model.model_runner import ModelRunner
from reference_server.model.text import Detokenizer, TextCodec
from reference_server.model_files import default_model_path


@functools.lru_cache(maxsize=1)
def _weights() -> tuple:
    return load_gguf(default_model_path())


@functools.lru_cache(maxsize=1)
def _codec() -> TextCodec:
    return TextCodec(default_model_path())


def make_engine(**kw: object) -> Engine:
    spec, w = _weights()
    # one thread: correctness only, and robust when other processes load the cores
    cfg = EngineConfig(model=default_model_path(), dtype="fp32", threads=1, **kw)  # type: ignore[arg-type]
    return Engine(cfg, ModelRunner(cfg, spec, w), _codec())


def check_invariants(engine: Engine) -> None:
    bm = engine.block_manager
    assert bm.num_free + bm.num_used == bm.num_blocks
    live = engine.scheduler.running
    refs = [0] * bm.num_blocks
    for seq in live:
        for b in seq.block_table:
            refs[b] += 1
        assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens
    for block in bm.blocks:
        assert block.ref_count == refs[block.block_id], block
        assert (block.ref_count == 0) == (block.block_id in bm.free)


def capture_logits(engine: Engine) -> list[tuple[list[list[int]], torch.Tensor]]:
    """Wrap ``engine.runner.forward``; the returned list fills with (token ids of each row that got
    logits, those logits) per step."""
    captured: list[tuple[list[list[int]], torch.Tensor]] = []
    forward = engine.runner.forward

    def spy(batch: ScheduledBatch, *a: object, **kw: object) -> torch.Tensor:
        rows = [list(s.token_ids) for s, n in batch.items if s.num_computed_tokens + n == s.num_tokens]
        out = forward(batch, *a, **kw)
        captured.append((rows, out))
        return out

    engine.runner.forward = spy  # type: ignore[method-assign]
    return captured


def dense_position_logits(dense: Engine, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V] float32: row i the logits after ``tokens[: i + 1]``, by one fresh forward over the
    whole sequence (every row sent to the head); frees its blocks."""
    seq = Sequence(tokens, SamplingParams(temperature=0.0, max_tokens=1))
    dense.scheduler.add(seq)
    runner = dense.runner
    with torch.inference_mode():
        ids, pos, attn, _ = runner.prepare(dense.scheduler.schedule())
        want = runner.model(ids, pos, runner.kv_caches, attn, torch.arange(len(tokens), device=runner.device))
    dense.scheduler.finish(seq, "abort")
    return want


def dense_logits(dense: Engine, tokens: list[int]) -> torch.Tensor:
    """Last-position logits of ``tokens`` (:func:`dense_position_logits`)."""
    return dense_position_logits(dense, tokens)[-1]


PROMPTS = [
    "<|im_start|>user\nWrite one sentence about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite one sentence about the sea and the sky.<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11",
]


def run_greedy(engine: Engine, max_tokens: int = 24) -> list[list[int]]:
    codec = _codec()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seqs = [engine.add_request(codec.encode(p), params) for p in PROMPTS]
    # a late arrival joins a running batch (mixed prefill + decode) and shares the first prompt's prefix
    steps = 0
    late = None
    while any(s.finish_reason is None for s in seqs) or late is None or late.finish_reason is None:
        engine.step()
        check_invariants(engine)
        steps += 1
        if steps == 3:
            late = engine.add_request(codec.encode(PROMPTS[0]), params)
    assert late is not None
    return [s.output_token_ids for s in seqs] + [late.output_token_ids]


@pytest.fixture(scope="module")
def baseline() -> list[list[int]]:
    return run_greedy(make_engine(enable_prefix_caching=False, enable_chunked_prefill=False, num_kv_blocks=256))


def test_greedy_same_with_prefix_cache_and_chunked_prefill(baseline):
    engine = make_engine(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=13,
                         block_size=4, num_kv_blocks=512)
    assert run_greedy(engine) == baseline
    assert engine.block_manager.prefix_hits > 0  # the late request hit the cached prefix
    assert max(r.prefill_tokens + r.decode_tokens for r in engine.iterations) <= 13
    assert any(r.prefill_tokens and r.decode_tokens for r in engine.iterations)  # mixed steps happened
    assert engine.block_manager.num_used == 0


def test_greedy_same_under_preemption(baseline):
    # 5 requests of 14-35 prompt + 24 output tokens need ~60 blocks of 4; a pool of 24 forces preemption
    engine = make_engine(enable_prefix_caching=True, block_size=4, num_kv_blocks=24, max_num_batched_tokens=64)
    assert run_greedy(engine) == baseline
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_used == 0


def test_paged_chunked_prefix_forward_equals_dense_recompute():
    """Logits of every sampled row of a chunked, prefix-cached, mixed batch == a fresh dense forward."""
    engine = make_engine(block_size=4, num_kv_blocks=128, max_num_batched_tokens=9)
    dense = make_engine(num_kv_blocks=64, max_num_batched_tokens=4096, enable_prefix_caching=False)
    captured = capture_logits(engine)
    codec = _codec()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = engine.add_request(codec.encode(PROMPTS[0]), params)
    engine.step()
    second = engine.add_request(codec.encode(PROMPTS[1]), params)  # shares the chat prefix
    while first.finish_reason is None or second.finish_reason is None:
        engine.step()
    assert second.num_cached_tokens > 0
    checked = 0
    for rows, logits in captured:
        for tokens, got in zip(rows, logits, strict=True):
            torch.testing.assert_close(got, dense_logits(dense, tokens), atol=2e-4, rtol=1e-4)
            checked += 1
            assert dense.block_manager.num_used == 0
    assert checked >= 12


def test_block_manager_prefix_cache_lru_and_refcounts():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = Sequence([1, 2, 3, 4, 5], SamplingParams())
    assert bm.match_prefix(a) == []
    bm.admit(a, [])
    bm.grow(a, 5)
    a.num_computed_tokens = 5
    bm.commit(a)
    assert len(a.block_table) == 3 and bm.num_used == 3
    b = Sequence([1, 2, 3, 4, 9, 9], SamplingParams())
    hits = bm.match_prefix(b)
    assert hits == a.block_table[:2]
    bm.admit(b, hits)
    assert b.num_computed_tokens == 4 and bm.blocks[hits[0]].ref_count == 2
    bm.release(a)
    assert bm.num_used == 2 and bm.num_free + bm.num_used == bm.num_blocks
    bm.release(b)
    assert bm.num_free == 6
    # freed blocks keep their hashes: a new identical prompt hits them without recomputing
    c = Sequence([1, 2, 3, 4, 7], SamplingParams())
    assert bm.match_prefix(c) == hits
    # allocating everything evicts cached blocks (oldest first) and drops their hashes
    d = Sequence(list(range(100, 112)), SamplingParams())
    bm.admit(d, [])
    bm.grow(d, 12)
    assert bm.num_free == 0 and bm.match_prefix(c) == []


def test_abort_frees_blocks_at_once():
    engine = make_engine(num_kv_blocks=64, block_size=4)
    free0 = engine.block_manager.num_free
    seq = engine.add_request(_codec().encode(PROMPTS[2]), SamplingParams(temperature=0.0, max_tokens=50))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free < free0
    engine.abort(seq.seq_id)
    engine.step()
    assert engine.block_manager.num_free == free0 and not engine.scheduler.has_work()
    assert seq.finish_reason == "abort"


def test_scheduler_token_budget_and_max_seqs():
    bm = BlockManager(num_blocks=100, block_size=4)
    sch = Scheduler(bm, max_num_batched_tokens=10, max_num_seqs=2, max_model_len=400)
    seqs = [Sequence(list(range(1, 8)), SamplingParams()) for _ in range(3)]
    for s in seqs:
        sch.add(s)
    batch = sch.schedule()
    assert [(s.seq_id, n) for s, n in batch.items] == [(seqs[0].seq_id, 7), (seqs[1].seq_id, 3)]  # chunked
    sch.advance(batch)
    seqs[0].token_ids.append(42)  # the first prompt finished: it sampled a token, a gap of 1 to decode
    batch = sch.schedule()  # the max_num_seqs cap keeps the third waiting
    assert [n for _, n in batch.items] == [1, 4] and len(sch.waiting) == 1


def test_sampler_seed_topk_topp():
    engine = make_engine(num_kv_blocks=64)
    prompt = _codec().encode("Once upon a time")
    sampled = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    a, b = engine.generate([prompt, prompt], sampled)
    assert a == b  # same seed, same tokens (also when batched together)
    (c,) = engine.generate([prompt], SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True))
    assert c != a
    greedy = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert engine.generate([prompt], SamplingParams(temperature=0.8, top_k=1, seed=5, max_tokens=8, ignore_eos=True)) == greedy
    assert engine.generate([prompt], SamplingParams(temperature=0.8, top_p=1e-6, seed=5, max_tokens=8, ignore_eos=True)) == greedy
    # a top_p that float32 rounds to 0 (schemathesis sent 5e-324) keeps the top token, not none (NaN, a 500)
    assert engine.generate([prompt], SamplingParams(temperature=0.8, top_p=5e-324, seed=5, max_tokens=8, ignore_eos=True)) == greedy


def test_chat_template_and_special_tokens():
    codec = _codec()
    im_start = codec.tokenizer.token_to_id("<|im_start|>")
    assert codec.encode("<|im_start|>") == [im_start]
    text = codec.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert codec.tokenizer.token_to_id("<|im_end|>") in codec.stop_ids


def test_detokenizer_utf8_and_stop_strings():
    codec = _codec()
    text = "naïve café 🙂 done. END here"
    ids = codec.encode(text)
    d = Detokenizer(codec.tokenizer)
    pieces = [d.add(t) for t in ids]
    assert "".join(pieces) + d.flush() == text
    assert all("\ufffd" not in p for p in pieces)  # never half a character
    d = Detokenizer(codec.tokenizer, stop=["END"])
    out = ""
    for t in ids:
        out += d.add(t)
        if d.stopped:
            break
    out += d.flush()
    assert d.stopped and out == "naïve café 🙂 done. "
