"""vLLM's OpenAI server, with per-chunk token counts.

vLLM (``vllm/entrypoints/openai/protocol.py``) accepts ``stream_options.continuous_usage_stats``: every
streamed chunk then carries the cumulative ``usage``, so each event's token count is exact even when
one chunk holds several tokens (a CPU build often does). ``return_token_ids`` (vLLM >= 0.10.2) adds
``token_ids`` to each streamed choice; off by default because older servers reject unknown fields.
Its ``/metrics`` (``vllm/v1/metrics/loggers.py``) exposes ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_queries_total`` /
``vllm:prefix_cache_hits_total`` and the ``vllm:spec_decode_num_*_total`` counters.
"""

from __future__ import annotations

from typing import Any, ClassVar

from backends.base import Api
from backends.openai import OpenAIBackend
from backends.poller import ServerProfile


class VLLMBackend(OpenAIBackend):
    name: ClassVar[str] = "vllm"
    server: ClassVar[ServerProfile] = ServerProfile(
        spec_drafted="vllm:spec_decode_num_draft_tokens_total",
        spec_accepted="vllm:spec_decode_num_accepted_tokens_total",
    )

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str | None = None,
        api: Api | None = None,
        continuous_usage: bool = True,
        return_token_ids: bool = False,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        body = {"return_token_ids": True} if return_token_ids else {}
        super().__init__(base_url, model, api_key, api, continuous_usage, {**body, **(extra_body or {})})
