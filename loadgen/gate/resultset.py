"""One side of a gate comparison (:class:`ResultSet`): a result directory or a saved baseline file read into
trials per point, with the fingerprints that must match (:func:`comparable_config`, :func:`differences`); and
``bench baseline save`` (:func:`save_baseline`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadgen.defaults import RUN_FILE, SUMMARY_FILE
from loadgen.gate.rules import GateError
from loadgen.records.results import leaves, read_summary
from loadgen.records.writer import write_json
from loadgen.runoptions import RunOptions

BASELINE_FORMAT = "servelab-baseline/1"
_TRIAL = re.compile(r"/t(\d+)$")


@dataclass
class ResultSet:
    """One side of a comparison: trial values per point, with the fingerprints they ran under."""

    source: str
    fingerprint: dict[str, Any]
    environment: dict[str, Any]
    points: dict[str, list[dict[str, Any]]]  # base point id -> PointSummary per trial, in trial order
    paired: bool = False


def load(path: str | Path) -> ResultSet:
    """A result directory (its ``summary.json``), a ``summary.json`` or a saved baseline file."""
    p = Path(path)
    file = p / SUMMARY_FILE if p.is_dir() else p
    run_json = p / RUN_FILE if p.is_dir() else p.with_name(RUN_FILE)
    if p.is_dir() and not file.is_file():  # a run killed before its summary: recomputed from its records
        try:
            doc: Any = read_summary(p)[0]
        except (FileNotFoundError, ValueError) as exc:
            raise GateError(f"{path}: {exc}") from None
    elif not file.is_file():
        raise GateError(
            f"{path}: no such result (expected a results/<run_id>/ directory or a baseline .json)"
        )
    else:
        try:
            doc = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise GateError(f"{file}: not a readable JSON result: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("points"), list):
        raise GateError(f"{file}: no 'points' list; is this a servelab summary.json or baseline?")
    points: dict[str, list[dict[str, Any]]] = {}
    for pt in doc["points"]:
        pid = str(pt.get("point_id", ""))
        points.setdefault(_TRIAL.sub("", pid), []).append(pt)
    if not points:
        raise GateError(f"{file}: the result has no points")
    for trials in points.values():
        trials.sort(key=trial_index)
    return ResultSet(
        source=str(path),
        fingerprint=comparable_config(doc),
        environment={k: v for k, v in (doc.get("environment") or {}).items() if k not in ENV_IGNORED},
        points=points,
        paired=bool(doc.get("ab_paired", False)) or _run_flag(run_json, "ab_paired"),
    )


def _run_flag(run_json: Path, key: str) -> bool:
    """A flag from the ``run.json`` beside a ``summary.json`` (interleaved A/B runs mark themselves there)."""
    try:
        return bool(json.loads(run_json.read_text(encoding="utf-8")).get(key, False))
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


# Config keys that do not change what is measured (loadgen.runoptions.RunOptions marks them). Everything else in
# ``config`` (workload, load, model, API, client) must match; the seed need not (another sample of the same workload).
CONFIG_IGNORED = RunOptions.incomparable() | {"run_id"}  # run_id: results written before RunOptions
CONFIG_DEFAULTS = RunOptions.config_defaults()
ENV_IGNORED = frozenset({"load_average"})


def comparable_config(doc: dict[str, Any]) -> dict[str, Any]:
    """What must be equal for two results to be compared: the run config without :data:`CONFIG_IGNORED`
    (so a refusal can name the field), or the bare ``fingerprint`` when a result has no config."""
    config = doc.get("config")
    if isinstance(config, dict):  # a key newer than the result: it ran with that option's default
        return {k: v for k, v in {**CONFIG_DEFAULTS, **config}.items() if k not in CONFIG_IGNORED}
    fp = doc.get("fingerprint")
    return fp if isinstance(fp, dict) else {"fingerprint": fp}


def trial_index(pt: dict[str, Any]) -> int:
    """A trial's index: its ``trial`` field, else the ``/t<k>`` of its point id (0 without either)."""
    if isinstance(pt.get("trial"), int):
        return int(pt["trial"])
    m = _TRIAL.search(str(pt.get("point_id", "")))
    return int(m.group(1)) if m else 0


def save_baseline(result: str | Path, out: str | Path) -> dict[str, Any]:
    """Write the result's fingerprints and point summaries as a baseline file; returns it."""
    rs = load(result)  # validates the result
    src = Path(result)
    doc = json.loads((src / SUMMARY_FILE if src.is_dir() else src).read_text(encoding="utf-8"))
    baseline = {
        "format": BASELINE_FORMAT,
        "run_id": doc.get("run_id"),
        "fingerprint": doc.get("fingerprint"),
        "environment": doc.get("environment"),
        "config": doc.get("config"),
        "ab_paired": rs.paired,
        "points": doc["points"],
    }
    dest = Path(out)
    dest.parent.mkdir(parents=True, exist_ok=True)
    write_json(dest, baseline, sort_keys=True)
    return baseline


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Human-readable ``field: A != B`` for every leaf that differs."""
    la, lb = leaves(a), leaves(b)
    return [f"{k}: {la.get(k, '<absent>')!r} != {lb.get(k, '<absent>')!r}" for k in sorted(set(la) | set(lb))
            if la.get(k, "<absent>") != lb.get(k, "<absent>")]  # fmt: skip
