"""Write the Grafana dashboards in docs/grafana/: one per server (the bundled reference server, vLLM,
llama.cpp's llama-server), the same panels in the same places, each with that server's own metric names.

    .venv/bin/python scripts/make_grafana.py        # rewrites docs/grafana/*.json

A panel a server has no metric for is left out of its dashboard. tests/test_grafana.py checks that the files
are this script's output and that every metric they query is one the server really exports (a live scrape
of the reference server and of llama-server; vLLM's names as read from its source, docs/grafana/README.md).
"""

from __future__ import annotations

import json
from pathlib import Path

from backends.llamacpp import LLAMACPP_PROFILE
from backends.profile import REFERENCE_PROFILE, PrefixCounters
from backends.vllm import VLLMBackend
from reference_server import metric_names as M

OUT = Path(__file__).resolve().parent.parent / "docs" / "grafana"
SEL = '{instance=~"$instance"}'
SERVERS = {  # server -> (dashboard title, a metric every scrape has: feeds the instance picker)
    "servelab": ("servelab reference server", M.REQUESTS_RUNNING),
    "vllm": ("vLLM", "vllm:num_requests_running"),
    "llamacpp": ("llama.cpp llama-server", "llamacpp:requests_processing"),
}


def _rate(name: str) -> str:
    return f"rate({name}{SEL}[1m])"


def _quantiles(hist: str) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le) (rate({hist}_bucket{SEL}[1m])))", f"p{int(q * 100)}")
            for q in (0.5, 0.99)]  # fmt: skip


def _rates(**by_server: tuple[str, str]) -> dict[str, list[tuple[str, str]]]:
    """A panel's one query per server, the rate of a counter: ``server=(counter, legend)``."""
    return {server: [(_rate(counter), legend)] for server, (counter, legend) in by_server.items()}


def _by(label: str, counter: str) -> tuple[str, str]:
    """A counter's rate summed per value of ``label``, each value its own series."""
    return f"sum by ({label}) ({_rate(counter)})", f"{{{{{label}}}}}"


def _ratio(num: str, den: str) -> str:
    return f"{_rate(num)} / {_rate(den)}"


def _hit_rate(pc: PrefixCounters) -> str:
    """Cached over looked-up prompt tokens, from a server's prefix-cache counters (backends/profile.py)."""
    looked_up = f"({_rate(pc.hits)} + {_rate(pc.queries)})" if pc.misses else _rate(pc.queries)
    return f"{_rate(pc.hits)} / {looked_up}"


# (title, Grafana unit, {server: [(PromQL, legend)]}); the order is the layout (two panels per row)
PANELS: list[tuple[str, str, dict[str, list[tuple[str, str]]]]] = [
    ("Requests running / waiting", "short", {
        "servelab": [(f"{M.REQUESTS_RUNNING}{SEL}", "running"), (f"{M.REQUESTS_WAITING}{SEL}", "waiting")],
        "vllm": [(f"vllm:num_requests_running{SEL}", "running"), (f"vllm:num_requests_waiting{SEL}", "waiting")],
        "llamacpp": [(f"llamacpp:requests_processing{SEL}", "running"),
                     (f"llamacpp:requests_deferred{SEL}", "waiting (deferred)")],
    }),
    ("KV cache used", "percentunit", {
        "servelab": [(f"{M.KV_BLOCKS_USED}{SEL} / {M.KV_BLOCKS_TOTAL}{SEL}", "blocks used")],
        "vllm": [(f"vllm:kv_cache_usage_perc{SEL}", "used")],
    }),
    ("Output tokens/s", "short", _rates(
        servelab=(M.total(M.GENERATION_TOKENS), "generated"),
        vllm=("vllm:generation_tokens_total", "generated"),
        llamacpp=("llamacpp:tokens_predicted_total", "generated"),
    )),
    ("Prompt tokens/s (prefill)", "short", _rates(
        servelab=(M.total(M.PROMPT_TOKENS), "computed"),
        vllm=("vllm:prompt_tokens_total", "prompt"),
        llamacpp=("llamacpp:prompt_tokens_total", "computed"),
    )),
    ("Time to first token", "s", {
        "servelab": _quantiles(M.TIME_TO_FIRST_TOKEN),
        "vllm": _quantiles("vllm:time_to_first_token_seconds"),
    }),
    ("Inter-token latency", "s", {
        "servelab": _quantiles(M.INTER_TOKEN_LATENCY),
        "vllm": _quantiles("vllm:inter_token_latency_seconds"),
    }),
    ("Finished requests/s", "reqps", {
        "servelab": [_by("finish_reason", M.total(M.REQUESTS_FINISHED))],
        "vllm": [_by("finished_reason", "vllm:request_success_total")],
    }),
    ("Engine steps/s", "short", _rates(
        servelab=(M.total(M.ITERATIONS), "steps"),
        vllm=("vllm:iteration_tokens_total_count", "steps"),
        llamacpp=("llamacpp:n_decode_total", "decode calls"),
    )),
    ("Prefix cache hit rate", "percentunit", {
        server: [(_hit_rate(profile.prefix_cache), "cached / prompt tokens")]
        for server, profile in (("servelab", REFERENCE_PROFILE), ("vllm", VLLMBackend.server), ("llamacpp", LLAMACPP_PROFILE))
        if profile.prefix_cache
    }),
    ("Preemptions/s", "short", _rates(
        servelab=(M.total(M.PREEMPTIONS), "preempted"),
        vllm=("vllm:num_preemptions_total", "preempted"),
    )),
    ("Speculative decoding: accepted / drafted tokens", "percentunit", {
        "servelab": [(_ratio(M.total(M.SPEC_ACCEPTED_TOKENS), M.total(M.SPEC_DRAFT_TOKENS)), "acceptance")],
        "vllm": [(_ratio("vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_draft_tokens_total"),
                  "acceptance")],
        "llamacpp": [(_ratio("llamacpp:spec_decode_num_accepted_tokens_total",
                             "llamacpp:spec_decode_num_draft_tokens_total"), "acceptance")],
    }),
]  # fmt: skip


def dashboard(server: str) -> dict[str, object]:
    title, probe = SERVERS[server]
    ds = {"type": "prometheus", "uid": "${datasource}"}
    panels = []
    for i, (ptitle, unit, by_server) in enumerate(p for p in PANELS if server in p[2]):
        targets = [{"refId": chr(65 + j), "datasource": ds, "expr": expr, "legendFormat": legend}
                   for j, (expr, legend) in enumerate(by_server[server])]  # fmt: skip
        panels.append({
            "id": i + 1, "type": "timeseries", "title": ptitle, "datasource": ds,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []}, "targets": targets,
        })  # fmt: skip
    return {
        "title": f"{title} (servelab)", "uid": f"servelab-{server}", "tags": ["servelab", server],
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "5s",
        "time": {"from": "now-15m", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"},
            {"name": "instance", "label": "server", "type": "query", "datasource": ds, "refresh": 2,
             "query": f"label_values({probe}, instance)", "includeAll": True, "multi": True},
        ]},
        "panels": panels,
    }  # fmt: skip


def render(server: str) -> str:
    return json.dumps(dashboard(server), indent=1) + "\n"


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for server in SERVERS:
        (OUT / f"{server}.json").write_text(render(server))
        print(OUT / f"{server}.json")


if __name__ == "__main__":
    main()
