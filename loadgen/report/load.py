"""Read result directories (docs/architecture.md layout) into plain, array-friendly structures.

Only ``points/<id>/requests.jsonl`` is required (without ``summary.json`` the summary is recomputed from
the records: :func:`loadgen.records.results.read_summary`); every other series is optional
and simply absent from the report when its file is missing or empty.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.defaults import REQUESTS_FILE, RUN_FILE, SUMMARY_FILE
from loadgen.metrics import definitions as metrics
from loadgen.records.results import read_summary
from workloads import contracts


class ReportInputError(ValueError):
    """A results directory that cannot be reported on (missing or malformed files)."""


@dataclass
class Requests:
    """Per-request arrays on the run clock; NaN where a time does not exist (e.g. no first token)."""

    ids: list[str]
    cls: np.ndarray  # object array of class names
    intended: np.ndarray
    sent: np.ndarray
    first: np.ndarray  # first content-carrying event
    end: np.ndarray
    output_tokens: np.ndarray  # float, NaN when unknown
    error: np.ndarray  # object array: error kind or None
    event_t: np.ndarray  # all events, flattened
    event_tokens: np.ndarray  # as loadgen.metrics.definitions counts them (an unresolved count is one token)
    event_req: np.ndarray  # index of the request each event belongs to
    # per-request latencies of loadgen.metrics.definitions (NaN where undefined), and the ITL samples with their request
    ttft: np.ndarray
    e2e: np.ndarray
    tpot: np.ndarray
    itl: np.ndarray
    itl_req: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class PointData:
    point_id: str
    summary: dict[str, Any]
    requests: Requests
    server_state: list[dict[str, Any]] = field(default_factory=list)
    iterations: list[dict[str, Any]] = field(default_factory=list)
    telemetry: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class RunData:
    path: Path
    run_id: str
    run: dict[str, Any]
    summary: dict[str, Any]
    points: list[PointData]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ReportInputError(
            f"{path} is missing: is this a results directory written by `bench run`?"
        ) from exc
    except json.JSONDecodeError as exc:
        raise ReportInputError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from exc


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """:func:`contracts.read_jsonl` for a report: a missing file is an empty series, a bad line a
    :class:`ReportInputError`."""
    try:
        return contracts.read_jsonl(path, missing_ok=True)
    except contracts.JsonlError as exc:
        raise ReportInputError(str(exc)) from None


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else float("nan")


def requests_from_records(records: list[dict[str, Any]]) -> Requests:
    """Arrays of the non-warm-up records (warm-up requests are excluded from every chart, like metrics);
    every latency comes from :mod:`loadgen.metrics.definitions`, so the charts show the summary's definitions."""
    recs = [_normal(r) for r in records if not r.get("warmup")]
    n = len(recs)
    ev_t: list[float] = []
    ev_k: list[int] = []
    ev_i: list[int] = []
    first, ttft, e2e, tpot = (np.full(n, np.nan) for _ in range(4))
    itl: list[np.ndarray] = []
    itl_req: list[np.ndarray] = []
    for i, r in enumerate(recs):
        for e in r["events"]:
            ev_t.append(e[0])
            ev_k.append(metrics.tokens_of(e))
            ev_i.append(i)
        if r["events"]:
            first[i] = r["events"][0][0]
            ttft[i] = metrics.ttft(r)
        e2e[i] = metrics.e2e(r)
        tpot[i] = _nan(metrics.tpot(r))
        samples = metrics.itl(r)
        itl.append(samples)
        itl_req.append(np.full(samples.size, i, dtype=np.int64))
    return Requests(
        ids=[str(r.get("id")) for r in recs],
        cls=np.array([r.get("cls") or "default" for r in recs], dtype=object),
        intended=np.array([_num(r.get("intended")) for r in recs]),
        sent=np.array([_num(r.get("sent")) for r in recs]),
        first=first,
        end=np.array([_num(r.get("end")) for r in recs]),
        output_tokens=np.array([_num(r.get("output_tokens")) for r in recs]),
        error=np.array(
            [(r.get("error") or {}).get("kind") if r.get("error") else None for r in recs], dtype=object
        ),
        event_t=np.array(ev_t, dtype=float),
        event_tokens=np.array(ev_k, dtype=float),
        event_req=np.array(ev_i, dtype=np.int64),
        ttft=ttft,
        e2e=e2e,
        tpot=tpot,
        itl=np.concatenate(itl) if itl else np.empty(0),
        itl_req=np.concatenate(itl_req) if itl_req else np.empty(0, dtype=np.int64),
    )


def _normal(r: dict[str, Any]) -> dict[str, Any]:
    """A record with the fields the metric functions read (hand-written or older files may lack some)."""
    return {**r, "events": r.get("events") or [], "sent": _num(r.get("sent")), "end": _num(r.get("end")),
            "output_tokens": r.get("output_tokens")}  # fmt: skip


def _nan(v: float | None) -> float:
    return float("nan") if v is None else v


def _point_dirs(root: Path) -> list[Path]:
    """Point directories (any depth: ids like ``np4-ub128/chat-short/c016/t0`` nest)."""
    base = root / "points"
    if not base.is_dir():
        return []
    return sorted(p.parent for p in base.rglob(REQUESTS_FILE))


def load_run(path: Path) -> RunData:
    path = Path(path)
    if not path.is_dir():
        raise ReportInputError(f"{path} is not a directory: pass a results/<run_id> directory")
    try:
        summary, _ = read_summary(path)
    except FileNotFoundError as exc:
        raise ReportInputError(str(exc)) from None
    except json.JSONDecodeError as exc:
        raise ReportInputError(f"{path / 'summary.json'} is not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(summary, dict):
        raise ReportInputError(f"{path / 'summary.json'} must hold a JSON object")
    run = _read_json(path / RUN_FILE) if (path / RUN_FILE).is_file() else {}
    by_id = {
        str(p.get("point_id", p.get("id"))): p for p in summary.get("points") or [] if isinstance(p, dict)
    }
    points: list[PointData] = []
    for d in _point_dirs(path):
        pid = d.relative_to(path / "points").as_posix()
        psum = by_id.get(pid)
        if psum is None and (d / SUMMARY_FILE).is_file():
            psum = _read_json(d / SUMMARY_FILE)
        points.append(
            PointData(
                point_id=pid,
                summary=psum or {},
                requests=requests_from_records(read_jsonl(d / REQUESTS_FILE)),
                server_state=read_jsonl(d / "server_state.jsonl"),
                iterations=read_jsonl(d / "iterations.jsonl"),
                telemetry=read_jsonl(d / "telemetry.jsonl"),
            )
        )
    order = {pid: i for i, pid in enumerate(by_id)}
    points.sort(key=lambda p: (order.get(p.point_id, len(order)), p.point_id))
    run_id = str(summary.get("run_id") or run.get("run_id") or path.name)
    return RunData(path=path, run_id=run_id, run=run, summary=summary, points=points)
