"""The one Prometheus text parser: the server-state poller, remote telemetry and experiments read with it."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def parse_metrics(text: str) -> tuple[dict[str, float], set[str]]:
    """Flat ``{"name{label=value,...}": value}`` of counters and gauges (histogram buckets dropped,
    ``_sum``/``_count`` kept), and the set of keys that are counters."""
    values: dict[str, float] = {}
    counters: set[str] = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith(("_bucket", "_created")):
                continue
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
