"""docs/grafana/*.json: the dashboards are scripts/make_grafana.py's output, well-formed, and query only
metric names the servers really export: the reference server and llama-server scraped live here, vLLM's
names as its source defines them (docs/grafana/vllm-metrics.txt)."""

import importlib.util
import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.launcher import ServerProcess, free_port, render_command

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "grafana"
SERVERS = {
    "servelab": "python -m reference_server --port {port} --threads 1",
    "llamacpp": "llama-server -m {model} -t 1 -c 4096 -np 2 --metrics --host 127.0.0.1 --port {port}",
}
_spec = importlib.util.spec_from_file_location("make_grafana", ROOT / "scripts" / "make_grafana.py")
make_grafana = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_grafana)


def queried_metrics(dash: dict) -> set[str]:
    """Every metric name the dashboard queries (each is written as name{selector}) or lists instances from."""
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    names = {m for e in exprs for m in re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)\{", e)}
    for var in dash["templating"]["list"]:
        names |= set(re.findall(r"label_values\(([A-Za-z_:][A-Za-z0-9_:]*),", var.get("query", "")))
    return names


def scrape(url: str) -> set[str]:
    """Sample names of a live /metrics page, after one completion (so every family has been touched)."""
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=120)
    assert r.status_code == 200, r.text
    text = httpx.get(url + "/metrics", timeout=30).text
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.fixture(scope="module", params=sorted(SERVERS))
def live(request, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp(request.param) / "server.log"
    with ServerProcess(render_command(SERVERS[request.param], {}, port), port, log, health_timeout_s=180) as srv:
        yield request.param, scrape(srv.base_url)


def test_dashboards_are_the_generator_output_and_well_formed():
    for server in make_grafana.SERVERS:
        path = DOCS / f"{server}.json"
        assert path.read_text() == make_grafana.render(server), f"{path} is stale: run scripts/make_grafana.py"
        dash = json.loads(path.read_text())
        assert dash["uid"] == f"servelab-{server}" and dash["panels"]
        ids = [p["id"] for p in dash["panels"]]
        cells = [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in dash["panels"]]
        assert len(set(ids)) == len(ids) and len(set(cells)) == len(cells)
        for p in dash["panels"]:
            assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"])
            assert all('instance=~"$instance"' in t["expr"] for t in p["targets"])
    full = json.loads((DOCS / "servelab.json").read_text())
    assert [p["title"] for p in full["panels"]] == [p[0] for p in make_grafana.PANELS]  # every panel


def test_live_server_exports_every_queried_metric(live):
    server, exported = live
    dash = json.loads((DOCS / f"{server}.json").read_text())
    queried = queried_metrics(dash)
    assert len(queried) >= 6
    assert queried <= exported, f"{server} does not export {sorted(queried - exported)}"


def test_vllm_dashboard_uses_vllm_names():
    lines = (DOCS / "vllm-metrics.txt").read_text().splitlines()
    known = {x.strip() for x in lines if x.strip() and not x.startswith("#")}
    assert "vllm:num_requests_running" in known and "vllm:time_to_first_token_seconds_bucket" in known
    queried = queried_metrics(json.loads((DOCS / "vllm.json").read_text()))
    assert len(queried) >= 10
    assert queried <= known, f"vLLM does not export {sorted(queried - known)}"
