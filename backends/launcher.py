"""Start a server for one grid point, wait for it to be healthy, stop it cleanly.

A server command is a template such as ``llama-server -m {model} -np {np} --port {port}``: ``{port}`` is
a free loopback port, ``{model}`` the bundled GGUF, every other placeholder a grid parameter
(``--grid np=4,16``). The server runs in its own process group with its output captured to a log file;
stopping sends SIGTERM to the group, then SIGKILL after a grace period. A guard process beside it
(:mod:`backends.parent_guard`) does the same when this process dies without stopping it (SIGKILL), so no
server outlives the run that started it. A server that exits or never answers its health check raises
:class:`LaunchError`, which a sweep records as that point's failure.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shlex
import shutil
import signal
import socket
import string
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx

LLAMA_SERVER_ENV = "SERVELAB_LLAMA_SERVER"


class LaunchError(RuntimeError):
    """The server exited or never became healthy."""


def bundled_model() -> Path:
    """The bundled GGUF (:func:`reference_server.model_files.default_model_path`), a :class:`LaunchError` when missing.
    Imported here, as ``workloads.text`` does: the model's facts need ``tokenizers``, which launching any other
    server (the null server of ``scripts/scale_check.py`` on a machine without it) does not."""
    from reference_server.model_files import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as exc:
        raise LaunchError(str(exc)) from None


def llama_server_binary() -> str:
    """``$SERVELAB_LLAMA_SERVER``, else ``llama-server`` on PATH, else the cached build of
    ``scripts/build_llama_server.sh``."""
    if env := os.environ.get(LLAMA_SERVER_ENV):
        return env
    if found := shutil.which("llama-server"):
        return found
    cache = Path(os.environ.get("SERVELAB_CACHE", Path.home() / ".cache" / "servelab"))
    built = sorted(cache.glob("llama-server-*/llama-server"))
    if built:
        return str(built[-1])
    raise LaunchError(f"llama-server not found: run scripts/build_llama_server.sh or set {LLAMA_SERVER_ENV}")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (bind to port 0): every server this project starts listens on one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def parse_grid(specs: list[str]) -> list[dict[str, str]]:
    """``["np=4,16", "ub=128,512"]`` -> the product, in order: np4/ub128, np4/ub512, np16/ub128, ..."""
    axes: list[tuple[str, list[str]]] = []
    for spec in specs:
        name, sep, values = spec.partition("=")
        name = name.strip()
        vals = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not name.isidentifier() or not vals or any(c.isspace() for c in values.strip()):
            raise ValueError(f"bad --grid {spec!r}: expected NAME=V1,V2,... (e.g. np=4,16)")
        if name in ("model", "port") or any(name == a for a, _ in axes):
            raise ValueError(f"bad --grid {spec!r}: {name!r} is reserved or given twice")
        axes.append((name, vals))
    return [
        dict(zip([a for a, _ in axes], combo, strict=True))
        for combo in itertools.product(*(v for _, v in axes))
    ]


def grid_label(params: dict[str, str]) -> str:
    """``{"np": "4", "ub": "128"}`` -> ``np4-ub128`` (the point-id prefix)."""
    return "-".join(f"{k}{v}" for k, v in params.items()) or "server"


def render_command(template: str, params: dict[str, str], port: int, model: str | None = None) -> list[str]:
    """The argv for one grid point; every placeholder must be known."""
    fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    values: dict[str, str] = {"port": str(port), **params}
    if "model" in fields:
        values["model"] = model or str(bundled_model())
    missing = sorted(fields - set(values))
    if missing:
        raise ValueError(f"--server template uses {{{missing[0]}}} but no --grid {missing[0]}=... gives it")
    unused = sorted(set(params) - fields)
    if unused:
        raise ValueError(f"--grid {unused[0]} is not used by the --server template")
    argv = shlex.split(template.format(**values))
    if not argv:
        raise ValueError("--server template is empty")
    if argv[0] == "llama-server":
        argv[0] = llama_server_binary()
    elif argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


class ServerProcess:
    """One launched server: ``with ServerProcess(argv, port, log) as srv: ... srv.base_url``.

    Its output goes to ``log_path``, or to this process's stdout/stderr when that is None."""

    def __init__(
        self,
        argv: list[str],
        port: int,
        log_path: Path | None,
        health_path: str = "/health",
        health_timeout_s: float = 180.0,
        stop_grace_s: float = 10.0,
        host: str = "127.0.0.1",
    ) -> None:
        self.argv = argv
        self.port = port
        self.base_url = f"http://{host}:{port}"
        self.log_path = log_path
        self.health_path = health_path
        self.health_timeout_s = health_timeout_s
        self.stop_grace_s = stop_grace_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.guard: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        t0 = time.monotonic()
        with contextlib.ExitStack() as stack:
            log: IO[bytes] | None = None
            if self.log_path is not None:
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
                log = stack.enter_context(self.log_path.open("ab"))
                log.write(f"$ {shlex.join(self.argv)}\n".encode())
                log.flush()
            try:
                self.proc = subprocess.Popen(
                    self.argv,
                    stdout=log,
                    stderr=subprocess.STDOUT if log is not None else None,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            except OSError as exc:
                raise LaunchError(f"cannot start {self.argv[0]!r}: {exc}") from exc
        try:
            guard = ["-m", "backends.parent_guard", str(os.getpid()), str(self.proc.pid), str(self.stop_grace_s)]
            self.guard = subprocess.Popen([sys.executable, *guard], stdin=subprocess.DEVNULL, start_new_session=True)
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.health_timeout_s
        with httpx.Client(timeout=2.0) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise LaunchError(
                        f"server exited with code {code} before becoming healthy\n{self.log_tail()}"
                    )
                try:
                    if client.get(self.base_url + self.health_path).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise LaunchError(
                        f"server not healthy after {self.health_timeout_s:.0f}s at {self.base_url}{self.health_path}"
                        f"\n{self.log_tail()}"
                    )
                time.sleep(0.2)

    def stop(self) -> int | None:
        """SIGTERM to the process group, SIGKILL after the grace period; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_grace_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait()
        self._signal(signal.SIGKILL)  # reap anything the server left behind in its group
        if self.guard is not None:
            self.guard.kill()
            self.guard.wait()
        return self.proc.returncode

    def _signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def log_tail(self, lines: int = 15) -> str:
        if self.log_path is None:
            return ""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass(frozen=True)
class GridPoint:
    """One server configuration of a ``--server``/``--grid`` sweep."""

    params: dict[str, str]
    label: str  # point-id prefix, e.g. ``np4-ub128``


def server_grid(template: str, grid_specs: list[str]) -> list[GridPoint]:
    """The grid's points, with the template checked against them before anything is started."""
    points = [GridPoint(p, grid_label(p)) for p in parse_grid(grid_specs)] or [GridPoint({}, "server")]
    for gp in points:
        render_command(template, gp.params, port=1, model="-")
    return points


RunInner = Callable[[str, GridPoint, list[dict[str, Any]]], list[dict[str, Any]]]


def sweep_servers(
    template: str,
    points: list[GridPoint],
    run_dir: Path,
    run_inner: RunInner,
    *,
    health_path: str = "/health",
    health_timeout_s: float = 180.0,
    stop_on_abort: bool = True,
) -> list[dict[str, Any]]:
    """For each grid point: start the server, ``run_inner(base_url, point, results_so_far)`` (the load
    sweep, returning its PointSummaries), stop the server. Each summary gets ``server_launch`` (params,
    command, log, start-up time). A server that fails to start, or dies during its points, gives a
    ``failed`` entry for that grid point and the sweep goes on with the next one. A point that ended
    ``interrupted`` ends the sweep, and so does one ``aborted`` (its server went away) unless
    ``stop_on_abort`` is False."""
    results: list[dict[str, Any]] = []
    for gp in points:
        port = free_port()
        argv = render_command(template, gp.params, port)
        srv = ServerProcess(
            argv, port, run_dir / "points" / gp.label / "server.log", health_path, health_timeout_s
        )
        info: dict[str, Any] = {"params": gp.params, "command": shlex.join(argv), "log": str(srv.log_path)}
        try:
            with srv:
                info["startup_s"] = round(srv.startup_s or 0.0, 3)
                summaries = run_inner(srv.base_url, gp, results)
                died = srv.proc.poll() if srv.proc else None
        except LaunchError as exc:
            failed = {"kind": "launch", "message": str(exc)}
            results.append(
                {"point_id": gp.label, "labels": dict(gp.params), "server_launch": info, "failed": failed}
            )
            continue
        for s in summaries:
            s["server_launch"] = info
            if died is not None:
                s["failed"] = {
                    "kind": "server_exited",
                    "message": f"server exited with code {died} during the point",
                }
        results.extend(summaries)
        ends = {s.get("status") for s in summaries}
        if "interrupted" in ends or ("aborted" in ends and stop_on_abort):
            break
    return results
