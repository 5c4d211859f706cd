"""Assemble the self-contained HTML report: tables rendered here, charts as plotly specs in one JSON
blob, plotly.js once per report: inlined by default (no network at all), or from the plotly CDN.

The plotly.js is the official "basic" partial bundle (scatter, bar, pie: every trace type the report
draws; 1.2 MB instead of the full bundle's 4.8 MB), vendored gzipped from npm's
``plotly.js-basic-dist-min`` by ``scripts/vendor_plotly.sh``."""

from __future__ import annotations

import gzip
import html
import json
import math
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.report import figures
from loadgen.report.load import RunData, load_run
from loadgen.results import leaves

SIG_DIGITS = 6  # chart data only; tables show summary.json's numbers verbatim


PLOTLY_VERSION = "4.1.1"  # of assets/plotly-basic.min.js.gz (scripts/vendor_plotly.sh)
PLOTLY_CDN = f"https://cdn.plot.ly/plotly-basic-{PLOTLY_VERSION}.min.js"
PLOTLY_MODES = ("inline", "cdn")


def plotly_js() -> str:
    """The vendored plotly.js basic bundle's source."""
    data = resources.files("loadgen.report").joinpath("assets/plotly-basic.min.js.gz").read_bytes()
    return gzip.decompress(data).decode("utf-8")


def _plotly_tag(mode: str) -> tuple[str, str]:
    """The <script> that loads plotly.js and the CSP script source it needs."""
    if mode == "cdn":
        return f'<script src="{PLOTLY_CDN}" charset="utf-8"></script>', "https://cdn.plot.ly"
    if mode != "inline":
        raise ValueError(f"plotly mode must be one of {', '.join(PLOTLY_MODES)}, got {mode!r}")
    return "<script>" + plotly_js().replace("</script", "<\\/script") + "</script>", ""


def _jsonable(obj: Any) -> Any:
    """Numpy arrays -> lists rounded to SIG_DIGITS significant digits, NaN -> null (a gap in plotly)."""
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind in "fc":
            return [float(f"{v:.{SIG_DIGITS}g}") if math.isfinite(v) else None for v in obj.tolist()]
        return [_jsonable(v) for v in obj.tolist()]
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.floating, float)):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def cell(v: Any) -> str:
    """How a summary.json value is shown: strings as they are, everything else exactly as JSON writes it."""
    return v if isinstance(v, str) else json.dumps(v)


def _table(header: list[str], rows: list[list[str]], cls: str, attrs: str = "") -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f'<div class="tablewrap"><table class="{cls}"{attrs}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


OPEN_GROUPS = ("point", "load", "counts", "latency", "throughput", "errors", "goodput")


def summary_tables(run: RunData) -> str:
    """Every value of every PointSummary in summary.json, verbatim: one table per top-level group (a row
    per dotted key, a column per point); the main groups open, the rest (per class, client, server
    state, telemetry, ...) folded."""
    pts = [p for p in run.summary.get("points") or [] if isinstance(p, dict)]
    ids = [html.escape(str(p.get("point_id", p.get("id", i)))) for i, p in enumerate(pts)]
    groups: dict[str, list[dict[str, Any]]] = {}
    for p in pts:
        for g in [k for k, v in p.items() if isinstance(v, dict)] + ["point"]:
            groups.setdefault(g, [])
    for g in groups:
        groups[g] = [
            {k: v for k, v in p.items() if not isinstance(v, dict)}
            if g == "point"
            else leaves(p.get(g) or {}, g)
            for p in pts
        ]
    out = []
    for g in sorted(
        groups, key=lambda g: (OPEN_GROUPS.index(g) if g in OPEN_GROUPS else len(OPEN_GROUPS), g)
    ):
        flats = groups[g]
        keys = list(dict.fromkeys(k for f in flats for k in f))
        if not keys:
            continue
        rows = [[html.escape(k)] + [html.escape(cell(f[k])) if k in f else "" for f in flats] for k in keys]
        table = _table(
            ["metric"] + ids, rows, "summary", f' data-run="{html.escape(run.run_id)}" data-group="{g}"'
        )
        out.append(
            table if g in OPEN_GROUPS else f"<details><summary>{html.escape(g)}</summary>{table}</details>"
        )
    return "".join(out)


def _meta_table(run: RunData) -> str:
    flat = leaves(
        {k: run.summary[k] for k in ("config", "environment", "fingerprint") if k in run.summary}
    )
    rows = [[html.escape(k), html.escape(cell(v))] for k, v in flat.items()]
    return f"<details><summary>configuration and environment</summary>{_table(['field', 'value'], rows, 'meta')}</details>"


def diff_table(runs: list[RunData]) -> str:
    """Key sweep metrics of each run beside the first (baseline), matched by point id, with the change."""
    per_run = [{r["point_id"]: r for r in figures.sweep_rows(run)} for run in runs]
    base = per_run[0]
    header = ["point", "metric", runs[0].run_id]
    for run in runs[1:]:
        header += [run.run_id, "Δ %"]
    rows = []
    for pid, b in base.items():
        if not any(pid in other for other in per_run[1:]):
            continue
        for m in ("throughput", "goodput", "p50", "p99"):
            if b[m] is None:
                continue
            row = [html.escape(pid), html.escape(b[m + "_key"]), f"{b[m]:.5g}"]
            for other in per_run[1:]:
                o = other.get(pid, {}).get(m)
                if o is None:
                    row += ["", ""]
                    continue
                pct = (o - b[m]) / b[m] * 100 if b[m] else math.nan
                better = (pct > 0) == (m in ("throughput", "goodput"))
                row += [
                    f"{o:.5g}",
                    f'<span class="{"down" if better else "up"}">{pct:+.1f}</span>'
                    if math.isfinite(pct)
                    else "",
                ]
            rows.append(row)
    if not rows:
        return '<p class="note">No point id is shared by the runs: compare them on the sweep curves.</p>'
    return _table(header, rows, "diff")


def _point_views(r: int, run: RunData, figs: dict[str, Any]) -> str:
    """A point selector and, per point, its timeline and CDFs (drawn when the point is shown)."""
    opts = "".join(
        f'<option value="{html.escape(p.point_id)}">{html.escape(p.point_id)} ({len(p.requests):,} requests)</option>'
        for p in run.points
    )
    parts = [f'<p>Point: <select class="point-select" data-run="{r}">{opts}</select></p>']
    for p_i, point in enumerate(run.points):
        divs = []
        missing = figures.missing_series(run, point)
        if missing:
            divs.append('<p class="note">Not recorded for this point: ' + ", ".join(missing) + ".</p>")
        for kind, fig in (("timeline", figures.timeline(run, point)), ("cdf", figures.distributions(point))):
            if fig is None:
                divs.append(f'<p class="note">{kind}: no data (no successful request).</p>')
                continue
            key = f"r{r}/p{p_i}/{kind}"
            figs[key] = fig
            divs.append(f'<div class="chart" data-fig="{key}"></div>')
        parts.append(
            f'<div class="point" data-run="{r}" data-point="{html.escape(point.point_id)}" hidden>{"".join(divs)}</div>'
        )
    return "".join(parts)


def _ms(v: Any) -> str:
    return f"{v * 1e3:,.1f}" if isinstance(v, (int, float)) else "–"


def answer_first(runs: list[RunData]) -> str:
    """The one-screen summary at the top: per point, throughput, latency percentiles, errors, warnings."""
    header = ["point", "requests ok", "errors", "output tokens/s", "requests/s", "TTFT p50 / p99 (ms)",
              "ITL p50 / p99 (ms)", "E2E p50 / p99 (ms)"]  # fmt: skip
    rows, notes = [], []
    for run in runs:
        for p in run.summary.get("points") or []:
            if not isinstance(p, dict) or "counts" not in p:
                continue
            pid = html.escape((f"{run.run_id} " if len(runs) > 1 else "") + str(p.get("point_id", "")))
            counts, lat = p.get("counts") or {}, p.get("latency") or {}
            thr = (p.get("throughput") or {}).get("steady") or {}
            kinds = ((p.get("errors") or {}).get("by_kind")) or {}
            err = ", ".join(f"{html.escape(k)} {n}" for k, n in kinds.items()) or str(counts.get("errors", 0))
            if counts.get("incomplete"):
                err += f"; {counts['incomplete']} incomplete"
            pair = {k: f"{_ms((lat.get(k) or {}).get('p50'))} / {_ms((lat.get(k) or {}).get('p99'))}"
                    for k in ("ttft", "itl", "e2e")}  # fmt: skip
            tok, req = thr.get("output_tok_per_s"), thr.get("req_per_s")
            rows.append([pid, str(counts.get("ok", "–")), f'<span class="{"up" if kinds else ""}">{err}</span>',
                         f"{tok:,.1f}" if isinstance(tok, (int, float)) else "–",
                         f"{req:,.2f}" if isinstance(req, (int, float)) else "–",
                         pair["ttft"], pair["itl"], pair["e2e"]])  # fmt: skip
            notes += [f"{pid}: the client may be limiting this point: {html.escape(str(w))}"
                      for w in (p.get("client") or {}).get("warnings") or []]  # fmt: skip
    if not rows:
        return ""
    warn = "".join(f'<li class="up">{n}</li>' for n in notes)
    return ('<div class="answer"><h2>Summary</h2>'
            + _table(header, rows, "answer")
            + (f"<ul>{warn}</ul>" if warn else '<p class="note">No client warning: the load generator kept up.</p>')
            + '<p class="note">Throughput over the steady-state window; latencies over successful measured '
            "requests (docs/metrics.md).</p></div>")  # fmt: skip


def build_html(runs: list[RunData], plotly: str = "inline") -> str:
    figs: dict[str, Any] = {}
    body: list[str] = []
    title = "servelab report: " + ", ".join(r.run_id for r in runs)
    body.append(f"<h1>{html.escape(title)}</h1>")
    body.append('<p class="meta">' + " · ".join(html.escape(str(r.path)) for r in runs) + "</p>")
    body.append(answer_first(runs))

    sweep = figures.sweep(runs)
    if sweep is not None or len(runs) > 1:
        body.append("<h2>Sweep" + (" comparison" if len(runs) > 1 else "") + "</h2>")
    if sweep is not None:
        figs["sweep"] = sweep
        body.append('<div class="always"><div class="chart" data-fig="sweep"></div></div>')
    if len(runs) > 1:
        body.append(f"<h3>Difference vs {html.escape(runs[0].run_id)}</h3>" + diff_table(runs))

    for r, run in enumerate(runs):
        body.append(f"<h2>Run {html.escape(run.run_id)}</h2>")
        if run.points:
            body.append(_point_views(r, run, figs))
        else:
            body.append('<p class="note">No point has a requests.jsonl: nothing to draw.</p>')
        body.append("<h3>Summary (summary.json)</h3>" + summary_tables(run) + _meta_table(run))
    data = json.dumps({"figs": _jsonable(figs)}, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    template = resources.files("loadgen.report").joinpath("assets/report.html").read_text(encoding="utf-8")
    tag, src = _plotly_tag(plotly)
    return (
        template.replace("__TITLE__", html.escape(title))
        .replace("__CSP_SCRIPT__", src)
        .replace("__BODY__", "\n".join(body))
        .replace("__DATA__", data)
        .replace("__PLOTLY__", tag)
    )


def write_report(result_dirs: list[Path], out: Path, plotly: str = "inline") -> Path:
    """Write one HTML report of ``result_dirs`` (one run, or several compared) to ``out``; ``plotly``:
    ``inline`` (self-contained, works offline) or ``cdn`` (smaller file, needs the network to draw)."""
    if not result_dirs:
        raise ValueError("write_report needs at least one results directory")
    runs = [load_run(Path(d)) for d in result_dirs]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(build_html(runs, plotly), encoding="utf-8")
    tmp.replace(out)
    return out
