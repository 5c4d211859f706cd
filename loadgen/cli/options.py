"""The command line of a load run's options: :func:`check`, the checks of :class:`loadgen.runoptions.RunOptions`
that need the launcher, the client and the sidecars; :func:`command`, which makes a typer command whose options
are an options dataclass's fields made by :func:`loadgen.runoptions.option` (``RunOptions``'s for run, sweep
and capacity; gate, calibrate and kv-budget each have their own small one).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from typing import Annotated, Any, get_type_hints

import typer

from backends.launcher import GridPoint, LaunchError, server_grid
from loadgen.client.http import CLIENT_KINDS
from loadgen.exitcodes import UsageError
from loadgen.metrics import definitions as metrics
from loadgen.runoptions import RunOptions, field_default, parse_slo
from loadgen.sidecars import telemetry
from workloads.contracts import APIS, ARRIVAL_PROCESSES

# a command's own --workload (run's and capacity's, through :func:`param`)
WorkloadOpt = Annotated[str, typer.Option(help="Workload name or TOML path.")]


def check(opts: RunOptions) -> list[GridPoint]:
    """Every check of ``opts`` that needs no server and no workload; returns the server grid (empty without --server)."""
    if opts.slo_from not in metrics.SLO_FROM:
        raise UsageError(f"--slo-from must be one of {', '.join(metrics.SLO_FROM)}, got {opts.slo_from!r}")
    if opts.api not in (None, *APIS):
        raise UsageError(f"--api must be one of {', '.join(APIS)}, got {opts.api!r}")
    if opts.client not in CLIENT_KINDS:
        raise UsageError(f"--client must be aiohttp or httpx, got {opts.client!r}")
    if opts.arrival is not None and opts.arrival not in ARRIVAL_PROCESSES:
        raise UsageError(f"--arrival must be one of {', '.join(ARRIVAL_PROCESSES)}, got {opts.arrival!r}")
    if opts.repeat < 1 or opts.warmup < 0:
        raise UsageError("--repeat must be >= 1 and --warmup >= 0")
    if not 0 <= opts.max_error_rate <= 1 or opts.wait_for_server < 0:
        raise UsageError("--max-error-rate must be within 0..1 and --wait-for-server >= 0")
    if opts.url is not None and not re.match(r"^https?://", opts.url):
        raise UsageError(f"--url must start with http:// or https://, got {opts.url!r}")
    if opts.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {opts.workers}")
    if opts.poll_hz < 0:
        raise UsageError("--poll-hz must be >= 0 (0 turns the server-state poller off)")
    try:
        telemetry.check_options(opts.telemetry_hz, opts.telemetry_url)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if opts.grid and not opts.server:
        raise UsageError("--grid needs --server (the command template the grid fills in)")
    if opts.server and opts.url:
        raise UsageError("--server starts the target itself; drop --url")
    try:
        grid_points = server_grid(opts.server, opts.grid or []) if opts.server else []
    except (ValueError, LaunchError) as exc:
        raise UsageError(f"--server/--grid: {exc}") from None
    parse_slo(opts.slo)
    return grid_points


def command(body: Callable[..., Any], names: Sequence[str] | None = None,
            own: Mapping[str, inspect.Parameter] | None = None, defaults: Mapping[str, Any] | None = None,
            options: type[Any] = RunOptions) -> Callable[..., None]:  # fmt: skip
    """A typer command that calls ``body(**options)``: its options are the fields ``names`` (default: every
    field made by :func:`loadgen.runoptions.option`) of the dataclass ``options`` (:class:`RunOptions` unless given), in that
    order, each spelled once (the field's ``cli``: its help and spelling, on the field's own type) with the
    field's default or the command's own (``defaults``); a name in ``own`` is the command's own parameter
    instead (run's single ``--concurrency`` and sweep's list of them). Its help is ``body``'s docstring."""
    by_name = {f.name: f for f in fields(options)}
    types = get_type_hints(options, include_extras=True)  # the fields' annotations are strings (PEP 563)
    names = [f.name for f in fields(options) if "cli" in f.metadata] if names is None else names
    own, defaults = own or {}, defaults or {}
    params = []
    for name in names:
        if name in own:
            params.append(own[name])
            continue
        f = by_name[name]
        default = defaults.get(name, field_default(f))
        help_, decls = f.metadata["cli"]
        params.append(param(name, Annotated[types[name], typer.Option(*decls, help=help_)], default))

    def cmd(**values: Any) -> None:
        body(**values)

    cmd.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    cmd.__annotations__ = {p.name: p.annotation for p in params}
    cmd.__doc__, cmd.__name__ = body.__doc__, body.__name__.lstrip("_")
    return cmd


def param(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    """A command's option: an options field's or the command's own (see :func:`command`)."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
