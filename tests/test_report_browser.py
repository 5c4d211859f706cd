"""The report in a real headless Chromium (Debian ``chromium``): loads with no console error and no
network request, every chart is drawn with data, a screenshot is taken. A missing browser fails."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest
from support.browser import find_chromium, inspect_report_sync
from support.synthetic import SimConfig, write_synthetic_results

from loadgen.report import write_report

pytestmark = pytest.mark.browser


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


def _check(html: Path, shot: Path, expected_charts: int) -> None:
    find_chromium()  # raises (fails the test) when the browser is missing
    page = inspect_report_sync(html, shot, timeout=90)
    assert page.console_errors == []
    assert page.requests[0] == html.resolve().as_uri()
    assert page.network_requests == []
    assert len(page.charts) == expected_charts
    for chart in page.charts:
        assert chart["drawn"] and chart["traces"] > 0 and chart["values"] > 0, chart
        assert chart["empty_traces"] == [], chart
        # axis titles as drawn: words with units, never summary keys like throughput.steady.output_tok_per_s
        assert chart["axis_titles"], chart
        for title in chart["axis_titles"]:
            assert not re.search(r"[a-z]\.[a-z]|_", title), f"{chart['fig']}: axis title {title!r} is a key"
            assert re.search(r"[a-z]{3,}", title), title
    assert page.nav_load_ms > 0 and "charts-drawn" in page.marks
    width, height = _png_size(shot)
    assert width == 1400 and height > 1500  # the whole page, not an empty viewport
    assert shot.stat().st_size > 50_000


# `make sweep` (concurrency 1, 4, 16 x 32 measured requests + 2 warm-ups each) wrote a 5.27 MB report with the
# full plotly bundle inlined; with the basic bundle the same results give 1.65 MB (docs/report.md). The bound:
MAKE_SWEEP_REPORT_MAX_B = 2_000_000


def test_single_run_report_in_chromium(tmp_path):
    run = write_synthetic_results(tmp_path, "one", SimConfig(concurrencies=(1, 4, 16), requests_per_point=34))
    html = write_report([run], run / "report.html")
    assert html.stat().st_size < MAKE_SWEEP_REPORT_MAX_B  # a make-sweep-sized run, plotly inlined
    # sweep + (timeline + CDFs) per point
    _check(html, tmp_path / "one.png", expected_charts=1 + 2 * 3)
    text = html.read_text()
    assert text.index('<div class="answer"><h2>Summary</h2>') < text.index('data-fig="sweep"')  # answer first


def test_comparison_report_in_chromium(tmp_path):
    a = write_synthetic_results(tmp_path, "base", SimConfig(concurrencies=(2, 8), requests_per_point=40))
    b = write_synthetic_results(
        tmp_path,
        "bare",
        SimConfig(
            concurrencies=(2, 8),
            requests_per_point=40,
            speed=1.5,
            server_state=False,
            iterations=False,
            telemetry=False,
        ),
    )
    html = write_report([a, b], tmp_path / "compare.html")
    _check(html, tmp_path / "compare.png", expected_charts=1 + 2 * 2 + 2 * 2)
