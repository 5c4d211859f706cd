"""The ``bench`` command: one sub-command per module, registered here and nowhere else.

Each command lives in a command-line module beside the others (:mod:`loadgen.cli`: ``run`` for run and
sweep, ``calibrate``, ``experiment``, ``kvbudget``, ``verify``) or in its package's ``cli`` (``capacity.cli``,
``gate.cli``, ``report.cli`` for report and trace; ``workloads.cli``); their shared options are
:mod:`loadgen.runoptions` (as data) and :mod:`loadgen.cli.options` (as typer options), their targets
:mod:`loadgen.cli.targets`, their exit codes :mod:`loadgen.exitcodes` (through :mod:`loadgen.cli.exits`). Nothing imports this module but the entry point
(``bench``, ``python -m loadgen.cli``).
"""

from __future__ import annotations

import signal
import sys

import typer

from loadgen.capacity.cli import capacity_command
from loadgen.cli.calibrate import calibrate_command
from loadgen.cli.experiment import experiment_command
from loadgen.cli.kvbudget import kv_budget_command
from loadgen.cli.run import run, sweep
from loadgen.cli.verify import verify
from loadgen.exitcodes import ExitCode
from loadgen.gate.cli import baseline_app, gate
from loadgen.report.cli import report_command, trace_command
from workloads.cli import app as workloads_app

app = typer.Typer(
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    help="servelab: load-test and benchmark LLM inference servers.",
)  # fmt: skip
app.command()(run)
app.command()(sweep)
app.command("calibrate")(calibrate_command)
app.command("kv-budget")(kv_budget_command)
app.command("experiment")(experiment_command)
app.command("gate")(gate)
app.command("report")(report_command)
app.command("trace")(trace_command)
app.command("capacity")(capacity_command)
app.command("verify")(verify)


@app.command("serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []})
def serve_command(ctx: typer.Context) -> None:
    """Start the bundled reference server; all flags go to it (bench serve --help lists them)."""
    from reference_server.api.cli import serve  # torch loads only for this command

    serve(ctx.args, prog="bench serve")


app.add_typer(baseline_app, name="baseline")
app.add_typer(workloads_app, name="workloads")


def main() -> None:
    # SIGTERM outside a load loop (e.g. while a server starts) unwinds like Ctrl-C, so a server bench
    # started is stopped; inside one, run_async turns it into an interrupted point.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(ExitCode.TERMINATED))
    app()
