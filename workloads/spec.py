"""Workload files: TOML in, validated dataclasses out.

Every problem is reported as a :class:`~workloads.validation.WorkloadError` naming the file, the key and
what was expected. The format is documented in ``docs/workloads.md``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from workloads.base import ArrivalSpec
from workloads.contracts import APIS, ARRIVAL_PROCESSES, POOLING_APIS
from workloads.dist import Dist, parse_dist
from workloads.validation import Table, WorkloadError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"  # the built-in workloads, by name
EXPERIMENTS_DIR = Path(__file__).resolve().parent / "experiments"  # the traffic of `bench experiment NAME`
CONTENTS = ("corpus", "code-edit", "creative")
TEMPLATES = ("none", "chatml")
DATASET_FORMATS = ("sharegpt", "openai", "text")  # recorded requests (workloads/datasets.py)
TRACE_FORMATS = ("mooncake", "azure", *DATASET_FORMATS)  # lengths and times only (workloads/traces.py), or datasets


def trace_format(path: Path, field: str | None = None) -> str:
    """A recorded-traffic file's format: ``.csv`` Azure, ``.json`` ShareGPT, ``.jsonl`` by its first object
    (Mooncake's ``input_length``, request bodies' ``messages``/``prompt``), or a text column with ``field``."""
    if field is not None:
        return "text"
    if path.suffix == ".csv":
        return "azure"
    if path.suffix == ".json":
        return "sharegpt"
    with open(path, encoding="utf-8") as f:
        line = next((ln for ln in f if ln.strip()), None)
    if line is None:
        raise WorkloadError(str(path), "", "the file is empty")
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise WorkloadError(str(path), "line 1", f"expected a JSON object: {exc.msg}") from exc
    if isinstance(obj, dict) and "input_length" in obj:
        return "mooncake"
    if isinstance(obj, dict) and ("messages" in obj or "prompt" in obj):
        return "openai"
    keys = sorted(obj) if isinstance(obj, dict) else []
    raise WorkloadError(str(path), "line 1", "neither a Mooncake trace (input_length) nor request bodies (messages "
                        f"or prompt): name the prompt's key with --dataset-field (its keys: {keys})")  # fmt: skip


@dataclass(frozen=True)
class SharedPrefix:
    tokens: int  # length of each shared prefix
    fraction: float = 1.0  # share of the class's requests that start with one
    count: int = 1  # distinct prefixes (e.g. documents); a request picks one uniformly


@dataclass(frozen=True)
class Turns:
    count: Dist  # turns per conversation
    think_time: Dist  # seconds between a response and the next user turn


@dataclass(frozen=True)
class ClassSpec:
    name: str
    weight: float = 1.0
    prompt: Dist = field(default_factory=lambda: Dist("fixed", value=128))  # tokens (new user text per turn)
    output: Dist | None = None  # max_tokens; None: the content's default (see synthetic.py)
    content: str = "corpus"
    template: str = "none"
    ignore_eos: bool = True
    temperature: float = 0.0
    shared_prefix: SharedPrefix | None = None
    turns: Turns | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    at: tuple[float, ...] | None = None  # send times (s): one request each, the workload is the schedule
    model: str | None = None  # the served model or LoRA adapter its requests ask for (default: --model's)
    inputs: int | None = None  # a pooling request's texts (embeddings inputs, rerank documents), each a `prompt` long


@dataclass(frozen=True)
class TraceSpec:
    path: Path
    format: str  # TRACE_FORMATS: "mooncake" | "azure" traces, "sharegpt" | "openai" | "text" datasets (datasets.py)
    limit: int | None = None  # first N rows only
    field: str | None = None  # format "text": the JSONL key holding each prompt
    output: int | None = None  # a dataset's max_tokens for requests whose data says none (or all: the override)


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    source: str  # file it came from (for messages and describe)
    description: str = ""
    tokenizer: str = "bundled"
    api: str = "completions"
    arrival: ArrivalSpec = field(default_factory=ArrivalSpec)
    classes: tuple[ClassSpec, ...] = ()
    trace: TraceSpec | None = None


def _parse_arrival(t: Table | None) -> ArrivalSpec:
    if t is None:
        return ArrivalSpec()
    spec = ArrivalSpec(
        process=t.choice("process", ARRIVAL_PROCESSES),
        rate=t.number("rate", positive=True),
        concurrency=t.integer("concurrency", minimum=1),
        burstiness=t.number("burstiness", positive=True),
    )
    t.done()
    return spec


def _parse_class(value: object, source: str, key: str, index: int) -> ClassSpec:
    t = Table(value, source, key)
    name = t.get("name", str, f"class{index}")
    content = t.choice("content", CONTENTS, "corpus") or "corpus"
    prompt_raw = t.raw("prompt")
    if content != "corpus" and prompt_raw is not None:
        raise t.error(
            "prompt", f"not allowed with content = {content!r} (its prompt length is that of its text)"
        )
    prompt = (
        parse_dist(prompt_raw, source, t.key("prompt"))
        if prompt_raw is not None
        else Dist("fixed", value=128)
    )
    output_raw = t.raw("output")
    output = parse_dist(output_raw, source, t.key("output")) if output_raw is not None else None
    prefix = None
    if (pt := t.table("shared_prefix")) is not None:
        fraction = pt.number("fraction", 1.0, minimum=0) or 0.0
        if fraction > 1:
            raise pt.error("fraction", f"expected a number between 0 and 1, got {fraction:g}")
        prefix = SharedPrefix(tokens=pt.integer("tokens", required=True, minimum=1) or 1, fraction=fraction,
                              count=pt.integer("count", 1, minimum=1) or 1)  # fmt: skip
        pt.done()
    turns = None
    if (tt := t.table("turns")) is not None:
        count_raw = tt.raw("count")
        if count_raw is None:
            raise tt.error("count", "is required (a number or a distribution table)")
        think_raw = tt.raw("think_time")
        turns = Turns(
            count=parse_dist(count_raw, source, tt.key("count")),
            think_time=parse_dist(
                think_raw if think_raw is not None else 0, source, tt.key("think_time"), integer=False
            ),
        )
        tt.done()
    at = None
    if (at_raw := t.get("at", list)) is not None:
        if not at_raw or any(isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 for v in at_raw):
            raise t.error("at", f"expected a non-empty array of send times in seconds >= 0, got {at_raw!r}")
        if turns is not None:
            raise t.error("at", "not allowed together with turns (a scheduled request is one turn)")
        at = tuple(float(v) for v in at_raw)
    spec = ClassSpec(
        name=name,
        weight=t.number("weight", 1.0, positive=True) or 1.0,
        prompt=prompt,
        output=output,
        content=content,
        template=t.choice("template", TEMPLATES, "none") or "none",
        ignore_eos=t.get("ignore_eos", bool, True),
        temperature=t.number("temperature", 0.0, minimum=0) or 0.0,
        shared_prefix=prefix,
        turns=turns,
        extra_body=t.get("extra_body", dict, {}),
        at=at,
        inputs=t.integer("inputs", minimum=1),
        model=t.get("model", str),
    )
    t.done()
    return spec


def parse_spec(data: dict[str, Any], source: str, base_dir: Path | None = None) -> WorkloadSpec:
    """Validate a parsed TOML document; relative paths resolve against ``base_dir``."""
    t = Table(data, source, "")
    name = t.get("name", str, Path(source).stem)
    tokenizer = t.get("tokenizer", str, "bundled")
    if tokenizer != "bundled" and base_dir is not None and not Path(tokenizer).is_absolute():
        tokenizer = str(base_dir / tokenizer)
    api = t.choice("api", APIS, "completions") or "completions"
    arrival = _parse_arrival(t.table("arrival"))
    trace = None
    if (tr := t.table("trace")) is not None:
        path = Path(tr.get("path", str, required=True))
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        field_name = tr.get("field", str)
        fmt = tr.choice("format", TRACE_FORMATS) or (trace_format(path, field_name) if path.is_file() else "mooncake")
        if (fmt == "text") != (field_name is not None):
            raise t.error("trace.field", "names the prompt's key of a text dataset: with format \"text\", and only then")
        trace = TraceSpec(path=path, format=fmt, limit=tr.integer("limit", minimum=1), field=field_name,
                          output=tr.integer("output", minimum=1))  # fmt: skip
        tr.done()
    raw_classes = t.raw("classes")
    classes: list[ClassSpec] = []
    if raw_classes is not None:
        if not isinstance(raw_classes, list) or not raw_classes:
            raise t.error(
                "classes", f"expected a non-empty array of tables ([[classes]]), got {raw_classes!r}"
            )
        classes = [_parse_class(c, source, f"classes[{i}]", i) for i, c in enumerate(raw_classes)]
    if trace is None and not classes:
        raise t.error("classes", "is required: at least one [[classes]] table (or a [trace] table)")
    if trace is not None and classes:
        raise t.error("classes", "not allowed together with [trace] (a trace brings its own requests)")
    if trace is not None and arrival.process is None:
        arrival = ArrivalSpec(process="trace", rate=arrival.rate, concurrency=arrival.concurrency,
                              burstiness=arrival.burstiness)  # fmt: skip
    scheduled = [c.at is not None for c in classes]
    if any(scheduled):
        if not all(scheduled):
            bad = scheduled.index(False)
            raise WorkloadError(source, f"classes[{bad}].at", "is required when another class has one (a schedule)")
        if arrival.process not in (None, "trace"):
            raise WorkloadError(source, "arrival.process", "expected 'trace' with scheduled classes (at = [...])")
        arrival = replace(arrival, process="trace")
    if api not in POOLING_APIS and any(c.inputs is not None for c in classes):
        bad = next(i for i, c in enumerate(classes) if c.inputs is not None)
        raise WorkloadError(source, f"classes[{bad}].inputs",
                            f"only applies with api = {' or '.join(map(repr, POOLING_APIS))} (texts per request)")  # fmt: skip
    names = [c.name for c in classes]
    for i, n in enumerate(names):
        if names.index(n) != i:
            raise WorkloadError(
                source, f"classes[{i}].name", f"expected a unique class name, {n!r} is used twice"
            )
    if api == "chat" and any(c.template != "none" for c in classes):
        bad = next(i for i, c in enumerate(classes) if c.template != "none")
        raise WorkloadError(
            source,
            f"classes[{bad}].template",
            "expected 'none' with api = 'chat' (the server applies its chat template)",
        )
    spec = WorkloadSpec(name=name, source=source, description=t.get("description", str, ""), tokenizer=tokenizer,
                        api=api, arrival=arrival, classes=tuple(classes), trace=trace)  # fmt: skip
    t.done()
    return spec


def load_spec(path: str | Path) -> WorkloadSpec:
    """Read and validate one workload file."""
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise WorkloadError(source, "", f"cannot read the file: {exc.strerror or exc}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise WorkloadError(source, "", f"not valid TOML: {exc}") from exc
    return parse_spec(data, source, path.parent)
