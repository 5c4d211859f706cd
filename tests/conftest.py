"""Shared fixtures (keep small): a null/fault-injection SSE server on loopback, in its own process; the
reference server's app around a given engine, served in-process on a free loopback port (and one on a small context);
the report tests' synthetic run."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import uvicorn

from loadgen.testservers.null import NullServerProcess

if TYPE_CHECKING:
    from reference_server.engine.engine import Engine


class LiveServer:
    """``with LiveServer(engine) as s:`` serves ``engine`` at ``s.url`` (model name "smol") until exit."""

    def __init__(self, engine: Engine) -> None:
        from reference_server.api.app import create_app  # torch: only for the tests that serve

        self.engine = engine
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(create_app(engine, "smol"), host="127.0.0.1", port=self.port, log_level="error")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def wait_idle(self, timeout: float = 120) -> None:
        """Until the engine has no request left (running, waiting or not yet seen by its loop)."""
        deadline = time.monotonic() + timeout
        while self.engine.scheduler.has_work() or self.engine.num_waiting():
            assert time.monotonic() < deadline, "engine did not go idle"
            time.sleep(0.05)


@pytest.fixture(scope="session")
def live_server() -> type[LiveServer]:
    return LiveServer


SMALL_CONTEXT = 64  # tokens: caps the work of each request that hostile or generated bodies make


@pytest.fixture(scope="module")
def small_server() -> Iterator[LiveServer]:
    """The reference server on a SMALL_CONTEXT-token context, for the tests that send generated bodies."""
    from reference_server.config import EngineConfig
    from reference_server.engine.engine import Engine
    from reference_server.model_files import default_model_path

    cfg = EngineConfig(model=default_model_path(), num_kv_blocks=64, max_model_len=SMALL_CONTEXT, threads=1,
                       max_waiting=64)
    with LiveServer(Engine.on_own_thread(cfg)) as running:
        yield running


@pytest.fixture(scope="session")
def null_server() -> Iterator[str]:
    """Base URL of a null OpenAI-compatible server; per-request behaviour via extra_body["nullserver"]."""
    with NullServerProcess() as url:
        yield url


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A synthetic three-point sweep's results, written once per module that asks (the report's tests)."""
    from support.synthetic import SimConfig, write_synthetic_results

    return write_synthetic_results(tmp_path_factory.mktemp("res"), "full", SimConfig(seed=1))
