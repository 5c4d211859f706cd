"""Contract tests: each server's metric page, reproduced from the server's own source/docs, reconciled into a
point's counters, rates, gauges, speculative decoding and prefix cache figures (the streams: test_backend_formats.py).

Sources (cited per page): TGI router/src/server.rs, vLLM vllm/v1/metrics/loggers.py, SGLang
docs/references/production_metrics.md, llama.cpp tools/server server-task.cpp (to_metrics).
"""


from backends.llamacpp import LlamaCppBackend
from backends.profile import ServerProfile
from backends.sglang import SGLangNativeBackend
from backends.tgi import TGINativeBackend
from backends.vllm import VLLMBackend
from loadgen.sidecars.poller import reconcile
from loadgen.sidecars.prometheus import parse_metrics

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


def test_parse_metrics_keeps_counters_gauges_and_histogram_totals_whatever_the_labels_hold():
    """Buckets, ``_created`` and HELP lines are dropped before the library parses (for speed): a label
    value that quotes a brace, a comma, a ``# HELP`` or a bucket's name must not drop or split a sample."""
    page = "\n".join([
        '# HELP x_requests_total Requests with "quotes" and a {brace}',
        "# TYPE x_requests_total counter",
        'x_requests_total{path="/a b",note="say \\"hi\\", {ok} # HELP"} 3',
        "# TYPE x_requests_created gauge",
        'x_requests_created{path="/a b"} 1.7e9',
        "# TYPE x_latency_seconds histogram",
        'x_latency_seconds_bucket{le="0.1",tag="x_bucket"} 1',
        'x_latency_seconds_bucket{le="+Inf",tag="x_bucket"} 2',
        'x_latency_seconds_sum{tag="x_bucket"} 0.3',
        'x_latency_seconds_count{tag="x_bucket"} 2',
        "# TYPE x_queue gauge",
        "x_queue 4",
    ]) + "\n"
    values, counters = parse_metrics(page)
    assert values == {'x_requests_total{note=say "hi", {ok} # HELP,path=/a b}': 3.0,
                      "x_latency_seconds_sum{tag=x_bucket}": 0.3, "x_latency_seconds_count{tag=x_bucket}": 2.0,
                      "x_queue": 4.0}
    assert counters == set(values) - {"x_queue"}


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
    # the bundled reference server (reference_server/api/metrics.py): servelab_spec_{draft,accepted}_tokens
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
