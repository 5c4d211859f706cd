"""An experiment: the reference server in several configurations, the same traffic against each, one table.

:func:`run_experiment` starts ``python -m reference_server`` once per :class:`Config` (through the
launcher), runs the experiment's points with the load engine into one results directory per
configuration (the server-state poller beside each point), then writes ``comparison.json`` /
``comparison.md`` (the table of its :class:`Column` s and the verdict computed from it);
:func:`write_experiment_report` then writes ``report.html``. The experiments themselves are in
:mod:`loadgen.experiments.catalog`, the command that runs one and prints its table in :mod:`loadgen.cli.experiment`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from backends.launcher import ServerProcess, bundled_model, free_port
from backends.profile import profile_of
from backends.registry import get_backend
from loadgen.defaults import REPORT_FILE
from loadgen.dispatch.signals import run_async
from loadgen.dispatch.sweep import PointPlan, run_sweep
from loadgen.metrics.definitions import Metric
from loadgen.records.results import ResultsDir, lookup
from loadgen.records.writer import write_json
from loadgen.sidecars.poller import ServerStatePoller
from loadgen.sidecars.prometheus import parse_metrics
from loadgen.timing.clock import RunClock

Summary = dict[str, Any]
POLL_HZ = 1.0
SPEC = "server.point.spec_decode"  # where a point summary keeps the poller's drafted/accepted counts


@dataclass
class Config:
    """One server configuration: a label and the extra ``python -m reference_server`` flags."""

    label: str
    server_args: list[str]


@dataclass
class Column:
    header: str
    get: Callable[[Summary, dict[str, Any]], float | str | None]  # (point summary, server extras)
    fmt: str = "{:.1f}"


@dataclass
class Experiment:
    name: str
    claim: str
    configs: list[Config]
    traffic: Callable[[bool], list[PointPlan]]  # quick -> the points every configuration gets
    columns: list[Column]
    verdict: Callable[[dict[str, list[Summary]], dict[str, dict[str, Any]]], str]
    common_args: list[str] = field(default_factory=list)  # server flags shared by all configurations
    # extra measurement against a running server: (base URL, its reference_server flags) -> values
    probe: Callable[[str, list[str]], dict[str, Any]] | None = None


def value_at(d: dict[str, Any], path: str) -> Any:
    return lookup(d, path.split("."))


def metric(path: str) -> Callable[[Summary, dict[str, Any]], Any]:
    return lambda s, _extra: value_at(s, path)


def figure(m: Metric, stat: str, cls: str | None = None, shown: bool = False, fmt: str = "{:.2f}") -> Column:
    """A column of a registry distribution at ``stat``: in seconds as ``summary.json`` has it (``E2E p99 s``) or,
    with ``shown``, in its shown unit (``TPOT p50 ms``); of workload class ``cls`` (``short E2E p99 s``)."""
    path = ".".join((*(("per_class", cls) if cls else ()), *m.path, stat))
    scale, unit = (m.scale, m.shown_unit) if shown else (1.0, m.unit)

    def get(s: Summary, _extra: dict[str, Any]) -> float | None:
        v = value_at(s, path)
        return None if v is None else v * scale

    return Column(" ".join(x for x in (cls, m.label, stat, unit) if x), get, fmt)


# -- scraping the reference server ------------------------------------------------------------------

def scrape_metrics(base_url: str) -> dict[str, float]:
    """Unlabelled samples of the server's Prometheus ``/metrics`` (name -> value), read with the one parser."""
    values, _ = parse_metrics(httpx.get(base_url + "/metrics", timeout=10).text)
    return {k: v for k, v in values.items() if "{" not in k}


def greedy_outputs(base_url: str, prompts: list[str], max_tokens: int) -> list[str]:
    """Non-streamed greedy completions (for checking that a configuration changes no output)."""
    texts = []
    with httpx.Client(base_url=base_url, timeout=300) as client:
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": False, "ignore_eos": True}
            resp = client.post("/v1/completions", json=body)
            resp.raise_for_status()
            texts.append(resp.json()["choices"][0]["text"])
    return texts


# -- running ----------------------------------------------------------------------------------------


def run_experiment(exp: Experiment, out: Path, quick: bool, model: Path | None,
                   say: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """Run every configuration of ``exp`` into ``out/<label>`` (``say``: a line of progress, rich markup);
    returns the comparison, written as ``comparison.json`` and ``comparison.md``."""
    out.mkdir(parents=True, exist_ok=True)
    model_path = str(model or bundled_model())
    per_config: dict[str, list[Summary]] = {}
    extras: dict[str, dict[str, Any]] = {}
    for cfg in exp.configs:
        port = free_port()
        argv = [sys.executable, "-m", "reference_server", "--model", model_path, "--port", str(port),
                *exp.common_args, *cfg.server_args]  # fmt: skip
        run_dir = out / cfg.label
        say(f"[bold]{exp.name}[/] / {cfg.label}: {' '.join(argv[3:])}")
        with ServerProcess(argv, port, run_dir / "server.log") as srv:
            served = httpx.get(srv.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
            backend = get_backend("openai")(srv.base_url, model=served)
            config = {"experiment": exp.name, "configuration": cfg.label, "server_args": argv[3:], "quick": quick}
            t0 = time.monotonic()
            # the server's counters (speculative tokens among them) through the one poller, at a rate that
            # costs the server nothing measurable; it restarts with each point
            poller = ServerStatePoller(srv.base_url, profile_of(backend), hz=POLL_HZ)
            summaries = run_async(run_sweep(backend, exp.traffic(quick), ResultsDir(run_dir), RunClock(), config,
                                            [poller]))
            extra: dict[str, Any] = {"seconds": time.monotonic() - t0, "metrics": scrape_metrics(srv.base_url)}
            if exp.probe is not None:
                extra.update(exp.probe(srv.base_url, argv[3:]))
        per_config[cfg.label] = summaries
        extras[cfg.label] = extra
    comparison = _comparison(exp, per_config, extras, quick)
    write_json(out / "comparison.json", comparison)
    (out / "comparison.md").write_text(_markdown(comparison))
    return comparison


def write_experiment_report(exp: Experiment, out: Path, comparison: dict[str, Any], say: Callable[[str], None]) -> None:
    """``out/report.html`` of every configuration's run (its path then in ``comparison["report"]``); a
    failure is said, not raised: the table is the result, and a report failure must not lose it."""
    try:
        from loadgen.report import write_report

        write_report([out / cfg.label for cfg in exp.configs], out / REPORT_FILE)
        comparison["report"] = str(out / REPORT_FILE)
    except Exception as exc:  # the table is the result; a report failure must not lose it
        say(f"[yellow]report not written: {type(exc).__name__}: {exc}[/]")


def _comparison(exp: Experiment, per_config: dict[str, list[Summary]], extras: dict[str, dict[str, Any]],
                quick: bool) -> dict[str, Any]:  # fmt: skip
    rows = []
    for label, summaries in per_config.items():
        for s in summaries:
            cells = {c.header: c.get(s, extras[label]) for c in exp.columns}
            rows.append({"config": label, "point": s["point_id"], **cells})
    return {
        "experiment": exp.name, "claim": exp.claim, "quick": quick,
        "columns": ["config", "point", *(c.header for c in exp.columns)],
        "formats": {c.header: c.fmt for c in exp.columns}, "rows": rows,
        "verdict": exp.verdict(per_config, extras),
        "seconds": {label: e["seconds"] for label, e in extras.items()},
        "probes": {label: {k: v for k, v in e.items() if k not in ("seconds", "metrics")} for label, e in extras.items()},
    }  # fmt: skip


def cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float | int) and not isinstance(value, bool):
        return fmt.format(value)
    return str(value)


def _markdown(c: dict[str, Any]) -> str:
    cols = c["columns"]
    lines = [f"# experiment {c['experiment']}", "", c["claim"], "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]  # fmt: skip
    for r in c["rows"]:
        lines.append("| " + " | ".join(cell(r[k], c["formats"].get(k, "{}")) for k in cols) + " |")
    lines += ["", f"**verdict**: {c['verdict']}", ""]
    return "\n".join(lines)
