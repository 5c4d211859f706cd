"""``bench calibrate``: its options, the run of :func:`loadgen.experiments.calibrate.calibrate` and its tables."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import typer
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from loadgen.cli.exits import console
from loadgen.cli.options import command
from loadgen.client.http import CLIENT_KINDS
from loadgen.defaults import RESULTS_ROOT
from loadgen.dispatch.signals import run_async
from loadgen.exitcodes import ExitCode, UsageError
from loadgen.experiments.calibrate import EVENTS, SERVER_BUSY, FixedWorkload, calibrate
from loadgen.records.results import new_run_id
from loadgen.runoptions import CLIENT, OUTPUT_DIR, RUN_ID, option, parse_list
from workloads.contracts import GENERATION_APIS, Api


@dataclass(frozen=True)
class CalibrateOptions:
    """What ``bench calibrate`` was asked; each field is one of its options
    (:func:`loadgen.runoptions.option`)."""

    concurrency: int = option(512, "Closed-loop concurrency.")
    events: int | None = option(None, f"Stream events per response (default {EVENTS}); the null server sends one "
                                "output token per event.")  # fmt: skip
    output_tokens: int | None = option(None, "Output tokens per response: --events by another name (one token per "
                                       "event).")  # fmt: skip
    prompt_tokens: int | None = option(None, "Tokens in each request's prompt, each its own corpus text (default: a "
                                       "short fixed prompt).")  # fmt: skip
    api: str = option("completions", "completions or chat.")
    num_requests: int = option(20000, "Closed-loop measured requests.")
    rate: float = option(300.0, "Open-loop Poisson rate, req/s.")
    duration: float = option(30.0, "Open-loop seconds.")
    client: str = option("aiohttp", CLIENT)
    output_dir: Path = option(RESULTS_ROOT, OUTPUT_DIR)
    run_id: str | None = option(None, RUN_ID)
    workers: str = option("1", "Worker counts for the closed-loop ceiling, e.g. 1,2,4: the ceiling and the scaling "
                          "efficiency per count.")  # fmt: skip
    servers: int | None = option(None, "Null-server processes on its one port (SO_REUSEPORT); default: one per "
                                 "worker of the largest --workers count.")  # fmt: skip


def _calibrate(**options: Any) -> None:
    """Measure this client's own ceiling against the null SSE server (run in a separate process), for the
    traffic given (prompt length, output tokens, API)."""
    o = CalibrateOptions(**options)
    counts_given = (o.concurrency, o.events, o.output_tokens, o.prompt_tokens, o.num_requests, o.servers)
    if any(n is not None and n < 1 for n in counts_given) or o.rate <= 0 or o.duration <= 0:
        console.print("[red]error[/]: all calibrate options must be positive")
        raise typer.Exit(ExitCode.USAGE)
    if o.events is not None and o.output_tokens is not None and o.events != o.output_tokens:
        console.print(f"[red]error[/]: --events {o.events} and --output-tokens {o.output_tokens} are one setting (the "
                      "null server sends one token per event): give one")  # fmt: skip
        raise typer.Exit(ExitCode.USAGE)
    if o.api not in GENERATION_APIS:
        console.print(f"[red]error[/]: --api must be {' or '.join(GENERATION_APIS)}, got {o.api!r}")
        raise typer.Exit(ExitCode.USAGE)
    if o.client not in CLIENT_KINDS:
        console.print(f"[red]error[/]: --client must be aiohttp or httpx, got {o.client!r}")
        raise typer.Exit(ExitCode.USAGE)
    try:
        counts = parse_list(o.workers, int, "--workers")
    except UsageError as exc:
        console.print(f"[red]error[/]: {exc}")
        raise typer.Exit(ExitCode.USAGE) from None
    if any(n > o.concurrency for n in counts):
        console.print(f"[red]error[/]: every --workers count must be at most --concurrency ({o.concurrency})")
        raise typer.Exit(ExitCode.USAGE)
    n_events = o.events or o.output_tokens or EVENTS
    out_dir = o.output_dir / (o.run_id or f"calibrate-{new_run_id()}")
    prompt = f"{o.prompt_tokens}-token prompts" if o.prompt_tokens else f"prompt {FixedWorkload.prompt!r}"
    console.print(f"calibrating {o.api} API, {prompt}, {n_events} events (output tokens) per response: closed loop "
                  f"c={o.concurrency}; open loop Poisson {o.rate:g}/s")  # fmt: skip
    res = run_async(calibrate(out_dir, o.concurrency, n_events, o.num_requests, o.rate, o.duration, o.client, counts,
                              o.servers, o.prompt_tokens, cast(Api, o.api)))  # fmt: skip
    t = Table(title=f"client ceiling ({o.client}; load average {res['load_average'][0]:.2f})")
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
    # the busy null server of a point in the table (the closed point's row of a scaling table warns there)
    parts += [servers_note(res[name], f"at the {name}-loop point") for name in ("closed", "open")
              if res[name]["servers_limit"] and not (name == "closed" and "scaling" in res)]  # fmt: skip
    if "scaling" in res:
        parts += scaling_table(res["scaling"], res["cores"], res["servers"])
    Console(width=None if sys.stdout.isatty() else 200).print(Group(*parts, Text(f"results: {out_dir}")))


calibrate_command = command(_calibrate, options=CalibrateOptions)


def scaling_table(rows: list[dict[str, Any]], cores: int, servers: int) -> list[Table | Text]:
    """The closed-loop rows of :func:`loadgen.experiments.calibrate.scaling` as a table, with a warning under it for each
    count whose limit was the machine's cores or a null-server process."""
    t = Table(title=f"closed-loop ceiling per worker count ({cores} cores on this machine, {servers} null-server "
                    "processes)")  # fmt: skip
    for col in ("workers", "req/s", "efficiency", "conc. achieved/req.", "CPU ms/request", "cores busy",
                "busiest server"):  # fmt: skip
        t.add_column(col, justify="right")
    notes: list[Table | Text] = [t]
    for r in rows:
        eff = f"{r['efficiency']:.0%}" if r["efficiency"] is not None else "-"
        t.add_row(str(r["workers"]), f"{r['req_per_s']:,.0f}", eff,
                  f"{r['achieved_concurrency']:.1f}/{r['requested_concurrency']}", f"{r['cpu_ms_per_request']:.3f}",
                  f"{r['cores_busy']:.2f} of {cores}", f"{r['server_cpu_max']:.0%}")  # fmt: skip
        if r["cores_limit"]:
            notes.append(Text(f"warning: with {r['workers']} worker(s) the machine's cores set the limit, not the "
                              f"client or the server ({r['cores_busy']:.2f} of {cores} cores busy with client "
                              "workers and the null server): more workers will not scale here", style="yellow"))  # fmt: skip
        if r["servers_limit"]:
            notes.append(servers_note(r, f"with {r['workers']} worker(s)"))
    return notes


def servers_note(r: dict[str, Any], where: str) -> Text:
    """The warning for a point whose busiest null-server process was above
    :data:`loadgen.experiments.calibrate.SERVER_BUSY`."""
    return Text(f"warning: {where} a null-server process used {r['server_cpu_max']:.0%} of a core (above "
                f"{SERVER_BUSY:.0%}): the servers may be the limit; give it more with --servers",
                style="yellow")  # fmt: skip
