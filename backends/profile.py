"""A server's vendor facts: where it keeps its state and what it names its counters.

Each backend carries one :class:`ServerProfile` as ``server``; the load generator's sidecars (the
server-state poller) read it and know no vendor by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import reference_server.metric_names as M

# The bundled reference server's speculative-decoding counters.
REFERENCE_SPEC = (M.total(M.SPEC_DRAFT_TOKENS), M.total(M.SPEC_ACCEPTED_TOKENS))
# vLLM's naming, ``<prefix>:spec_decode_num_..._tokens_total``, which other servers follow.
_VLLM_SPEC_SUFFIXES = ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total")


@dataclass(frozen=True)
class PrefixCounters:
    """A server's prefix-cache counters: prompt tokens found in the cache, and the prompt tokens looked up
    (or, with ``misses``, those not found: llama.cpp's ``prompt_tokens_total`` leaves cached ones out)."""

    hits: str
    queries: str
    misses: bool = False

    def tokens(self, hits: float, other: float) -> float:
        """The prompt tokens looked up, from the two counters' values."""
        return hits + other if self.misses else other


@dataclass(frozen=True)
class ServerProfile:
    """Where a server keeps its state, and which of its counters count speculative tokens."""

    metrics_path: str | None = "/metrics"
    slots_path: str | None = None
    iterations_path: str | None = "/v1/iterations"  # probed once; used only when it answers 200
    health_path: str = "/health"
    spec_drafted: str | None = None
    spec_accepted: str | None = None
    # the gauges the report draws, by role (the first present wins): requests running and waiting, the KV
    # cache's usage (a 0..1 ratio or a percentage), or its blocks (used, total) where it counts blocks
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    kv_usage: tuple[str, ...] = ()
    kv_blocks: tuple[str, str] | None = None
    # the prefix cache's counters (each summed over its label sets), and the POST path that empties the
    # cache, where the server has them
    prefix_cache: PrefixCounters | None = None
    reset_cache: str | None = None
    # POST path of the server's tokenizer and the JSON field it reads the text from (its answer: ``count``, a
    # ``tokens`` list, or a list of tokens)
    tokenize: tuple[str, str] | None = None

    def spec_counters(self, names: set[str]) -> tuple[str, str] | None:
        """Of the counter base ``names`` a server exports, its drafted/accepted pair: the profile's own,
        else the bundled reference server's, else any pair in vLLM's naming."""
        if self.spec_drafted and self.spec_accepted:
            return self.spec_drafted, self.spec_accepted
        if set(REFERENCE_SPEC) <= names:
            return REFERENCE_SPEC
        for name in sorted(names):
            if name.endswith(_VLLM_SPEC_SUFFIXES[0]):
                accepted = name[: -len(_VLLM_SPEC_SUFFIXES[0])] + _VLLM_SPEC_SUFFIXES[1]
                if accepted in names:
                    return name, accepted
        return None


DEFAULT_PROFILE = ServerProfile()
# The bundled reference server (served through the plain OpenAI backend).
REFERENCE_PROFILE = ServerProfile(
    spec_drafted=REFERENCE_SPEC[0], spec_accepted=REFERENCE_SPEC[1],
    running=(M.REQUESTS_RUNNING,), waiting=(M.REQUESTS_WAITING,), kv_blocks=(M.KV_BLOCKS_USED, M.KV_BLOCKS_TOTAL),
    prefix_cache=PrefixCounters(M.total(M.PREFIX_CACHE_HITS), M.total(M.PREFIX_CACHE_QUERIES)),
    reset_cache="/reset_prefix_cache", tokenize=("/tokenize", "prompt"),
)  # fmt: skip


def profile_of(backend: object) -> ServerProfile:
    """The backend's ``server`` profile, or the generic one."""
    profile = getattr(backend, "server", None)
    return profile if isinstance(profile, ServerProfile) else DEFAULT_PROFILE
