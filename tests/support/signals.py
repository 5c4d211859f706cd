"""Ctrl-C in tests: a background job of a non-interactive shell (CI, `cmd &`) inherits SIGINT as ignored,
and so would every child the tests start; a test that sends SIGINT restores its default in the child."""

import signal


def sigint_default() -> None:
    """``preexec_fn`` for a child that must receive SIGINT as a terminal's Ctrl-C would deliver it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
