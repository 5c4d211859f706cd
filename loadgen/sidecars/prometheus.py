"""The one Prometheus text parser: the server-state poller, remote telemetry and experiments read with it."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

_DROPPED = ("_bucket", "_created")  # sample names no reader of these values uses


def _kept_lines(text: str) -> str:
    """``text`` without what :func:`parse_metrics` would drop: ``# HELP`` lines and the samples named in
    :data:`_DROPPED`. The library's parser walks every character of a label set in Python (~25 µs a
    sample); most of a histogram-heavy scrape is buckets, and the poller parses one every tick."""
    kept = []
    for line in text.splitlines():
        if line.startswith("# HELP"):
            continue
        if not line.startswith("#"):
            name = line.split("{", 1)[0].split(None, 1)
            if name and name[0].endswith(_DROPPED):
                continue
        kept.append(line)
    return "\n".join(kept) + "\n"


def parse_metrics(text: str) -> tuple[dict[str, float], set[str]]:
    """Flat ``{"name{label=value,...}": value}`` of counters and gauges (histogram buckets dropped,
    ``_sum``/``_count`` kept), and the set of keys that are counters."""
    values: dict[str, float] = {}
    counters: set[str] = set()
    for family in text_string_to_metric_families(_kept_lines(text)):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            key = f"{sample.name}{{{labels}}}" if labels else sample.name
            values[key] = float(sample.value)
            if family.type in ("counter", "histogram", "summary"):
                counters.add(key)
    return values, counters


def split_key(key: str) -> tuple[str, dict[str, str]]:
    """``name{a=1,b=2}`` (as :func:`parse_metrics` writes it) -> base name and labels."""
    name, _, rest = key.partition("{")
    name = name.removesuffix("_total")  # the parser adds it to counters whatever the exporter wrote
    labels = dict(part.split("=", 1) for part in rest.rstrip("}").split(",") if "=" in part)
    return name, labels
