"""Hugging Face text-generation-inference (TGI): native ``/generate_stream`` and the Messages API.

Formats from TGI's router (``router/src/lib.rs``: ``StreamResponse``, ``StreamDetails``, ``Token``;
``router/src/server.rs``: ``generate_stream``): one SSE event per generated token,
``{"index", "token": {"id", "text", "logprob", "special"}, "generated_text": null, "details": null}``;
the last event carries ``generated_text`` and, when ``parameters.details`` is true, ``details``
(``finish_reason`` = ``length``/``eos_token``/``stop_sequence``, ``generated_tokens``, ``seed``, and
``input_length`` in TGI >= 2.0). The native stream has no ``[DONE]``; errors arrive as
``{"error", "error_type"}``. The Messages API is OpenAI ``/v1/chat/completions``. TGI has no
``ignore_eos``. ``/metrics`` gauges include ``tgi_batch_current_size`` and ``tgi_queue_size``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from backends.base import Delta, HttpCall, ParseState, loads_json
from backends.native import NativeBackend
from backends.openai import OpenAIBackend
from backends.profile import ServerProfile
from workloads.contracts import GenRequest

TGI_PROFILE = ServerProfile(iterations_path=None, running=("tgi_batch_current_size",), waiting=("tgi_queue_size",),
                            tokenize=("/tokenize", "inputs"))  # fmt: skip


class TGINativeBackend(NativeBackend):
    """``POST /generate_stream`` with ``details: true``: exactly one token per event."""

    name: ClassVar[str] = "tgi-native"
    server: ClassVar[ServerProfile] = TGI_PROFILE

    def build(self, req: GenRequest) -> HttpCall:
        params: dict[str, Any] = {"max_new_tokens": req.max_tokens, "details": True}
        if req.temperature > 0:  # TGI rejects temperature 0; greedy is do_sample false
            params.update(do_sample=True, temperature=req.temperature)
        if req.seed is not None:
            params["seed"] = req.seed
        params.update(self.body_extras(req.extra_body))
        return HttpCall(
            path="/generate_stream",
            body={"inputs": self.plain_prompt(req, "/generate_stream", "tgi"), "parameters": params},
            headers=self.auth_headers(),
        )

    def parse(self, data: str, state: ParseState) -> list[Delta]:
        obj = loads_json(data)
        if not isinstance(obj, dict):
            raise ValueError(f"TGI stream event is not an object: {data[:120]!r}")
        if "error" in obj:
            return [Delta(error=str(obj["error"]), done=True)]
        token = obj.get("token") or {}
        state.completion_tokens += 1
        out = Delta(
            text="" if token.get("special") else token.get("text", ""), tokens=1, tokens_source="token_ids"
        )
        details = obj.get("details")
        if obj.get("generated_text") is not None:
            out.done = True
            if details:
                out.finish_reason = details.get("finish_reason")
                out.completion_tokens = details.get("generated_tokens")
                out.prompt_tokens = details.get("input_length")
        return [out]


class TGIBackend(OpenAIBackend):
    """TGI's Messages API (``/v1/chat/completions``); ``ignore_eos`` is not sent."""

    name: ClassVar[str] = "tgi"
    server: ClassVar[ServerProfile] = TGI_PROFILE

    def build(self, req: GenRequest) -> HttpCall:
        call = super().build(req)
        call.body.pop("ignore_eos", None)
        return call
