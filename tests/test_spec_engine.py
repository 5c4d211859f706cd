"""Speculation, batching strategies and policies inside the real engine (bundled SmolLM2, fp32)."""

import json
from dataclasses import replace

import pytest
import torch

from reference_server.config import EngineConfig
from reference_server.engine.engine import Engine
from reference_server.engine.scheduler import ScheduledBatch
from reference_server.engine.sequence import SamplingParams, SeqStatus
from reference_server.model.model_runner import ModelRunner
from reference_server.model_files import default_model_path

CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n"
PROMPTS = [CODE + "Repeat the code above exactly:\n\n" + CODE[:20], "The capital of France is"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def base():
    cfg = EngineConfig(model=default_model_path(), dtype="fp32", num_kv_blocks=256, threads=2)
    return cfg, ModelRunner(cfg)


def engine(base, **kw) -> Engine:
    cfg, runner = base
    runner.kv_caches = runner._allocate_kv(runner.num_blocks)  # a fresh pool per engine
    return Engine(replace(cfg, **kw), runner=runner)


@pytest.fixture(scope="module")
def reference(base):
    eng = engine(base)
    ids = [eng.codec.encode(p) for p in PROMPTS]
    return ids, eng.generate(ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))


@pytest.mark.parametrize("method", ["ngram", "self", "draft"])
def test_greedy_speculation_is_bit_identical(base, reference, method):
    ids, expected = reference
    kw = {"spec": method, "spec_k": 4}
    if method == "draft":
        kw["draft_model"] = str(default_model_path())  # same vocabulary; here the model drafts for itself
    eng = engine(base, **kw)
    out = eng.generate(ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert out == expected
    assert eng.spec is not None and eng.spec.num_drafted > 0
    if method in ("ngram", "draft"):  # copying code / drafting with the model itself gets accepted
        assert eng.spec.num_accepted > 0
    if method == "draft":
        assert eng.spec.num_accepted == eng.spec.num_drafted  # identical draft and target models
    assert eng.block_manager.num_used == 0  # finished requests returned every block


def test_speculation_switches_off_for_large_batches(base, reference):
    ids, expected = reference
    eng = engine(base, spec="ngram", spec_max_batch=1)
    out = eng.generate(ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert out == expected
    assert eng.spec is not None and eng.spec.num_drafted == 0  # two requests decode together: no drafts


def test_sampled_speculation_runs_and_counts(base, reference):
    ids, _ = reference
    eng = engine(base, spec="ngram")
    out = eng.generate(ids[:1], SamplingParams(temperature=0.7, max_tokens=MAX_TOKENS, ignore_eos=True, seed=3))
    assert len(out[0]) == MAX_TOKENS
    assert eng.spec is not None and eng.spec.num_drafted >= eng.spec.num_accepted


@pytest.mark.parametrize("batching", ["static", "dynamic"])
def test_run_to_completion_batching_same_output_and_no_joins(base, reference, batching):
    ids, expected = reference
    eng = engine(base, batching=batching, batch_size=2, batch_max_delay_ms=0, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    seqs = [eng.add_request(i, params) for i in ids]
    late = eng.add_request(ids[1], replace(params, max_tokens=4))
    eng.step()
    assert {s.status for s in seqs} == {SeqStatus.RUNNING} and late.status is SeqStatus.WAITING
    # a whole context slot (max_model_len) is reserved at admission, as a padded batch would
    assert all(len(s.block_table) == 256 // eng.config.block_size for s in seqs)
    short = eng.add_request(ids[0], replace(params, max_tokens=2))  # joins the second batch with `late`
    while any(s.status is not SeqStatus.FINISHED for s in seqs):
        assert late.status is SeqStatus.WAITING  # nobody joins a running batch
        eng.step()
    assert [s.output_token_ids for s in seqs] == expected
    while short.status is not SeqStatus.FINISHED:
        eng.step()
    # the finished member stays in the batch as a padding row, holding its slot, until `late` finishes
    assert eng.scheduler.padding == [short] and eng.iterations[-1].padding_tokens == 0
    bm = eng.block_manager
    while late.status is not SeqStatus.FINISHED:
        eng.step()
        assert bm.num_free + bm.num_used == bm.num_blocks
    assert [r.padding_tokens for r in eng.iterations][-2:] == [1, 1]  # late: 4 tokens, short: 2
    assert late.output_token_ids == expected[1][:4] and short.output_token_ids == expected[0][:2]
    assert eng.scheduler.padding == [] and bm.num_used == 0  # the batch ended: every slot is free


def test_priority_preempts_lower_priority_when_full(base, reference):
    ids, _ = reference
    eng = engine(base, policy="priority", max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    low = eng.add_request(ids[1], params, priority=0)
    eng.step()
    assert low.status is SeqStatus.RUNNING
    high = eng.add_request(ids[1], params, priority=5)
    eng.step()
    assert high.status is SeqStatus.RUNNING and low.status is SeqStatus.WAITING and low.num_preemptions == 1
    while high.status is not SeqStatus.FINISHED:
        eng.step()
    while low.status is not SeqStatus.FINISHED:
        eng.step()
    assert low.output_token_ids == high.output_token_ids  # recompute after preemption changes nothing


def test_sjf_admits_the_shorter_job_first(base, reference):
    ids, _ = reference
    eng = engine(base, policy="sjf", max_num_seqs=1)
    long = eng.add_request(ids[1], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    short = eng.add_request(ids[1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    eng.step()
    assert short.status is SeqStatus.RUNNING and long.status is SeqStatus.WAITING


def test_bad_settings_are_rejected(base):
    with pytest.raises(ValueError, match="batching"):
        engine(base, batching="sometimes")
    with pytest.raises(ValueError, match="policy"):
        engine(base, policy="random")
    with pytest.raises(ValueError, match="speculation"):
        engine(base, spec="magic")


def test_spec_counters_in_usage_and_metrics(base, live_server):
    import httpx

    with live_server(engine(base, spec="ngram")) as srv:
        body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as resp:
            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        usage = json.loads(events[-2])["usage"]["spec_decode"]
        assert usage["draft_tokens"] > 0 and 0 < usage["accepted_tokens"] <= usage["draft_tokens"]
        text = httpx.get(srv.url + "/metrics").text
        assert f"servelab_spec_draft_tokens_total {float(usage['draft_tokens'])}" in text
        assert f"servelab_spec_accepted_tokens_total {float(usage['accepted_tokens'])}" in text


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_verification_rows_match_one_token_steps(quantization):
    """A draft's verification pass (1 + k rows of one request, run as decode rows: native kernels in bf16,
    the one-call native step with int4) gives each row the logits of decoding its token on its own: every
    row sees its context up to itself, no more, no less (rounding aside: other row counts, other kernels)."""
    cfg = EngineConfig(model=default_model_path(), dtype="bf16", num_kv_blocks=64, threads=1,
                       quantization=quantization)
    eng = Engine(cfg)
    ids = eng.codec.encode(PROMPTS[0])
    seq = eng.add_request(ids[:-4], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    eng.step()  # the prompt, and a first token
    seq.token_ids[-1] = ids[-4]  # teacher-forced: the context is the prompt itself
    eng.block_manager.grow(seq, seq.num_tokens + 3)
    seq.spec_token_ids = ids[-3:]
    verify = eng.runner.forward(ScheduledBatch([(seq, 4)]))
    seq.spec_token_ids = []
    single = []
    for tok in ids[-4:]:
        seq.token_ids[-1] = tok
        single.append(eng.runner.forward(ScheduledBatch([(seq, 1)]))[0])
        seq.num_computed_tokens += 1
        seq.token_ids.append(tok)
    single_t = torch.stack(single)
    assert verify.shape == single_t.shape
    assert (verify - single_t).abs().max() < 0.05 * single_t.abs().max(), (verify - single_t).abs().max()
    assert torch.equal(verify.argmax(-1), single_t.argmax(-1))
