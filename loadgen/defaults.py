"""Defaults that several commands and layers share, in one place; this module imports nothing heavy."""

from __future__ import annotations

from pathlib import Path

REQUEST_TIMEOUT_S = 600.0  # a request's whole response (--timeout)
STALL_TIMEOUT_S = 60.0  # the longest silence within a response (--stall-timeout)
RESULTS_ROOT = Path("results")  # where runs go (--output-dir)
