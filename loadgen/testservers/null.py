"""A null OpenAI-compatible SSE server: instant (or paced) token streams, and injected faults.

``bench calibrate`` runs it in its own process (``python -m loadgen.testservers.null``) so that client and
server do not share an event loop or a core; the tests use it as a fault-injection server. It speaks
just enough HTTP/1.1 (keep-alive, Content-Length request bodies, chunked responses) on a raw asyncio
protocol to stay out of the client's way.

Each request's behaviour is the server default (command-line flags) updated by the request body's
``"nullserver"`` object (send it with ``GenRequest.extra_body``)::

    {"nullserver": {"events": 50, "tokens_per_event": 3, "ttft": 0.01, "itl": 0.001,
                    "fault": "disconnect", "fault_after": 5}}

``events`` defaults to ``max_tokens / tokens_per_event``. ``usage_on_finish`` puts the final usage on the
finish_reason chunk instead of a usage-only chunk (llama.cpp's /v1/completions); ``spec_decode``
(``[drafted, accepted]``) adds the reference server's ``usage.spec_decode`` counts to the final usage;
``reasoning`` N streams a chat answer's first N events as reasoning (``delta.reasoning_content``).
Faults: ``500``, ``429`` (JSON error bodies),
``html`` (200 with a non-SSE body), ``hang`` (never answers), ``disconnect`` (drops the connection after
``fault_after`` events), ``garbage`` (a non-SSE line), ``bad_json`` (a non-JSON data line),
``error_event`` (``event: error``), ``error_payload`` (``data: {"error": ...}``), ``stall`` (goes quiet
after ``fault_after`` events), ``no_done`` (ends without ``[DONE]``), ``cut`` (ends mid-line),
``drop_request`` (reads the request, then closes the connection without a byte of response),
``linger`` (holds the finished stream open after ``[DONE]``, as a buffering proxy may, for up to an hour).
Wrong answers: ``diverge_above`` N changes one token of the answer of a request that arrives while more
than N generation requests (itself included) are in flight (the load-dependent bug ``bench verify`` finds;
its requests need ``ttft``/``itl`` pacing to overlap). Sampled answers: ``sample`` ``{text: weight}`` draws the
first event's text (seeded by the request's ``seed`` and ``sample_salt``), ``shift_above`` N with ``shifted``
draws from another distribution past N in flight (:class:`~loadgen.testservers.stream.Behaviour`).

Connection faults (server-wide, from the command-line behaviour): ``keepalive`` is ``on`` (default),
``close`` (``Connection: close`` on every response, then the server closes), ``drop`` (closes right
after every response without saying so, as llama-server may) or ``drop_idle`` (keeps the connection
open and drops the next request that arrives on it unread: the keep-alive race, every time).
``die_after`` N: the process exits at once when the N-th generation request arrives (in-flight
streams are cut). ``GET /stats`` counts ``requests`` (generation requests handled), ``dropped_idle``
and ``dropped_requests`` and ``inflight`` (generation responses being written now).

Several serving processes (``--processes N``, ``NullServerProcess(processes=N)``): for client ceilings
beyond what one server core can answer (``bench calibrate --servers N``). The design is the kernel's
``SO_REUSEPORT`` group on the one port: the launched process binds N listening sockets to it, then forks
N − 1 children, each serving one socket on its own event loop, and serves the first itself; the kernel
deals each new connection to one socket by a hash of its addresses. The client needs nothing (one URL),
every socket listens before ``/health`` can answer (a connection that reaches a child still starting waits
in its backlog), and the processes share the launcher's process group, so they stop together. Counters
(``/stats``, ``die_after``) are per process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import orjson
import psutil

from backends.launcher import ServerProcess, free_port
from loadgen.testservers.stream import Behaviour, Stream, first_draw, http_chunk

_STATS = {"requests": 0, "dropped_idle": 0, "dropped_requests": 0, "inflight": 0}

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 429: "Too Many Requests", 500: "Internal Server Error"}
_SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
             b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
_SSE_HEAD_CLOSE = _SSE_HEAD[:-2] + b"connection: close\r\n\r\n"


def _json_response(status: int, obj: Any, extra_headers: str = "") -> bytes:
    body = json.dumps(obj).encode()
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{extra_headers}\r\n")  # fmt: skip
    return head.encode() + body


class Conn(asyncio.Protocol):
    """One connection. A sibling server (:mod:`.servicemodel`) overrides ``_paced`` and clears ``fast``."""

    fast = True

    def __init__(self, default: Behaviour) -> None:
        self.default = default
        self.buf = b""
        self.busy = False
        self.served = 0  # responses completed on this connection
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._next()

    def _next(self) -> None:
        while not self.busy and self.transport is not None and not self.transport.is_closing():
            i = self.buf.find(b"\r\n\r\n")
            if i < 0:
                return
            head = self.buf[:i].decode("latin-1").split("\r\n")
            length = 0
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            if self.served and self.default.keepalive == "drop_idle":
                _STATS["dropped_idle"] += 1
                self.transport.abort()
                return
            if len(self.buf) < i + 4 + length:
                return
            body, self.buf = self.buf[i + 4 : i + 4 + length], self.buf[i + 4 + length :]
            method, path = (head[0].split(" ") + ["", ""])[:2]
            self._handle(method, path, body)

    def _handle(self, method: str, path: str, raw: bytes) -> None:
        t = self.transport
        assert t is not None
        if method == "GET" and path == "/health":
            t.write(_json_response(200, {"status": "ok"}))
            return
        if method == "GET" and path == "/stats":
            t.write(_json_response(200, _STATS))
            return
        if method == "GET" and path == "/v1/models":
            t.write(_json_response(200, {"object": "list", "data": [{"id": "null", "object": "model"}]}))
            return
        if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions"):
            t.write(_json_response(404, {"error": {"message": f"no route {method} {path}"}}))
            return
        try:
            body = orjson.loads(raw)  # 0.25 ms for a 128,000-token prompt's body, json.loads 0.6
            if not isinstance(body, dict):
                raise ValueError("the request body is not a JSON object")
            b = self.default.update(body.get("nullserver") or {})
            inflight = _STATS["inflight"] + 1
            stream = Stream(body, b, wrong=b.diverge_above is not None and inflight > b.diverge_above,
                            first=first_draw(b, body, inflight))  # fmt: skip
        except (ValueError, TypeError) as exc:
            t.write(_json_response(400, {"error": {"message": str(exc), "type": "invalid_request_error"}}))
            return
        _STATS["requests"] += 1
        if self.default.die_after is not None and _STATS["requests"] >= self.default.die_after:
            os._exit(1)  # a crash: no response, every connection cut
        if b.fault == "drop_request":
            _STATS["dropped_requests"] += 1
            t.abort()
            return
        if b.fault == "500":
            t.write(_json_response(500, {"error": {"message": "injected server error", "type": "server_error"}}))
        elif b.fault == "429":
            t.write(_json_response(429, {"error": {"message": "injected rate limit"}}, "retry-after: 1\r\n"))
        elif b.fault == "html":
            body_html = b"<html><body>not an event stream</body></html>"
            t.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: %d\r\n\r\n%s"
                    % (len(body_html), body_html))  # fmt: skip
        elif b.fault is None and b.ttft == 0 and b.itl == 0 and self.fast:  # the whole stream in one write
            t.write(self._head() + stream.whole())
            self._done()
        else:
            self.busy = True
            _STATS["inflight"] += 1
            asyncio.get_running_loop().create_task(self._counted(stream, b))

    async def _counted(self, stream: Stream, b: Behaviour) -> None:
        """``_paced``, out of ``inflight`` in the same step as its last write: a task's done callback may run
        after the next request is read (uvloop), so a closed loop's next request would count the finished one."""
        try:
            await self._paced(stream, b)
        finally:
            _STATS["inflight"] -= 1

    async def _paced(self, stream: Stream, b: Behaviour) -> None:
        t = self.transport
        assert t is not None
        if b.fault == "hang":
            await self._quiet(3600)
            return
        t.write(self._head())
        if b.ttft:
            await asyncio.sleep(b.ttft)
        for i in range(stream.n):
            if b.fault is not None and i == b.fault_after:
                if await self._fault(stream, b):
                    return
            if i and b.itl:
                await asyncio.sleep(b.itl)
            if t.is_closing():
                return
            t.write(http_chunk(stream.event(i)))
        if b.fault == "cut":
            t.write(http_chunk(b'data: {"choices":[{"index":0,"te'))
        else:
            t.write(http_chunk(stream.tail(done=b.fault != "no_done")))
        if b.fault == "linger":
            await self._quiet(3600)
            return
        t.write(b"0\r\n\r\n")
        self.busy = False
        self._done()
        self._next()

    def _head(self) -> bytes:
        return _SSE_HEAD_CLOSE if self.default.keepalive == "close" else _SSE_HEAD

    def _done(self) -> None:
        """A response has been written in full: close the connection when the behaviour says so."""
        self.served += 1
        if self.default.keepalive in ("close", "drop") and self.transport is not None:
            self.transport.close()

    async def _fault(self, stream: Stream, b: Behaviour) -> bool:
        """Inject ``b.fault`` mid-stream; True when the response is over."""
        t = self.transport
        assert t is not None
        if b.fault == "disconnect":
            t.abort()
            return True
        if b.fault == "stall":
            await self._quiet(3600)
            return True
        extra = {
            "garbage": b"this is not server-sent events\n\n",
            "bad_json": b"data: {not json\n\n",
            "error_event": b'event: error\ndata: {"error": {"message": "injected stream error"}}\n\n',
            "error_payload": b'data: {"error": {"message": "injected error payload", "code": 500}}\n\n',
        }.get(b.fault or "")
        if extra is not None:
            t.write(http_chunk(extra))
        return False

    async def _quiet(self, seconds: float) -> None:
        """Say nothing until the client hangs up (or ``seconds`` pass)."""
        end = time.monotonic() + seconds
        while self.transport is not None and not self.transport.is_closing() and time.monotonic() < end:
            await asyncio.sleep(0.05)
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


BACKLOG = 4096  # pending connections per listening socket


async def serve(
    host: str, port: int, default: Behaviour, ready: asyncio.Event | None = None,
    protocol: Callable[[], asyncio.Protocol] | None = None, sock: socket.socket | None = None,
) -> None:  # fmt: skip
    """Serve on ``host:port``, or on the listening socket ``sock`` (:func:`listeners`) when given."""
    loop = asyncio.get_running_loop()
    factory = protocol or (lambda: Conn(default))
    if sock is not None:
        server = await loop.create_server(factory, sock=sock, backlog=BACKLOG)
    else:
        server = await loop.create_server(factory, host, port, backlog=BACKLOG, reuse_address=True)
    if ready is not None:
        ready.set()
    async with server:
        await server.serve_forever()


def listeners(host: str, port: int, n: int) -> list[socket.socket]:
    """``n`` sockets listening on ``host:port``, one ``SO_REUSEPORT`` group when ``n`` > 1."""
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if n > 1:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind((host, port))
        s.listen(BACKLOG)
        socks.append(s)
    return socks


def fork_over(socks: list[socket.socket]) -> socket.socket:
    """Fork a child per socket after the first; returns the socket this process serves (the first in the
    caller, its own in each child) with the others closed. Call it before any event loop or thread exists."""
    mine = socks[0]
    for s in socks[1:]:
        if os.fork() == 0:
            mine = s
            break
    for s in socks:
        if s is not mine:
            s.close()
    return mine


class NullServerProcess:
    """The null server in a child process, started and stopped by the one launcher
    (:class:`backends.launcher.ServerProcess`: own process group, health check, SIGTERM then SIGKILL);
    ``with NullServerProcess(itl=0.001) as url: ...``.

    A sibling server subclasses it with its own ``module`` and ``options()`` (its command-line flags)."""

    module = "loadgen.testservers.null"

    def __init__(self, host: str = "127.0.0.1", processes: int = 1, **behaviour: Any) -> None:
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        self.host, self.port, self.processes = host, free_port(host), processes
        self.behaviour = Behaviour().update(behaviour)
        self.server: ServerProcess | None = None

    def options(self) -> list[str]:
        return ["--behaviour", json.dumps(asdict(self.behaviour)), "--processes", str(self.processes)]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self.server.proc if self.server is not None else None

    def pids(self) -> list[int]:
        """The serving processes: the launched one, then the children it forked (``processes``)."""
        if self.proc is None:
            return []
        return [self.proc.pid, *(c.pid for c in psutil.Process(self.proc.pid).children())]

    def start(self, timeout: float = 60.0) -> str:
        """Start it (output to this process's stdout/stderr) and wait for ``/health``; raises
        :class:`backends.launcher.LaunchError` when it exits or does not answer within ``timeout``."""
        argv = [sys.executable, "-m", self.module, "--host", self.host, "--port", str(self.port), *self.options()]
        self.server = ServerProcess(argv, self.port, None, health_timeout_s=timeout, stop_grace_s=5.0, host=self.host)
        self.server.start()
        return self.url

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.server = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m loadgen.testservers.null", description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8099)
    ap.add_argument("--behaviour", default="{}", help="JSON object of default Behaviour fields")
    ap.add_argument("--processes", type=int, default=1, help="serving processes on the one port (SO_REUSEPORT)")
    args = ap.parse_args(argv)
    default = Behaviour().update(json.loads(args.behaviour))
    sock = fork_over(listeners(args.host, args.port, args.processes))
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(args.host, args.port, default, sock=sock))
    else:
        uvloop.run(serve(args.host, args.port, default, sock=sock))


if __name__ == "__main__":
    main()
