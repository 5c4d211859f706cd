"""The reference server's Prometheus series names: one home for the server that exports them (api/metrics.py),
the harness that reads them (backends/profile.py) and the dashboards (scripts/make_grafana.py).

A counter named ``X`` here is exported as ``X_total`` (prometheus_client adds the suffix): read it through
:func:`total`. Imports nothing, so that the layers below the load generator may share it.
"""

REQUESTS_RUNNING = "servelab_requests_running"
REQUESTS_WAITING = "servelab_requests_waiting"
REQUESTS_OPEN = "servelab_requests_open"
KV_BLOCKS_USED = "servelab_kv_blocks_used"
KV_BLOCKS_TOTAL = "servelab_kv_blocks_total"
ENGINE_ALIVE = "servelab_engine_alive"
# counters
PREEMPTIONS = "servelab_preemptions"
PREFIX_CACHE_QUERIES = "servelab_prefix_cache_queries"
PREFIX_CACHE_HITS = "servelab_prefix_cache_hits"
ITERATIONS = "servelab_iterations"
PROMPT_TOKENS = "servelab_prompt_tokens"
GENERATION_TOKENS = "servelab_generation_tokens"
REQUESTS_FINISHED = "servelab_requests_finished"  # label finish_reason
SPEC_DRAFT_TOKENS = "servelab_spec_draft_tokens"
SPEC_ACCEPTED_TOKENS = "servelab_spec_accepted_tokens"
SPEC_VERIFY_STEPS = "servelab_spec_verify_steps"
POOLING_REQUESTS = "servelab_pooling_requests"  # label endpoint (embeddings, rerank)
POOLING_INPUTS = "servelab_pooling_inputs"  # label endpoint
POOLING_TOKENS = "servelab_pooling_tokens"  # label endpoint
# histograms
TOKENS_PER_ITERATION = "servelab_tokens_per_iteration"
TIME_TO_FIRST_TOKEN = "servelab_time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "servelab_inter_token_latency_seconds"


def total(counter: str) -> str:
    """The exported name of counter ``counter``."""
    return counter + "_total"
