"""Shared fixtures (keep small): a null/fault-injection SSE server on loopback, in its own process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from loadgen.nullserver import NullServerProcess


@pytest.fixture(scope="session")
def null_server() -> Iterator[str]:
    """Base URL of a null OpenAI-compatible server; per-request behaviour via extra_body["nullserver"]."""
    with NullServerProcess() as url:
        yield url
