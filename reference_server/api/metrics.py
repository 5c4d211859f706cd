"""The server's Prometheus series (names in ``reference_server.metric_names``), fed by the engine's hooks."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from reference_server import metric_names as M
from reference_server.engine.engine import Engine, IterationRecord


class Metrics:
    """Prometheus series in a registry of their own (one per app)."""

    def __init__(self, engine: Engine) -> None:
        self.registry = r = CollectorRegistry()
        self.running = Gauge(M.REQUESTS_RUNNING, "Requests in the running batch", registry=r)
        self.waiting = Gauge(M.REQUESTS_WAITING, "Requests waiting for admission", registry=r)
        self.kv_used = Gauge(M.KV_BLOCKS_USED, "KV-cache blocks referenced by requests", registry=r)
        self.kv_total = Gauge(M.KV_BLOCKS_TOTAL, "KV-cache blocks in the pool", registry=r)
        self.preemptions = Counter(M.PREEMPTIONS, "Requests preempted (recomputed later)", registry=r)
        self.prefix_queries = Counter(M.PREFIX_CACHE_QUERIES, "Prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter(M.PREFIX_CACHE_HITS, "Prompt tokens found in the prefix cache", registry=r)
        self.iterations = Counter(M.ITERATIONS, "Engine steps", registry=r)
        self.prompt_tokens = Counter(M.PROMPT_TOKENS, "Prompt tokens computed (prefill)", registry=r)
        self.generation_tokens = Counter(M.GENERATION_TOKENS, "Tokens generated (accepted draft tokens included)",
                                         registry=r)
        self.requests = Counter(M.REQUESTS_FINISHED, "Requests ended, by finish reason (stop, length, "
                                "pooled: an embedding input computed, abort: the client went away, error: failed on "
                                "the server)", ["finish_reason"], registry=r)
        self.pooling_requests = Counter(M.POOLING_REQUESTS, "Embeddings and rerank requests answered, by endpoint",
                                        ["endpoint"], registry=r)
        self.pooling_inputs = Counter(M.POOLING_INPUTS, "Texts embedded for answered requests (a rerank's query "
                                      "and documents), by endpoint", ["endpoint"], registry=r)
        self.pooling_tokens = Counter(M.POOLING_TOKENS, "Tokens of the texts embedded for answered requests, by "
                                      "endpoint", ["endpoint"], registry=r)
        self.alive = Gauge(M.ENGINE_ALIVE, "1 while the engine loop runs, 0 once it has died", registry=r)
        buckets = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
        self.tokens_per_iter = Histogram(M.TOKENS_PER_ITERATION, "Tokens computed per engine step",
                                         buckets=buckets, registry=r)
        lat = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80)
        self.ttft = Histogram(M.TIME_TO_FIRST_TOKEN, "Time to first token", buckets=lat, registry=r)
        self.itl = Histogram(M.INTER_TOKEN_LATENCY, "Time between output tokens", buckets=lat, registry=r)
        self.spec_drafted = Counter(M.SPEC_DRAFT_TOKENS, "Speculative draft tokens verified", registry=r)
        self.spec_accepted = Counter(M.SPEC_ACCEPTED_TOKENS, "Speculative draft tokens accepted", registry=r)
        self.spec_steps = Counter(M.SPEC_VERIFY_STEPS, "Verification passes that carried a draft", registry=r)
        self.kv_total.set(engine.block_manager.num_blocks)
        # read when scraped, so they are current while the engine idles (after aborts, say)
        self.running.set_function(lambda: len(engine.scheduler.running))
        self.waiting.set_function(engine.num_waiting)
        self.kv_used.set_function(lambda: engine.block_manager.num_used)
        self.alive.set_function(lambda: int(engine.alive))
        self.open = Gauge(M.REQUESTS_OPEN, "Requests the HTTP front end holds an output queue for", registry=r)
        self._engine = engine
        self._seen = (0, 0, 0, 0, 0, 0)

    def on_finish(self, reason: str) -> None:
        self.requests.labels(reason).inc()

    def on_pooled(self, endpoint: str, inputs: int, tokens: int) -> None:
        """An embeddings or rerank request answered."""
        self.pooling_requests.labels(endpoint).inc()
        self.pooling_inputs.labels(endpoint).inc(inputs)
        self.pooling_tokens.labels(endpoint).inc(tokens)

    def on_iteration(self, rec: IterationRecord) -> None:
        """Engine-thread hook: per-step histogram and counter deltas."""
        bm, sch = self._engine.block_manager, self._engine.scheduler
        self.iterations.inc()
        self.prompt_tokens.inc(rec.prefill_tokens)
        self.generation_tokens.inc(rec.output_tokens)
        self.tokens_per_iter.observe(rec.prefill_tokens + rec.decode_tokens)
        spec = self._engine.spec
        now = (sch.num_preemptions, bm.prefix_queries, bm.prefix_hits,
               *((spec.num_drafted, spec.num_accepted, spec.num_steps) if spec else (0, 0, 0)))
        counters = (self.preemptions, self.prefix_queries, self.prefix_hits, self.spec_drafted, self.spec_accepted,
                    self.spec_steps)
        for counter, new, old in zip(counters, now, self._seen, strict=True):
            if new > old:
                counter.inc(new - old)
        self._seen = now
