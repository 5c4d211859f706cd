"""The HTML report as a page: its tables (equal to summary.json), self-contained or with Plotly from the CDN,
what it says of series not recorded, a comparison's diff table, bad input, `bench report` (its figures:
test_report_figures.py)."""

from __future__ import annotations

import json
import re
import shutil
from html.parser import HTMLParser

import pytest
from support.synthetic import SimConfig, write_synthetic_results

from loadgen.records.results import leaves
from loadgen.report import ReportInputError, sweep_chart, timeline, write_report
from loadgen.report.builder import cell
from loadgen.report.load import load_run, read_jsonl


@pytest.fixture(scope="module")
def report_html(run_dir) -> str:
    return write_report([run_dir], run_dir / "report.html").read_text()


class _Tables(HTMLParser):
    """Collects every <table class="summary">: (data-group, header cells, body rows of cell texts)."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[dict] = []
        self._cur: dict | None = None
        self._row: list[str] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table" and "summary" in (a.get("class") or "").split():
            self._cur = {"group": a.get("data-group"), "run": a.get("data-run"), "rows": []}
        elif self._cur is not None and tag == "tr":
            self._row = []
        elif self._row is not None and tag in ("td", "th"):
            self._cell = []

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._row.append("".join(self._cell))
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self._cur["rows"].append(self._row)
            self._row = None
        elif tag == "table" and self._cur is not None:
            self.tables.append(self._cur)
            self._cur = None


def test_summary_tables_equal_summary_json(run_dir, report_html):
    summary = json.loads((run_dir / "summary.json").read_text())
    parser = _Tables()
    parser.feed(report_html)
    shown: dict[str, dict[str, str]] = {}  # point id -> key -> cell text
    for table in parser.tables:
        header, *rows = table["rows"]
        assert header[0] == "metric"
        for row in rows:
            for pid, text in zip(header[1:], row[1:], strict=True):
                if text != "":
                    shown.setdefault(pid, {})[row[0]] = text
    assert set(shown) == {p["point_id"] for p in summary["points"]}
    for p in summary["points"]:
        flat = leaves(p)
        assert shown[p["point_id"]] == {k: cell(v) for k, v in flat.items()}
        # same numbers: every numeric cell parses back to exactly the value in summary.json
        for k, v in flat.items():
            if isinstance(v, float):
                assert float(shown[p["point_id"]][k]) == v
    assert "latency.ttft.p99" in shown["c016"] and "throughput.steady.output_tok_per_s" in shown["c016"]


def test_report_is_self_contained(report_html):
    from loadgen.report.builder import plotly_js

    js = plotly_js()
    assert "plotly.js (basic - minified) v" in js[:200]  # the vendored partial bundle, not the full one
    assert report_html.count(js[:400]) == 1  # plotly.js inlined exactly once
    outside = report_html.replace(js.replace("</script", "<\\/script"), "")
    assert not re.search(r"<(script|img|link|iframe)[^>]+(src|href)=", outside, re.I)
    assert "default-src 'none'" in outside  # CSP: the page may not fetch anything
    assert len(report_html.encode()) < len(js) + 400_000  # the rest (data, tables) of a 3-point sweep is small


def test_report_with_plotly_from_the_cdn(run_dir, tmp_path):
    from typer.testing import CliRunner

    from loadgen.cli.app import app
    from loadgen.report.builder import PLOTLY_CDN

    page = write_report([run_dir], tmp_path / "cdn.html", plotly="cdn").read_text()
    assert page.count(f'<script src="{PLOTLY_CDN}"') == 1 and "plotly.js (basic" not in page
    assert "script-src 'unsafe-inline' 'unsafe-eval' https://cdn.plot.ly;" in page  # CSP lets only that in
    assert len(page.encode()) < 400_000
    res = CliRunner().invoke(app, ["report", str(run_dir), "-o", str(tmp_path / "x.html"), "--plotly", "web"])
    assert res.exit_code == 2 and "--plotly must be one of inline, cdn" in res.output


def test_optional_series_are_optional(tmp_path):
    cfg = SimConfig(
        concurrencies=(2, 8),
        requests_per_point=40,
        server_state=False,
        iterations=False,
        telemetry=False,
        seed=2,
    )
    run_dir = write_synthetic_results(tmp_path, "bare", cfg)
    run = load_run(run_dir)
    fig = timeline.timeline(run, run.points[0])
    titles = " ".join(a["text"] for a in fig["layout"]["annotations"])
    assert "server batch" not in titles and "KV cache" not in titles and "utilisation" not in titles
    assert "requests (client)" in titles and "Gantt" in titles
    text = write_report([run_dir], tmp_path / "r.html").read_text()
    assert "Not recorded for this point: server state (/metrics), per-iteration record, telemetry." in text


def test_comparison_has_a_line_per_run_and_a_diff_table(tmp_path):
    a = write_synthetic_results(tmp_path, "slow", SimConfig(concurrencies=(1, 4, 8), requests_per_point=40))
    b = write_synthetic_results(
        tmp_path,
        "fast",
        SimConfig(concurrencies=(1, 4, 8), requests_per_point=40, speed=2.0, telemetry=False),
    )
    fig = sweep_chart.sweep([load_run(a), load_run(b)])
    assert {t["name"] for t in fig["data"] if t.get("yaxis") == "y"} == {"slow", "fast"}
    text = write_report([a, b], tmp_path / "cmp.html").read_text()
    diff = text[text.index('<table class="diff"') :]
    diff = diff[: diff.index("</table>")]
    rows = re.findall(
        r"<tr><td>(c00\d)</td><td>([^<]+)</td><td>([^<]+)</td><td>([^<]+)</td><td><span[^>]*>([^<]+)</span>",
        diff,
    )
    assert {r[0] for r in rows} == {"c001", "c004", "c008"}
    for _pid, key, base, other, pct in rows:
        assert float(pct) == pytest.approx(
            (float(other) - float(base)) / float(base) * 100, abs=0.06
        )  # 5 digits shown
        if key.startswith("throughput"):
            assert float(pct) > 50  # the twice-as-fast server
    assert text.count("Run slow") == 1 and text.count("Run fast") == 1


def test_bad_input_is_a_clear_error(tmp_path):
    with pytest.raises(ReportInputError, match="not a directory"):
        write_report([tmp_path / "nope"], tmp_path / "r.html")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportInputError, match="neither summary.json nor points"):
        write_report([tmp_path / "empty"], tmp_path / "r.html")
    (tmp_path / "empty" / "summary.json").write_text("{not json")
    with pytest.raises(ReportInputError, match="summary.json is not valid JSON"):
        write_report([tmp_path / "empty"], tmp_path / "r.html")
    assert not (tmp_path / "r.html").exists()


def test_torn_last_record_is_dropped(run_dir, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(run_dir, d)
    path = d / "points" / "c001" / "requests.jsonl"
    n = len(read_jsonl(path))
    with path.open("a") as f:
        f.write('{"id": "torn", "cls": "sh')
    assert len(read_jsonl(path)) == n
    assert write_report([d], d / "report.html").stat().st_size > 0


def test_bench_report_cli(run_dir, tmp_path):
    from typer.testing import CliRunner

    from loadgen.cli.app import app
    from loadgen.report.cli import auto_report

    out = tmp_path / "sub" / "r.html"
    res = CliRunner().invoke(app, ["report", str(run_dir), str(run_dir), "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert out.is_file() and f"report: {out}" in res.output
    assert out.read_text().count('<select class="point-select"') == 2
    res = CliRunner().invoke(app, ["report", str(tmp_path / "missing")])
    assert res.exit_code == 2 and "is not a directory" in " ".join(res.output.split())
    assert auto_report(tmp_path / "missing").startswith("[yellow]warning[/]: no report")
    assert auto_report(run_dir) == f"report: {run_dir / 'report.html'}"


def test_the_answer_table_and_the_distributions_take_the_registrys_labels(run_dir):
    """The answer table's headings and the CDF panels' axis titles are the metric registry's: a label changed
    there changes both."""
    from loadgen.metrics import definitions as metrics
    from loadgen.report import cdf
    from loadgen.report.builder import answer_first

    run = load_run(run_dir)

    def shown() -> tuple[list[str], list[str]]:
        layout = cdf.distributions(run.points[0])["layout"]
        return answer_first([run])["table"].header, [v["title"]["text"] for k, v in layout.items() if k.startswith("xaxis")]

    header, panels = shown()
    assert header[3:8] == ["out tok/s", "req/s", "TTFT p50 / p99 (ms)", "ITL p50 / p99 (ms)", "E2E p50 / p99 (ms)"]
    assert panels == ["time to first token, TTFT (s)", "inter-token latency, ITL (s)", "time per output token, TPOT (s)",
                      "end-to-end latency, E2E (s)"]  # fmt: skip
    object.__setattr__(metrics.TTFT, "label", "first token")  # the registry is frozen: only a test relabels it
    try:
        header, panels = shown()
    finally:
        object.__setattr__(metrics.TTFT, "label", "TTFT")
    assert header[5] == "first token p50 / p99 (ms)" and panels[0] == "time to first token, first token (s)"
