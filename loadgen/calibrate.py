"""``bench calibrate``: the client's own ceiling on this machine, measured against the null server.

The null server runs in a separate process (its own event loop and core), so the figures are what one
client process can drive: closed loop (req/s and events/s at a concurrency, achieved concurrency) and
open loop (achieved vs requested rate, schedule lag).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import orjson
import typer
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from backends.openai import OpenAIBackend
from loadgen.client import CLIENT_KINDS, StreamReader
from loadgen.clock import RunClock
from loadgen.engine import LoadSpec, run_async, run_point
from loadgen.exitcodes import ExitCode, UsageError, console
from loadgen.fleet import Fleet
from loadgen.nullserver import Behaviour, NullServerProcess, Stream
from loadgen.options import Client, OutputDir, RunId, parse_list
from loadgen.results import new_run_id
from workloads.base import ArrivalSpec, Session, SingleShot, Workload
from workloads.contracts import GenRequest, RequestRecord


@dataclass
class FixedWorkload(Workload):
    """Identical requests (``extra_bodies`` cycle per request, e.g. null-server faults); for calibration
    and tests, where the prompt content does not matter."""

    max_tokens: int = 16
    prompt: str = "Say something."
    cls: str = "fixed"
    extra_bodies: list[dict[str, Any]] = field(default_factory=lambda: [{}])
    name: str = "fixed"
    arrival: ArrivalSpec = field(default_factory=ArrivalSpec)

    def sessions(self, seed: int) -> Iterator[Session]:
        for i, extra in zip(itertools.count(), itertools.cycle(self.extra_bodies)):
            yield SingleShot(GenRequest(f"r{i}", self.prompt, self.max_tokens, self.cls, extra_body=extra, seed=seed))

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "max_tokens": self.max_tokens, "extra_bodies": self.extra_bodies}


async def calibrate(
    out_dir: Path, concurrency: int = 512, events: int = 200, num_requests: int = 20000, rate: float = 300.0,
    duration: float = 30.0, client_kind: str = "aiohttp", workers: Sequence[int] = (1,),
) -> dict[str, Any]:
    """Run the closed-loop and the open-loop calibration points; returns {"closed": ..., "open": ...}.

    With several ``workers`` counts, the closed-loop point runs once per count (``--workers``) and
    ``scaling`` holds each count's ceiling, its scaling efficiency (req/s over ``n`` times the first
    count's per worker) and the cores busy during it (client workers + null server, of ``cores``); the
    open-loop point runs with the first count."""
    cores = os.cpu_count() or 1
    out: dict[str, Any] = {"load_average": os.getloadavg(), "client": client_kind, "cores": cores}
    srv = NullServerProcess()
    with srv as url:
        assert srv.proc is not None
        server_cpu = _Cpu(srv.proc.pid)
        backend = OpenAIBackend(url, model="null")
        wl = FixedWorkload(max_tokens=events)
        clock = RunClock()
        closed = LoadSpec("closed", concurrency=concurrency, num_requests=num_requests, warmup=concurrency)
        scaling = []
        for n in workers:
            server_cpu.reset()
            s = await run_point(backend, wl, closed, out_dir / ("closed" if n == workers[0] else f"closed-w{n}"),
                                clock, client_kind=client_kind, fleet=Fleet(n))  # fmt: skip
            busy = s["workers"]["cpu_s"] / (s["t_end"] - s["t_start"]) + server_cpu.share()
            scaling.append({"workers": n, **_brief(s, events), "server_cpu": server_cpu.share(), "cores_busy": busy})
        base = scaling[0]["req_per_s"] / workers[0] if scaling[0]["req_per_s"] else None
        for row in scaling:
            row["efficiency"] = row["req_per_s"] / (row["workers"] * base) if base and row["req_per_s"] else None
            row["cores_limit"] = row["workers"] + 1 > cores or row["cores_busy"] > CORES_BUSY * cores
        out["closed"] = scaling[0]
        if len(workers) > 1:
            out["scaling"] = scaling
        opened = LoadSpec("poisson", rate=rate, duration=duration, warmup=int(rate), seed=1)
        s = await run_point(backend, wl, opened, out_dir / "open", clock, client_kind=client_kind,
                            fleet=Fleet(workers[0]))  # fmt: skip
        out["open"] = _brief(s, events)
    (out_dir / "calibrate.json").write_text(json.dumps(out, indent=1))
    return out


CORES_BUSY = 0.85  # client workers + null server using more than this share of the machine's cores: its limit


class _Cpu:
    """CPU seconds of another process (Linux /proc), as a share of the wall time since ``reset``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.reset()

    def _read(self) -> float:
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return 0.0

    def reset(self) -> None:
        self.t, self.cpu = time.perf_counter(), self._read()

    def share(self) -> float:
        return (self._read() - self.cpu) / max(time.perf_counter() - self.t, 1e-9)


def _brief(s: dict[str, Any], events: int) -> dict[str, Any]:
    thr, cl = s["throughput"]["steady"], s["client"]
    lag = cl["schedule_lag"]
    return {
        "requests": s["counts"]["requests"], "errors": s["counts"]["errors"],
        "req_per_s": thr["req_per_s"], "events_per_s": (thr["req_per_s"] or 0) * events,
        "achieved_concurrency": cl["achieved_concurrency"], "requested_concurrency": cl["requested_concurrency"],
        "achieved_rate": cl["achieved_rate"], "requested_rate": cl["requested_rate"],
        "lag_p50_ms": lag["p50"] * 1e3 if lag["p50"] is not None else None,
        "lag_p99_ms": lag["p99"] * 1e3 if lag["p99"] is not None else None,
        "client_cpu": cl["cpu"], "client_cpu_wait": cl["cpu_wait"], "warnings": cl["warnings"],
        # CPU time the client (all its workers) spent per request: one free core's ceiling is 1 / this
        "cpu_ms_per_request": s["workers"]["cpu_s"] / max(s["counts"]["requests"] + s["counts"]["warmup"], 1) * 1e3,
    }  # fmt: skip


def stream_cost(events: int = 200, read_size: int = 16384, repeat: int = 2000) -> float:
    """Client CPU seconds to turn one null-server response of ``events`` events, read ``read_size``
    bytes at a time, into its finished record line: the client's per-event work without the network
    (``python -m loadgen.calibrate``). Best of 5 rounds of ``repeat`` requests."""
    body = {"prompt": "Say something.", "max_tokens": events, "stream_options": {"include_usage": True}}
    stream = Stream(body, Behaviour())
    raw = b"".join(map(stream.event, range(stream.n))) + stream.tail()
    chunks = [raw[i : i + read_size] for i in range(0, len(raw), read_size)]
    backend, clock, req = OpenAIBackend("http://127.0.0.1", model="null"), RunClock(), GenRequest("r", "x", events)

    def one() -> RequestRecord:
        rec = RequestRecord(id="r")
        reader = StreamReader(backend, rec, clock)
        for chunk in chunks:
            if reader.feed(chunk, clock.now()):
                break
        else:
            reader.close(clock.now())
        reader.finish(req)
        orjson.dumps(rec.to_dict(), option=orjson.OPT_APPEND_NEWLINE)
        if rec.error is not None or len(rec.events) != events:
            raise RuntimeError(f"null stream misread: {rec.error}, {len(rec.events)} events")
        return rec

    best = float("inf")
    for _ in range(5):
        t = time.process_time()
        for _ in range(repeat):
            one()
        best = min(best, (time.process_time() - t) / repeat)
    return best


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m loadgen.calibrate", description=stream_cost.__doc__)
    ap.add_argument("--events", type=int, default=200)
    ap.add_argument("--read-size", type=int, default=16384)
    ap.add_argument("--repeat", type=int, default=2000)
    a = ap.parse_args()
    sec = stream_cost(a.events, a.read_size, a.repeat)
    print(f"{sec * 1e6:.0f} us CPU per {a.events}-event response ({sec * 1e6 / a.events:.2f} us per event)")


def calibrate_command(
    concurrency: Annotated[int, typer.Option(help="Closed-loop concurrency.")] = 512,
    events: Annotated[int, typer.Option(help="Stream events per response.")] = 200,
    num_requests: Annotated[int, typer.Option(help="Closed-loop measured requests.")] = 20000,
    rate: Annotated[float, typer.Option(help="Open-loop Poisson rate, req/s.")] = 300.0,
    duration: Annotated[float, typer.Option(help="Open-loop seconds.")] = 30.0,
    client: Client = "aiohttp", output_dir: OutputDir = Path("results"), run_id: RunId = None,
    workers: Annotated[str, typer.Option(help="Worker counts for the closed-loop ceiling, e.g. 1,2,4: the ceiling "
                                         "and the scaling efficiency per count.")] = "1",
) -> None:  # fmt: skip
    """Measure this client's own ceiling against the null SSE server (run in a separate process)."""
    if concurrency < 1 or events < 1 or num_requests < 1 or rate <= 0 or duration <= 0:
        console.print("[red]error[/]: all calibrate options must be positive")
        raise typer.Exit(ExitCode.USAGE)
    if client not in CLIENT_KINDS:
        console.print(f"[red]error[/]: --client must be aiohttp or httpx, got {client!r}")
        raise typer.Exit(ExitCode.USAGE)
    try:
        counts = parse_list(workers, int, "--workers")
    except UsageError as exc:
        console.print(f"[red]error[/]: {exc}")
        raise typer.Exit(ExitCode.USAGE) from None
    if any(n > concurrency for n in counts):
        console.print(f"[red]error[/]: every --workers count must be at most --concurrency ({concurrency})")
        raise typer.Exit(ExitCode.USAGE)
    out_dir = output_dir / (run_id or f"calibrate-{new_run_id()}")
    console.print(f"calibrating: closed loop c={concurrency}, {events} events/stream; open loop Poisson {rate:g}/s")
    res = run_async(calibrate(out_dir, concurrency, events, num_requests, rate, duration, client, counts))
    t = Table(title=f"client ceiling ({client}; load average {res['load_average'][0]:.2f})")
    for col in ("point", "req/s", "events/s", "conc. achieved/req.", "rate achieved/req.", "lag p50 ms",
                "lag p99 ms", "client CPU"):  # fmt: skip
        t.add_column(col, justify="right")
    for name in ("closed", "open"):
        r = res[name]
        conc = f"{r['achieved_concurrency']:.1f}/{r['requested_concurrency']}" if r["requested_concurrency"] else "-"
        rt = f"{r['achieved_rate']:.1f}/{r['requested_rate']:g}" if r["requested_rate"] else "-"
        t.add_row(name, f"{r['req_per_s']:,.0f}", f"{r['events_per_s']:,.0f}", conc, rt,
                  f"{r['lag_p50_ms']:.2f}", f"{r['lag_p99_ms']:.2f}", f"{r['client_cpu']:.0%}")  # fmt: skip
    parts: list[Table | Text] = [t]
    if "scaling" in res:
        parts += _scaling_table(res)
    Console(width=None if sys.stdout.isatty() else 200).print(Group(*parts, Text(f"results: {out_dir}")))


def _scaling_table(res: dict[str, Any]) -> list[Table | Text]:
    t = Table(title=f"closed-loop ceiling per worker count ({res['cores']} cores on this machine)")
    for col in ("workers", "req/s", "efficiency", "conc. achieved/req.", "CPU ms/request", "cores busy"):
        t.add_column(col, justify="right")
    notes: list[Table | Text] = [t]
    for r in res["scaling"]:
        eff = f"{r['efficiency']:.0%}" if r["efficiency"] is not None else "-"
        t.add_row(str(r["workers"]), f"{r['req_per_s']:,.0f}", eff,
                  f"{r['achieved_concurrency']:.1f}/{r['requested_concurrency']}", f"{r['cpu_ms_per_request']:.3f}",
                  f"{r['cores_busy']:.2f} of {res['cores']}")  # fmt: skip
        if r["cores_limit"]:
            notes.append(Text(f"warning: with {r['workers']} worker(s) the machine's cores set the limit, not the "
                              f"client or the server ({r['cores_busy']:.2f} of {res['cores']} cores busy with client "
                              "workers and the null server): more workers will not scale here", style="yellow"))  # fmt: skip
    return notes
