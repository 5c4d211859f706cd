"""The coordinator's side of a load point's workers (:class:`Coordinator`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from loadgen.dispatch import fleet as fleet_mod
from loadgen.dispatch.fleet import Fleet
from loadgen.dispatch.progress import Progress
from loadgen.dispatch.signals import SIGNALS
from loadgen.records.writer import lines_from
from loadgen.timing.clock import RunClock


class Coordinator:
    """The coordinator's side of a point's workers: the phases on all of them, the progress and signals
    passed between, the records merged.

    Workers that are not this process pass their records on with their progress (every ``POLL_S``), and
    they are appended to the point's ``requests.jsonl`` (``out``) as they come, on this run clock: whoever
    reads that file while the point runs (``bench capacity``'s probe) sees every worker's records, as it sees
    the one in-process worker's. ``progress.counted_at`` says which moment the polled counters cover."""

    POLL_S = 0.5

    def __init__(self, handles: list[fleet_mod.Handle], progress: Progress, clock: RunClock, out: Path | None,
                 paths: list[Path]) -> None:  # fmt: skip
        self.handles, self.progress, self.clock = handles, progress, clock
        self.remote = [h for h in handles if h.remote]
        self.offsets = [{"offset_s": 0.0, "bound_s": 0.0} for _ in handles]
        self.latest: dict[int, dict[str, Any]] = {}
        self.forwarded = False
        self.out, self.paths = out, paths  # out: None when one worker in this process writes requests.jsonl
        self.received = [0] * len(handles)  # bytes of each worker's record file appended to out
        self._f = out.open("wb", buffering=0) if out is not None else None

    async def run(self) -> tuple[float, list[dict[str, Any] | None]]:
        """Clock offsets, the warm-up phase on every worker (with the building of their first sessions), then
        the measured phase from one instant; returns that instant and each worker's result (None for a worker
        lost)."""
        for h in self.handles:
            with contextlib.suppress(fleet_mod.WorkerLost):
                self.offsets[h.index] = await fleet_mod.clock_offset(h, self.clock.now)
        await self._each("warmup", lambda h: ())
        if self.remote:
            t_go = self.progress.t_start = self.clock.now() + fleet_mod.START_MARGIN_S
        else:
            t_go = self.clock.now()
        results = await self._each("measure", lambda h: (t_go + self.offsets[h.index]["offset_s"],))
        await self._poll()
        return t_go, results

    async def _each(self, method: str, args: Callable[[fleet_mod.Handle], tuple[Any, ...]]) -> list[Any]:
        """``method`` on every live worker at once, progress polled and signals forwarded meanwhile."""
        live = [h for h in self.handles if h.lost is None]
        calls = [asyncio.ensure_future(h.call(method, *args(h))) for h in live]
        watch = asyncio.ensure_future(self._watch())
        try:
            got = await asyncio.gather(*calls, return_exceptions=True)
        finally:
            watch.cancel()
        out: list[Any] = [None] * len(self.handles)
        for h, r in zip(live, got, strict=True):
            if isinstance(r, fleet_mod.WorkerLost):
                continue
            if isinstance(r, BaseException):
                raise r
            out[h.index] = r
        return out

    async def _watch(self) -> None:
        signals = SIGNALS.get()
        while self.remote:
            if signals is not None and signals.signum is not None and not self.forwarded:
                self.forwarded = True  # a worker process is in its own process group: it hears it once, from here
                for h in self.remote:
                    with contextlib.suppress(fleet_mod.WorkerLost):
                        await h.call("interrupt", signals.signum)
            await self._poll()
            with contextlib.suppress(asyncio.TimeoutError):  # a signal is passed on at once
                await asyncio.wait_for(signals.event.wait() if signals and not self.forwarded else asyncio.sleep(self.POLL_S),
                                       self.POLL_S)  # fmt: skip

    async def _poll(self) -> None:
        """The workers' progress into the coordinator's (the one live view)."""
        if not self.remote:
            return
        t = self.clock.now()  # each worker's counters are taken after this instant
        for h in self.remote:
            with contextlib.suppress(fleet_mod.WorkerLost):
                delta = await h.call("progress_delta", self.received[h.index])
                self._append(h, delta.pop("records"))
                self.progress.ttft.extend(delta.pop("ttft"))
                self.progress.recent.extend(delta.pop("recent"))
                self.latest[h.index] = delta
        p = self.progress
        p.counted_at = t
        for key in ("started", "done", "errors", "inflight", "output_tokens", "warmup_done"):
            setattr(p, key, sum(c[key] for c in self.latest.values()))
        p.error_kinds = {}
        for c in self.latest.values():
            for kind, k in c["error_kinds"].items():
                p.error_kinds[kind] = p.error_kinds.get(kind, 0) + k

    def _append(self, h: fleet_mod.Handle, lines: bytes) -> None:
        """Worker ``h``'s next records (lines of its record file) into ``requests.jsonl``, on this run clock."""
        if self._f is None or not lines:
            return
        self.received[h.index] += len(lines)
        if off := self.offsets[h.index]["offset_s"]:
            recs = [orjson.loads(line) for line in lines.splitlines()]
            for r in recs:
                r["intended"], r["sent"], r["end"] = r["intended"] - off, r["sent"] - off, r["end"] - off
                r["events"] = [[t - off, k] for t, k in r["events"]]
            lines = b"".join(orjson.dumps(r, option=orjson.OPT_APPEND_NEWLINE) for r in recs)
        self._f.write(lines)

    def describe(self, results: list[dict[str, Any] | None], fleet: Fleet) -> dict[str, Any]:
        per = []
        for h, r in zip(self.handles, results, strict=True):
            per.append({**h.describe(), **self.offsets[h.index], **{k: v for k, v in (r or {}).items() if k != "early"},
                        "lost": h.lost})  # fmt: skip
        bound = max(o["bound_s"] for o in self.offsets)
        note = (f"{len(self.handles)} Ray workers: records put on this machine's run clock by measured offsets, error "
                f"bound {bound * 1e3:.2f} ms") if fleet.ray is not None else None  # fmt: skip
        return {
            **fleet.describe(), "count": len(self.handles), "note": note, "cpu_s": sum(r["cpu_s"] for r in results if r and "cpu_s" in r),
            "clock_bound_s": bound, "per_worker": per,
            "lost": [{"index": h.index, "reason": h.lost} for h in self.handles if h.lost is not None],
        }  # fmt: skip

    async def close(self) -> list[dict[str, Any]] | None:
        """Stop the workers; then what a worker on this machine wrote and did not pass on (it was lost, or the
        point was cancelled) joins ``requests.jsonl``, which is put in order of the records' end (as one
        process writes it). Returns its records in that order (None when the one worker in this process wrote
        it: it is as written). A Ray worker's records not passed on by then stay on its node."""
        for h in self.handles:
            if not h.remote:
                await h.call("close")
        fleet_mod.close_all(self.handles)
        if self._f is None or self.out is None:
            return None
        for h, path in zip(self.handles, self.paths, strict=True):
            if h.local:
                self._append(h, lines_from(path, self.received[h.index]))
        self._f.close()
        lines = self.out.read_bytes().splitlines(keepends=True)  # whole lines: the coordinator appends no other
        recs = [orjson.loads(line) for line in lines]
        order = sorted(range(len(recs)), key=lambda i: recs[i]["end"])
        with self.out.open("wb") as f:
            f.writelines(lines[i] for i in order)
        return [recs[i] for i in order]
