"""The one place that turns a command's errors into its exit code (:func:`exits`, :func:`guard`; the codes:
:mod:`loadgen.exitcodes`), and the console every command prints its errors and progress on."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import typer
from rich.console import Console

from loadgen.exitcodes import ExitCode, ServerGone, UsageError

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
