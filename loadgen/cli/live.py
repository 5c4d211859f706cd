"""The live display of a run: what a point is doing while it runs.

Per point: its place in the sweep (server configuration j of m, point i of n), a progress bar against the
request count (or the duration) with elapsed time and time left, requests in flight, live output tok/s,
TTFT p50/p99 of the measured requests so far and ITL p50/p99 of the latest 128 of them, and errors by kind.
On a terminal it is a rich Live panel refreshed twice a second; otherwise (CI logs, pipes) the same facts
go out as one plain line every ``plain_every_s`` seconds and one when the point ends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from loadgen.dispatch.progress import Progress
from loadgen.dispatch.sweep import PointPlan
from loadgen.metrics import percentiles
from loadgen.metrics.definitions import ITL, OUTPUT_TOK_S, TTFT, Metric
from loadgen.timing.clock import RunClock


@dataclass
class Status:
    """The facts both renderings show, taken at one instant."""

    where: str  # "config 1/2 np4 · point 2/3 c004"
    done: int  # measured requests finished
    total: int | None  # measured requests planned (None: bounded by duration or a trace's end)
    elapsed_s: float
    left_s: float | None
    fraction: float | None
    inflight: int
    out_tok_s: float
    ttft_ms: tuple[float, float] | None  # p50, p99
    itl_ms: tuple[float, float] | None
    errors: dict[str, int]

    def line(self) -> str:
        """The plain one-line form (log files)."""
        pct = f" {self.fraction:4.0%}" if self.fraction is not None else ""
        total = f"/{self.total}" if self.total is not None else ""
        left = f" left {_dur(self.left_s)}" if self.left_s is not None else ""
        return (f"{self.where}  done {self.done}{total}{pct}  elapsed {_dur(self.elapsed_s)}{left}  "
                f"in-flight {self.inflight}  {self.out_tok_s:,.0f} {OUTPUT_TOK_S.label}  {_pair(TTFT, self.ttft_ms)}  "
                f"{_pair(ITL, self.itl_ms)}  errors {_errors(self.errors)}")  # fmt: skip


def _dur(s: float) -> str:
    m, sec = divmod(int(round(s)), 60)
    return f"{m}:{sec:02d}"


def _pair(m: Metric, v: tuple[float, float] | None) -> str:
    """``TTFT p50/p99 12.5/40.1 ms``: the p50 and p99 of :func:`_p50_p99`, in the metric's shown unit."""
    return f"{m.label} p50/p99 {'-/-' if v is None else f'{v[0]:,.1f}/{v[1]:,.1f}'} {m.shown_unit}"


def _errors(kinds: dict[str, int]) -> str:
    return ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) if kinds else "0"


def _p50_p99(m: Metric, values: Sequence[float]) -> tuple[float, float] | None:
    s = percentiles.stats(values)
    return None if s["p50"] is None else (float(s["p50"]) * m.scale, float(s["p99"] or 0) * m.scale)


def status(plan: PointPlan, p: Progress, now: float, where: str) -> Status:
    load = plan.load
    elapsed = max(now - p.t_start, 0.0) if p.t_start else 0.0
    measured = p.done - p.warmup_done
    total = load.num_requests
    fraction: float | None = None
    left: float | None = None
    if total:
        fraction = min(measured / total, 1.0)
        if measured:
            left = elapsed / measured * (total - measured)
    if load.duration is not None:
        by_time = min(elapsed / load.duration, 1.0)
        if fraction is None or by_time > fraction:  # whichever bound comes first ends the point
            fraction, left = by_time, max(load.duration - elapsed, 0.0)
    return Status(
        where=where, done=measured, total=total, elapsed_s=elapsed, left_s=left, fraction=fraction,
        inflight=p.inflight, out_tok_s=p.output_tokens / elapsed if elapsed > 0 else 0.0,
        ttft_ms=_p50_p99(TTFT, p.ttft), itl_ms=_p50_p99(ITL, p.itl()), errors=dict(p.error_kinds),
    )  # fmt: skip


class _Panel:
    """The terminal rendering: place, bar, then the live numbers."""

    def __init__(self, take: Callable[[], Status]) -> None:
        self.take = take

    def __rich__(self) -> Group:
        s = self.take()
        bar = Table.grid(padding=(0, 1))
        bar.add_row(
            Text(s.where, style="bold"),
            ProgressBar(total=1.0, completed=s.fraction or 0.0, width=30, pulse=s.fraction is None),
            Text(f"{s.done}{'/' + str(s.total) if s.total else ''} requests"
                 f"{f' {s.fraction:.0%}' if s.fraction is not None else ''}"),
            Text(f"elapsed {_dur(s.elapsed_s)}" + (f"  left {_dur(s.left_s)}" if s.left_s is not None else ""),
                 style="dim"),
        )  # fmt: skip
        err_style = "red" if s.errors else "green"
        numbers = Text.assemble(
            f"in-flight {s.inflight}   ", (f"{s.out_tok_s:,.0f}", "bold"), f" {OUTPUT_TOK_S.label}   ",
            f"{_pair(TTFT, s.ttft_ms)}   {_pair(ITL, s.itl_ms)}   ",
            (f"errors {_errors(s.errors)}", err_style),
        )  # fmt: skip
        return Group(bar, numbers)


class LiveDisplay:
    """``live=display.points(plans, config=(j, m, label))`` for :func:`loadgen.dispatch.sweep.run_sweep`."""

    def __init__(self, console: Console, clock: RunClock, plain_every_s: float = 10.0) -> None:
        self.console, self.clock, self.plain_every_s = console, clock, plain_every_s

    def points(
        self, plans: Sequence[PointPlan], config: tuple[int, int, str] | None = None,
    ) -> Callable[[PointPlan, Progress], AbstractContextManager[None]]:  # fmt: skip
        index = {p.point_id: i for i, p in enumerate(plans, start=1)}
        prefix = f"config {config[0]}/{config[1]} {config[2]} · " if config else ""

        @contextmanager
        def one(plan: PointPlan, progress: Progress) -> Iterator[None]:
            where = f"{prefix}point {index.get(plan.point_id, 0)}/{len(plans)} {plan.point_id}"

            def take() -> Status:
                return status(plan, progress, self.clock.now(), where)

            if self.console.is_terminal:
                with Live(_Panel(take), console=self.console, refresh_per_second=2, transient=True):
                    yield
                self.console.print(take().line(), markup=False, highlight=False)
                return
            stop = threading.Event()

            def ticker() -> None:
                while not stop.wait(self.plain_every_s):
                    self.console.print(take().line(), markup=False, highlight=False, soft_wrap=True)

            thread = threading.Thread(target=ticker, name="servelab-live", daemon=True)
            thread.start()
            try:
                yield
            finally:
                stop.set()
                thread.join()
                self.console.print(take().line(), markup=False, highlight=False, soft_wrap=True)

        return one
