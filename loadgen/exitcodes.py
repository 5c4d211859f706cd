"""Exit codes of every ``bench`` command: the one table (documented in README.md and docs/architecture.md),
and the one place that turns a command's errors into them (:func:`exits`, :func:`guard`).

A script can trust them: 0 only when the run did what was asked and met its checks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from enum import IntEnum
from typing import Any

import typer
from rich.console import Console


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1  # ran, but failed its checks: error rate above --max-error-rate, a point failed, a gate regression
    USAGE = 2  # bad usage or bad input (nothing was run)
    SERVER_GONE = 3  # the server was unreachable or went away mid-run (the point is marked aborted)
    SLO_UNREACHABLE = 4  # bench capacity: the SLOs fail already at the lowest load
    NOT_SATURATED = 5  # bench capacity: the SLOs still hold at the highest load the budget allowed
    INTERRUPTED = 130  # SIGINT (Ctrl-C): partial results written
    TERMINATED = 143  # SIGTERM: partial results written


# How bad each outcome is, for a command made of several (``bench sweep`` exits with the worst point).
_SEVERITY = (ExitCode.OK, ExitCode.NOT_SATURATED, ExitCode.SLO_UNREACHABLE, ExitCode.FAILED, ExitCode.USAGE,
             ExitCode.SERVER_GONE, ExitCode.TERMINATED, ExitCode.INTERRUPTED)  # fmt: skip


def worst(codes: Iterable[ExitCode]) -> ExitCode:
    """The most severe of ``codes`` (OK for none)."""
    return max(codes, key=_SEVERITY.index, default=ExitCode.OK)


class UsageError(Exception):
    """Bad input: printed as a one-line error, exit status 2."""


class ServerGone(Exception):
    """The target cannot be reached: printed as a one-line error, exit status 3."""


# Every command prints its errors and progress here (stdout carries only results).
console = Console(stderr=True)


@contextmanager
def exits(interrupted: str | None = None) -> Iterator[None]:
    """The one mapping from a command's exceptions to its exit code: a :class:`UsageError` prints one line
    and exits 2, a :class:`ServerGone` 3; with ``interrupted`` (what the user keeps), Ctrl-C prints it and
    exits 130."""
    try:
        yield
    except UsageError as exc:
        console.print(f"[red]error[/]: {exc}")
        raise typer.Exit(ExitCode.USAGE) from None
    except ServerGone as exc:
        console.print(f"[red]error[/]: {exc}")
        raise typer.Exit(ExitCode.SERVER_GONE) from None
    except KeyboardInterrupt:
        if interrupted is None:
            raise
        console.print(f"[yellow]interrupted[/]: {interrupted}")
        raise typer.Exit(ExitCode.INTERRUPTED) from None


def guard(fn: Callable[..., ExitCode | int | None], **kwargs: Any) -> None:
    """Run a command body under :func:`exits`; a non-zero code it returns ends bench with that code."""
    with exits():
        code = fn(**kwargs)
    if code:
        raise typer.Exit(int(code))
