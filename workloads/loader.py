"""Loading a workload: a built-in name, a workload file or a trace, overrides applied.

    from workloads.loader import load_workload
    wl = load_workload("chat-short")                       # a built-in (workloads/builtin/*.toml)
    wl = load_workload("my.toml", rate=8.0)                # a workload file, arrival overridden
    wl = load_workload("trace.jsonl")                      # a Mooncake trace (.csv: Azure trace), or request bodies
    wl = load_workload("sharegpt.json")                    # ShareGPT conversations (workloads/datasets.py)
    wl = load_workload("data.jsonl", field="question")     # a text column
    for session in wl.sessions(seed=0): ...

Overrides (``None`` values are ignored, so CLI options can be passed straight through): ``tokenizer``,
``api``, ``process``, ``rate``, ``concurrency``, ``burstiness``, ``limit`` (trace rows), ``name``,
``output`` (every class's max_tokens; a dataset's where its data has none), ``field`` (a text dataset's key).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from workloads.base import ArrivalSpec, Workload
from workloads.contracts import APIS, ARRIVAL_PROCESSES
from workloads.dist import Dist
from workloads.spec import BUILTIN_DIR, DATASET_FORMATS, TraceSpec, WorkloadSpec, load_spec, trace_format
from workloads.validation import WorkloadError

OVERRIDES = ("tokenizer", "api", "process", "rate", "concurrency", "burstiness", "limit", "name", "output", "field")


def builtin_names() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.toml"))


def load_spec_for(name_or_path: str, **overrides: Any) -> WorkloadSpec:
    """The validated spec for a built-in name, a ``.toml`` file or a trace file, overrides applied."""
    path = Path(name_or_path)
    if path.suffix in (".jsonl", ".csv", ".json"):
        if not path.is_file():
            raise WorkloadError(name_or_path, "", "trace or dataset file not found")
        fmt = trace_format(path, overrides.get("field"))
        spec = WorkloadSpec(name=path.stem, source=str(path), arrival=ArrivalSpec(process="trace"),
                            trace=TraceSpec(path=path, format=fmt, field=overrides.get("field")))  # fmt: skip
    elif path.suffix == ".toml" or path.is_file():
        if not path.is_file():
            raise WorkloadError(name_or_path, "", "workload file not found")
        spec = load_spec(path)
    elif (BUILTIN_DIR / f"{name_or_path}.toml").is_file():
        spec = load_spec(BUILTIN_DIR / f"{name_or_path}.toml")
    else:
        raise WorkloadError(
            name_or_path,
            "",
            f"no such workload: not a file, and not a built-in ({', '.join(builtin_names())})",
        )
    return apply_overrides(spec, **overrides)


def apply_overrides(spec: WorkloadSpec, **overrides: Any) -> WorkloadSpec:
    given = {k: v for k, v in overrides.items() if v is not None}
    unknown = sorted(set(given) - set(OVERRIDES))
    if unknown:
        raise TypeError(f"unknown workload override(s) {unknown}; known: {', '.join(OVERRIDES)}")
    src = "override"
    if "api" in given and given["api"] not in APIS:
        raise WorkloadError(src, "api", f"expected one of {', '.join(APIS)}, got {given['api']!r}")
    if "process" in given and given["process"] not in ARRIVAL_PROCESSES:
        raise WorkloadError(
            src, "process", f"expected one of {', '.join(ARRIVAL_PROCESSES)}, got {given['process']!r}"
        )
    for key in ("rate", "burstiness"):
        if key in given and not (isinstance(given[key], (int, float)) and given[key] > 0):
            raise WorkloadError(src, key, f"expected a number > 0, got {given[key]!r}")
    for key in ("concurrency", "output"):
        if key in given and not (isinstance(given[key], int) and not isinstance(given[key], bool) and given[key] >= 1):
            raise WorkloadError(src, key, f"expected an integer >= 1, got {given[key]!r}")
    arrival = replace(
        spec.arrival, **{k: given[k] for k in ("process", "rate", "concurrency", "burstiness") if k in given}
    )
    spec = replace(spec, arrival=arrival, **{k: given[k] for k in ("tokenizer", "api", "name") if k in given})
    if given.get("api") == "chat":  # the server applies its own chat template
        spec = replace(spec, classes=tuple(replace(c, template="none") for c in spec.classes))
    if "field" in given and (spec.trace is None or spec.trace.format != "text"):
        raise WorkloadError(spec.source, "field", "only applies to a JSONL dataset of text (--dataset-field)")
    if "output" in given and spec.trace is not None and spec.trace.format in DATASET_FORMATS:
        spec = replace(spec, trace=replace(spec.trace, output=int(given["output"])))
    elif "output" in given:
        if spec.trace is not None:
            raise WorkloadError(spec.source, "output", "only applies to workloads with classes (a trace has its own)")
        output = Dist("fixed", value=float(given["output"]))
        spec = replace(spec, classes=tuple(replace(c, output=output) for c in spec.classes))
    if "limit" in given:
        if spec.trace is None:
            raise WorkloadError(spec.source, "limit", "only applies to trace workloads")
        spec = replace(spec, trace=replace(spec.trace, limit=int(given["limit"])))
    return spec


def load_workload(name_or_path: str, **overrides: Any) -> Workload:
    """A ready :class:`Workload`; raises :class:`WorkloadError` (file, key, expected) on bad input."""
    spec = load_spec_for(name_or_path, **overrides)
    if spec.trace is not None and spec.trace.format in DATASET_FORMATS:
        from workloads.datasets import DatasetWorkload

        return DatasetWorkload(spec)
    if spec.trace is not None:
        from workloads.traces import TraceWorkload

        return TraceWorkload(spec)
    from workloads.synthetic import SyntheticWorkload

    return SyntheticWorkload(spec)
