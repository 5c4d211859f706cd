"""SGLang: native ``/generate`` and its OpenAI endpoints.

Native stream (``python/sglang/srt/entrypoints/http_server.py`` ``generate_request``): each event is
``data: {"text": <all text so far>, "output_ids": [...], "meta_info": {"id", "finish_reason",
"prompt_tokens", "completion_tokens", "cached_tokens", ...}}`` with cumulative ``text`` and
``completion_tokens``; ``finish_reason`` is null until the end, then ``{"type": "length"|"stop"|...}``;
the stream ends with ``data: [DONE]``. With speculative decoding ``meta_info`` has ``spec_verify_ct``
(verification steps), so accepted tokens per step = completion_tokens / spec_verify_ct.
``/metrics`` (``--enable-metrics``; ``docs/references/production_metrics.md``) exposes
``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage``, ``sglang:gen_throughput``,
``sglang:prompt_tokens_total``, ``sglang:generation_tokens_total`` and, when speculating,
``sglang:spec_accept_length``; ``sglang:cached_tokens_total`` (labelled ``cache_source``) counts prompt
tokens found in the radix cache. ``POST /flush_cache`` empties that cache.
"""

from __future__ import annotations

from typing import Any, ClassVar

from backends.base import Delta, HttpCall, ParseState, loads_json
from backends.native import NativeBackend
from backends.openai import OpenAIBackend
from backends.profile import PrefixCounters, ServerProfile
from workloads.contracts import GenRequest

SGLANG_PROFILE = ServerProfile(
    iterations_path=None, running=("sglang:num_running_reqs",), waiting=("sglang:num_queue_reqs",),
    kv_usage=("sglang:token_usage",), prefix_cache=PrefixCounters("sglang:cached_tokens_total", "sglang:prompt_tokens_total"),
    reset_cache="/flush_cache",
)  # fmt: skip


class SGLangNativeBackend(NativeBackend):
    """``POST /generate`` with ``stream: true``; deltas from cumulative text and token counts."""

    name: ClassVar[str] = "sglang-native"
    server: ClassVar[ServerProfile] = SGLANG_PROFILE

    def build(self, req: GenRequest) -> HttpCall:
        prompt = self.plain_prompt(req, "/generate", "sglang")
        sampling: dict[str, Any] = {
            "max_new_tokens": req.max_tokens,
            "temperature": req.temperature,
            "ignore_eos": req.ignore_eos,
        }
        if req.seed is not None:
            sampling["sampling_seed"] = req.seed
        body: dict[str, Any] = {"text": prompt, "sampling_params": sampling, "stream": True}
        body.update(self.body_extras(req.extra_body))
        return HttpCall(path="/generate", body=body, headers=self.auth_headers())

    def parse(self, data: str, state: ParseState) -> list[Delta]:
        if data == "[DONE]":
            return [Delta(done=True)]
        obj = loads_json(data)
        if not isinstance(obj, dict):
            raise ValueError(f"SGLang stream event is not an object: {data[:120]!r}")
        if "error" in obj:
            err = obj["error"]
            return [Delta(error=str(err.get("message", err) if isinstance(err, dict) else err), done=True)]
        text = obj.get("text", "")
        if not text.startswith(state.text_so_far):
            raise ValueError(
                "SGLang stream text is not cumulative (server runs --incremental-streaming-output?)"
            )
        meta = obj.get("meta_info") or {}
        total = int(meta.get("completion_tokens", state.completion_tokens))
        out = Delta(
            text=text[len(state.text_so_far) :],
            tokens=total - state.completion_tokens,
            tokens_source="tokens_field",
            prompt_tokens=meta.get("prompt_tokens"),
        )
        state.text_so_far, state.completion_tokens = text, total
        finish = meta.get("finish_reason")
        if finish:
            out.finish_reason = finish.get("type") if isinstance(finish, dict) else str(finish)
            out.completion_tokens = total
            out.cached_tokens = meta.get("cached_tokens")
            if meta.get("spec_verify_ct"):
                out.extra["spec_verify_ct"] = meta["spec_verify_ct"]
        if not out.text and not out.tokens and not finish:
            return []
        return [out]


class SGLangBackend(OpenAIBackend):
    """SGLang's OpenAI endpoints (``/v1/completions``, ``/v1/chat/completions``)."""

    name: ClassVar[str] = "sglang"
    server: ClassVar[ServerProfile] = SGLANG_PROFILE
