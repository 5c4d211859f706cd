"""The capacity report section in a real headless Chromium: no console error, no network request, every
chart drawn with data (a search on the known-answer service model in virtual time feeds it)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
from support.browser import find_chromium, inspect_report_sync

from loadgen.capacity.config import SearchConfig
from loadgen.capacity.search import search
from loadgen.dispatch.signals import run_async
from loadgen.metrics.slo import parse_slos
from loadgen.report.capacity import write_report
from loadgen.testservers.servicemodel import ServiceModel, SimProber

pytestmark = pytest.mark.browser


def test_capacity_report_in_chromium(tmp_path):
    slos = parse_slos("ttft_p90=25ms,tpot_p99=11ms,error_rate=1%", percentiles=True)
    model = ServiceModel()
    entries = []
    for mode in ("concurrency", "rate"):
        res = run_async(search(SimProber(model, (60, 16), slos, process="constant"), slos, SearchConfig(mode)))
        entries.append({"point_id": f"np8-{mode}", "labels": {"np": "8"}, **res.to_json()})
    (tmp_path / "capacity.json").write_text(json.dumps({"config": {"model": asdict(model)}, "configs": entries}))
    html = write_report(tmp_path)
    find_chromium()
    page = inspect_report_sync(html, tmp_path / "cap.png", timeout=90)
    assert page.console_errors == [] and page.network_requests == []
    assert len(page.charts) == 2 * (len(slos) + 1)  # one per SLO + the search path, per configuration
    for chart in page.charts:
        assert chart["drawn"] and chart["traces"] > 0 and chart["values"] > 0 and chart["empty_traces"] == [], chart
    assert "charts-drawn" in page.marks
    text = html.read_text()
    assert "capacity 6 concurrency" in text and "resolution ±5% reached" in text
