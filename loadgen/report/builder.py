"""Assemble the self-contained HTML report: the page is the Jinja template ``assets/report.html`` over the
tables and views built here, charts as plotly specs in one JSON blob, plotly.js once per report: inlined
by default (no network at all), or from the plotly CDN.

The plotly.js is the official "basic" partial bundle (scatter, bar, pie: every trace type the report
draws; 1.2 MB instead of the full bundle's 4.8 MB), vendored gzipped from npm's
``plotly.js-basic-dist-min`` by ``scripts/vendor_plotly.sh``."""

from __future__ import annotations

import functools
import gzip
import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2
import numpy as np

from loadgen.metrics.definitions import (
    CACHE_HIT_RATE,
    E2E,
    GOODPUT,
    INPUTS_S,
    ITL,
    OUTPUT_TOK_S,
    REQ_S,
    TTFT,
    Metric,
)
from loadgen.metrics.pointsummary import QUALITY_HEADER, QUALITY_NOTE, pooling, quality_cells, reasoning_note
from loadgen.records.results import leaves
from loadgen.report import cdf, sweep_chart, timeline
from loadgen.report.load import RunData, load_run
from loadgen.report.server_series import missing_series

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


def jsonable(obj: Any) -> Any:
    """Numpy arrays -> lists rounded to SIG_DIGITS significant digits, NaN -> null (a gap in plotly)."""
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind in "fc":
            return [float(f"{v:.{SIG_DIGITS}g}") if math.isfinite(v) else None for v in obj.tolist()]
        return [jsonable(v) for v in obj.tolist()]
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (np.floating, float)):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def cell(v: Any) -> str:
    """How a summary.json value is shown: strings as they are, everything else exactly as JSON writes it."""
    return v if isinstance(v, str) else json.dumps(v)


@dataclass(frozen=True)
class Span:
    """A table cell drawn in a colour class (``up``: worse, ``down``: better)."""

    text: str
    cls: str = ""


Cell = str | Span


@dataclass
class Table:
    header: list[str]
    rows: list[list[Cell]]
    cls: str
    attrs: dict[str, str] = field(default_factory=dict)


OPEN_GROUPS = ("point", "load", "counts", "latency", "throughput", "errors", "goodput")


def summary_tables(run: RunData) -> list[dict[str, Any]]:
    """Every value of every PointSummary in summary.json, verbatim: one table per top-level group (a row
    per dotted key, a column per point); the main groups open, the rest (per class, client, server
    state, telemetry, ...) folded."""
    pts = [p for p in run.summary.get("points") or [] if isinstance(p, dict)]
    ids = [str(p.get("point_id", p.get("id", i))) for i, p in enumerate(pts)]
    groups: dict[str, list[dict[str, Any]]] = {}
    for p in pts:
        for g in [k for k, v in p.items() if isinstance(v, dict)] + ["point"]:
            groups.setdefault(g, [])
    for g in groups:
        groups[g] = [{k: v for k, v in p.items() if not isinstance(v, dict)} if g == "point"
                     else leaves(p.get(g) or {}, g) for p in pts]  # fmt: skip
    out = []
    for g in sorted(groups, key=lambda g: (OPEN_GROUPS.index(g) if g in OPEN_GROUPS else len(OPEN_GROUPS), g)):
        flats = groups[g]
        keys = list(dict.fromkeys(k for f in flats for k in f))
        if keys:
            rows: list[list[Cell]] = [[k] + [cell(f[k]) if k in f else "" for f in flats] for k in keys]
            table = Table(["metric", *ids], rows, "summary", {"data-run": run.run_id, "data-group": g})
            out.append({"name": g, "open": g in OPEN_GROUPS, "table": table})
    return out


def _meta_table(run: RunData) -> Table:
    flat = leaves({k: run.summary[k] for k in ("config", "environment", "fingerprint") if k in run.summary})
    return Table(["field", "value"], [[k, cell(v)] for k, v in flat.items()], "meta")


# The sweep rows' figures the diff compares, by the registry metric each is (p50, p99: E2E, else TTFT: both latencies).
DIFF_METRICS = {"throughput": OUTPUT_TOK_S, "goodput": GOODPUT, "p50": E2E, "p99": E2E}


def diff_table(runs: list[RunData]) -> Table | None:
    """Key sweep metrics of each run beside the first (baseline), matched by point id, with the change;
    None when no point id is shared."""
    per_run = [{r["point_id"]: r for r in sweep_chart.sweep_rows(run)} for run in runs]
    base = per_run[0]
    header = ["point", "metric", runs[0].run_id]
    for run in runs[1:]:
        header += [run.run_id, "Δ %"]
    rows = []
    for pid, b in base.items():
        if not any(pid in other for other in per_run[1:]):
            continue
        for m in DIFF_METRICS:
            if b[m] is None:
                continue
            row: list[Cell] = [pid, b[m + "_key"], f"{b[m]:.5g}"]
            for other in per_run[1:]:
                o = other.get(pid, {}).get(m)
                if o is None:
                    row += ["", ""]
                    continue
                pct = (o - b[m]) / b[m] * 100 if b[m] else math.nan
                better = (pct > 0) == DIFF_METRICS[m].higher_is_better
                row += [f"{o:.5g}", Span(f"{pct:+.1f}", "down" if better else "up") if math.isfinite(pct) else ""]
            rows.append(row)
    return Table(header, rows, "diff") if rows else None


def _point_views(r: int, run: RunData, figs: dict[str, Any]) -> list[dict[str, Any]]:
    """Per point: what was not recorded, and its timeline and CDFs (figure keys into ``figs``, None when a
    chart has no data)."""
    views = []
    for p_i, point in enumerate(run.points):
        charts: list[tuple[str, str | None]] = []
        for kind, fig in (("timeline", timeline.timeline(run, point)), ("cdf", cdf.distributions(point))):
            key = f"r{r}/p{p_i}/{kind}" if fig is not None else None
            if key is not None:
                figs[key] = fig
            charts.append((kind, key))
        views.append({"point_id": point.point_id, "requests": len(point.requests),
                      "missing": missing_series(run, point), "charts": charts})  # fmt: skip
    return views


def _shown(m: Metric, v: Any) -> str:
    return f"{v * m.scale:,.1f}" if isinstance(v, (int, float)) else "–"


def _share(pc: Any) -> Cell:
    """A point's prefix-cache hit rate, marked where it is a warning."""
    rate = pc.get("hit_rate") if isinstance(pc, dict) else None
    if not isinstance(rate, (int, float)):
        return "–"
    return Span(f"{rate:.0%}", "up" if pc.get("warning") else "")


ANSWER_LATENCIES = (TTFT, ITL, E2E)  # the answer table's latency columns, each p50 / p99


def answer_first(runs: list[RunData]) -> dict[str, Any] | None:
    """The one-screen summary at the top: per point, throughput, latency percentiles, errors, warnings (a
    pooling run's, embeddings or rerank: inputs/s and E2E, as it generates no token)."""
    points = [(run, p) for run in runs for p in run.summary.get("points") or [] if isinstance(p, dict) and "counts" in p]
    pooled = bool(points) and all(pooling(p) for _, p in points)
    tput, lats = (INPUTS_S, (E2E,)) if pooled else (OUTPUT_TOK_S, ANSWER_LATENCIES)
    header = ["point", "requests ok", "errors", tput.label, REQ_S.label,
              *(f"{m.label} p50 / p99 ({m.shown_unit})" for m in lats), CACHE_HIT_RATE.name]  # fmt: skip
    rows: list[list[Cell]] = []
    notes: list[str] = []
    for run, p in points:
        pid = (f"{run.run_id} " if len(runs) > 1 else "") + str(p.get("point_id", ""))
        counts = p.get("counts") or {}
        kinds = ((p.get("errors") or {}).get("by_kind")) or {}
        err = ", ".join(f"{k} {n}" for k, n in kinds.items()) or str(counts.get("errors", 0))
        if counts.get("incomplete"):
            err += f"; {counts['incomplete']} incomplete"
        tok, req = tput.of(p), REQ_S.of(p)
        rows.append([pid, str(counts.get("ok", "–")), Span(err, "up" if kinds else ""),
                     f"{tok:,.1f}" if isinstance(tok, (int, float)) else "–",
                     f"{req:,.2f}" if isinstance(req, (int, float)) else "–",
                     *(f"{_shown(m, m.of(p, 'p50'))} / {_shown(m, m.of(p, 'p99'))}" for m in lats),
                     _share(p.get("prefix_cache"))])  # fmt: skip
        notes += [f"{pid}: the client may be limiting this point: {w}"
                  for w in (p.get("client") or {}).get("warnings") or []]  # fmt: skip
        notes += [f"{pid}: {w}" for key in ("prefix_cache", "prompt_lengths") if (w := (p.get(key) or {}).get("warning"))]
        notes += [f"{pid}: {r}"] if "latency" in p and (r := reasoning_note(p)) else []
    return {"table": Table(header, rows, "answer"), "notes": notes} if rows else None


def quality_table(runs: list[RunData]) -> Table | None:
    """bench verify's points against the reference each was compared with; None when no point has ``quality``."""
    rows: list[list[Cell]] = []
    for run in runs:
        for p in run.summary.get("points") or []:
            if isinstance(p, dict) and isinstance(q := p.get("quality"), dict):
                *cells, verdict = quality_cells((f"{run.run_id} " if len(runs) > 1 else "") + str(p["point_id"]), q)
                rows.append([*cells, Span(verdict, "down" if verdict == "pass" else "up")])
    return Table(list(QUALITY_HEADER), rows, "quality") if rows else None


@functools.cache
def _template() -> jinja2.Template:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("loadgen.report", "assets"), autoescape=True, undefined=jinja2.StrictUndefined
    )
    return env.get_template("report.html")


def build_html(runs: list[RunData], plotly: str = "inline") -> str:
    """The report page: the figures computed here, the page laid out by ``assets/report.html`` (Jinja,
    every value escaped)."""
    figs: dict[str, Any] = {}
    sweep = sweep_chart.sweep(runs)
    if sweep is not None:
        figs["sweep"] = sweep
    views = [{"run_id": run.run_id, "points": _point_views(r, run, figs), "groups": summary_tables(run),
              "meta": _meta_table(run)} for r, run in enumerate(runs)]  # fmt: skip
    data = json.dumps({"figs": jsonable(figs)}, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    tag, src = _plotly_tag(plotly)
    return _template().render(
        title="servelab report: " + ", ".join(r.run_id for r in runs), paths=[str(r.path) for r in runs],
        answer=answer_first(runs), quality=quality_table(runs), quality_note=QUALITY_NOTE, sweep=sweep is not None, diff=diff_table(runs) if len(runs) > 1 else None,
        runs=views, csp_script=src, plotly_tag=tag, data=data,
    )  # fmt: skip


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
