"""Exit codes of every ``bench`` command: the one table (documented in README.md and docs/architecture.md),
and the errors that end a command with one (:class:`UsageError`, :class:`ServerGone`); the one place that
turns a command's errors into them is :mod:`loadgen.cli.exits`.

A script can trust them: 0 only when the run did what was asked and met its checks.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import IntEnum


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
