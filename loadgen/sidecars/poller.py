"""Server-state poller: a sidecar that samples a server's own counters during one load point.

Every ``1/hz`` seconds it scrapes ``/metrics`` (Prometheus text, :mod:`loadgen.sidecars.prometheus`) and, where
the server has one, ``/slots`` (llama.cpp). Each sample is stamped on the run clock with the time
the scrape started and the scrape's latency, and appended to ``server_state.jsonl``. At the end it
reconciles counters: the delta of every ``counter`` sample over the point (and over the steady-state
window), rates derived from those deltas, gauge mean/max, and speculative-decoding acceptance and
prefix-cache hits when the server exposes their counters. When the server offers ``/v1/iterations`` (the bundled
reference server), its per-iteration records for the point are written to ``iterations.jsonl``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from backends.profile import DEFAULT_PROFILE, PrefixCounters, ServerProfile
from backends.registry import server_profiles
from loadgen.metrics.percentiles import stats
from loadgen.sidecars.prometheus import parse_metrics
from loadgen.sidecars.sampler import ThreadedSampler
from loadgen.timing.clock import RunClock


def _compact_slot(slot: dict[str, Any]) -> dict[str, Any]:
    nxt = (slot.get("next_token") or [{}])[0]
    return {
        "id": slot.get("id"),
        "busy": bool(slot.get("is_processing")),
        "task": slot.get("id_task"),
        "n_prompt": slot.get("n_prompt_tokens"),
        "n_decoded": nxt.get("n_decoded"),
    }


def _family_sum(values: dict[str, float], name: str) -> float:
    """Sum of a metric over all its label sets (``name`` or ``name{...}``)."""
    return sum(v for k, v in values.items() if k.split("{", 1)[0] == name)


def _at(samples: list[dict[str, Any]], t: float, before: bool) -> dict[str, Any]:
    """The last sample at or before ``t`` (``before``), else the first at or after it."""
    if before:
        prior = [s for s in samples if s["t"] <= t]
        return prior[-1] if prior else samples[0]
    later = [s for s in samples if s["t"] >= t]
    return later[0] if later else samples[-1]


def prefix_counters(profile: ServerProfile, names: set[str]) -> PrefixCounters | None:
    """Of the counter base ``names`` a server exports, its prefix-cache pair: the profile's own, else any
    known server's (the reference server is driven as plain OpenAI)."""
    for p in (profile, *server_profiles()):
        if p.prefix_cache is not None and {p.prefix_cache.hits, p.prefix_cache.queries} <= names:
            return p.prefix_cache
    return None


def reconcile(
    samples: list[dict[str, Any]],
    counters: set[str],
    profile: ServerProfile,
    window: tuple[float, float] | None,
) -> dict[str, Any]:
    """Counter deltas, rates, gauge statistics and spec-decode acceptance over the samples."""
    ok = [s for s in samples if "metrics" in s]
    out: dict[str, Any] = {"samples": len(samples), "scrape_errors": len(samples) - len(ok)}
    latencies = [s["latency_s"] for s in ok]
    if latencies:
        st = stats(latencies)  # the project's one percentile method
        out["scrape_latency_ms"] = {k: round(st[k] * 1e3, 3) for k in ("p50", "p99", "max")}  # type: ignore[operator]
    if len(ok) < 2:
        return out
    out["achieved_hz"] = round((len(ok) - 1) / max(ok[-1]["t"] - ok[0]["t"], 1e-9), 2)

    def deltas(first: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
        dt = last["t"] - first["t"]
        d = {
            k: last["metrics"][k] - first["metrics"].get(k, 0.0)
            for k in sorted(counters)
            if k in last["metrics"]
        }
        res: dict[str, Any] = {"t0": first["t"], "t1": last["t"], "counters": d}
        res["rates"] = {k: v / dt for k, v in d.items()} if dt > 0 else {}
        names = {k.split("{", 1)[0] for k in d}
        if pc := prefix_counters(profile, names):
            hits = _family_sum(d, pc.hits)
            looked_up = pc.tokens(hits, _family_sum(d, pc.queries))
            res["prefix_cache"] = {"cached_tokens": hits, "prompt_tokens": looked_up,
                                   "hit_rate": hits / looked_up if looked_up else None}  # fmt: skip
        spec = profile.spec_counters(names)
        if spec:
            drafted, accepted = _family_sum(d, spec[0]), _family_sum(d, spec[1])
            res["spec_decode"] = {
                "drafted": drafted,
                "accepted": accepted,
                "acceptance_rate": accepted / drafted if drafted else None,
            }
        return res

    out["point"] = deltas(ok[0], ok[-1])
    if window is not None:
        out["window"] = deltas(_at(ok, window[0], before=True), _at(ok, window[1], before=False))
    gauges: dict[str, dict[str, float]] = {}
    for key in ok[-1]["metrics"]:
        if key in counters:
            continue
        vals = [s["metrics"][key] for s in ok if key in s["metrics"]]
        gauges[key] = {"mean": sum(vals) / len(vals), "max": max(vals)}
    out["gauges"] = gauges
    return out


def iteration_records(client: httpx.Client, path: str, since: int = 0) -> list[dict[str, Any]]:
    """Every record of a server's iteration log (``GET path?since=``, the reference server's
    ``/v1/iterations``) from index ``since`` on, page after page."""
    records: list[dict[str, Any]] = []
    while True:
        resp = client.get(path, params={"since": since})
        resp.raise_for_status()
        page = resp.json()
        batch = page.get("iterations", [])
        records.extend(batch)
        nxt = int(page.get("next", since))
        if not batch or nxt <= since:
            return records
        since = nxt


class ServerStatePoller(ThreadedSampler):
    """A :class:`loadgen.timing.clock.Sidecar` that samples a server's ``/metrics`` (and ``/slots``)."""

    name = "server"
    filename = "server_state.jsonl"
    skip_ahead = True  # a slow scrape must not fire a burst of scrapes at the server

    def __init__(
        self,
        base_url: str,
        profile: ServerProfile = DEFAULT_PROFILE,
        hz: float = 10.0,
        timeout_s: float = 2.0,
    ) -> None:
        super().__init__(hz, "poll rate")
        self.base_url = base_url.rstrip("/")
        self.profile = profile
        self.timeout_s = timeout_s
        self._counters: set[str] = set()
        self._client: httpx.Client | None = None
        self._iter_since: int | None = None
        self._paths: dict[str, str] = {}

    def start(self, clock: RunClock, point_dir: Path) -> None:
        self._client = httpx.Client(base_url=self.base_url, timeout=self.timeout_s)
        self._iter_since = self._iterations_cursor()
        self._paths = {k: p for k, p in (("metrics", self.profile.metrics_path), ("slots", self.profile.slots_path))
                       if p and self._answers(p)}  # fmt: skip
        super().start(clock, point_dir)

    def _last(self) -> None:
        self._sample()  # a last scrape so the counters include the point's final requests

    def summary(self, window: tuple[float, float] | None) -> dict[str, Any]:
        assert self._client is not None, "stop() before start()"
        summary = reconcile(self.records, self._counters, self.profile, window)
        summary["sources"] = sorted(self._paths)
        if self._iter_since is not None:
            summary["iterations"] = self._fetch_iterations()
        self._client.close()
        return summary

    def _tick(self, t: float) -> dict[str, Any]:
        assert self._clock is not None and self._client is not None
        sample: dict[str, Any] = {}
        try:
            if "metrics" in self._paths:
                resp = self._client.get(self._paths["metrics"])
                resp.raise_for_status()
                values, counters = parse_metrics(resp.text)
                self._counters |= counters
                sample["metrics"] = values
            if "slots" in self._paths:
                resp = self._client.get(self._paths["slots"])
                if resp.status_code == 200:
                    sample["slots"] = [_compact_slot(s) for s in resp.json()]
        except (httpx.HTTPError, ValueError) as exc:
            sample.pop("metrics", None)
            sample["error"] = f"{type(exc).__name__}: {exc}"[:300]
        sample["latency_s"] = round(self._clock.now() - t, 6)
        return sample

    def _answers(self, path: str) -> bool:
        """False when the server says it has no such endpoint (404/501); True otherwise, so an
        unreachable server is still sampled and its failures recorded."""
        try:
            return self._client.get(path).status_code not in (404, 405, 501)  # type: ignore[union-attr]
        except httpx.HTTPError:
            return True

    def _iterations_cursor(self) -> int | None:
        """The reference server's next iteration index, or None when the server has no such endpoint."""
        if not self.profile.iterations_path:
            return None
        try:
            resp = self._client.get(self.profile.iterations_path, params={"since": 1 << 62})  # type: ignore[union-attr]
            if resp.status_code != 200:
                return None
            return int(resp.json().get("next", 0))
        except (httpx.HTTPError, ValueError, AttributeError):
            return None

    def _fetch_iterations(self) -> dict[str, Any]:
        """Every iteration record since the point started, times put on the run clock."""
        assert self._client is not None and self._clock is not None and self._dir is not None
        records = iteration_records(self._client, self.profile.iterations_path or "", self._iter_since or 0)
        with (self._dir / "iterations.jsonl").open("w", encoding="utf-8") as f:
            for rec in records:
                if "t_unix" in rec:
                    rec["t"] = round(self._clock.from_unix(rec["t_unix"]), 6)
                f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        return {"count": len(records)}
