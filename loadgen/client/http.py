"""The HTTP client and one request's life: send, read the SSE stream, fill a :class:`RequestRecord`.

The client is aiohttp; ``--client httpx`` sends through an httpx transport instead, for comparison (httpx's
own connection pool collapses above ~100 concurrent streams). Measurements: docs/performance.md.
The stream is read into the record by :class:`loadgen.client.streamreader.StreamReader`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Protocol

import aiohttp
import httpx
import orjson

from backends.base import Backend
from loadgen.client.streamreader import StreamReader
from loadgen.defaults import REQUEST_TIMEOUT_S, STALL_TIMEOUT_S
from loadgen.timing.clock import RunClock
from workloads.contracts import GenRequest, RequestRecord

CLIENT_KINDS = ("aiohttp", "httpx")
_ERROR_BODY_LIMIT = 64 * 1024
DONE_GRACE_S = 0.1  # after the end marker, how long the rest of the body may take before the connection is dropped


class StaleConnection(Exception):
    """A reused keep-alive connection failed before the server sent any byte of a response.

    Almost always the server closed the idle connection (llama-server does right after a stream ends)
    while the client was already reusing it, so the request never reached a handler; as browsers do,
    it is sent once more on a fresh connection. A server that really drops a request fails the fresh
    attempt too, and that error is recorded. The cause is the transport's own exception."""


class _Attempt:
    """What the transport did for one send: whether it reused a pooled connection."""

    __slots__ = ("reused",)

    def __init__(self) -> None:
        self.reused = False


_ATTEMPT: ContextVar[_Attempt | None] = ContextVar("servelab_attempt", default=None)


async def _on_reuse(*_: object) -> None:  # aiohttp TraceConfig signal, runs in the sending task
    if (attempt := _ATTEMPT.get()) is not None:
        attempt.reused = True


_REUSE_TRACE = aiohttp.TraceConfig()
_REUSE_TRACE.on_connection_reuseconn.append(_on_reuse)
_REUSE_TRACE.freeze()


class Response(Protocol):
    """What :func:`execute` reads of a response: httpx's ``Response`` has it, aiohttp's through
    :class:`_AiohttpResponse`."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    def aiter_raw(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


class _AiohttpResponse:
    __slots__ = ("_resp",)

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp

    @property
    def status_code(self) -> int:
        return self._resp.status

    @property
    def headers(self) -> Mapping[str, str]:
        return self._resp.headers

    def aiter_raw(self) -> AsyncIterator[bytes]:
        return self._resp.content.iter_any()  # what has arrived, in one piece: one read, one timestamp

    def body_read(self) -> bool:
        """The whole body has arrived and been read (the chunked terminator came with the last events)."""
        return self._resp.content.at_eof()

    async def aclose(self) -> None:
        self._resp.release()


class HttpClient:
    """POST a request and stream its response, with as little per-request work as the transport allows.

    ``aiohttp`` (the default) is sent straight through ``aiohttp.ClientSession``; ``httpx`` straight to an
    httpx transport, skipping ``httpx.AsyncClient``'s per-request work a load generator does not need (URL
    re-parsing, header and cookie merging, auth and redirects). Before, the default went through httpx and the
    ``httpx-aiohttp`` bridge: 155 us of CPU per request where aiohttp alone spends 85 (docs/performance.md).

    The pooled sender keeps connections alive; ``fresh`` never reuses one (each request opens its own
    connection): it carries the one retry of a request whose pooled connection turned out to be closed.
    """

    def __init__(self, kind: str, max_connections: int, connect_timeout: float, stall_timeout: float) -> None:
        if kind not in CLIENT_KINDS:
            raise ValueError(f"unknown client {kind!r}; choose one of {', '.join(CLIENT_KINDS)}")
        self.kind, self.max_connections = kind, max_connections
        self._sessions: dict[bool, aiohttp.ClientSession] = {}
        self._aiohttp_timeout = aiohttp.ClientTimeout(sock_connect=connect_timeout, sock_read=stall_timeout)
        self._httpx_timeout = httpx.Timeout(connect=connect_timeout, read=stall_timeout, write=connect_timeout,
                                            pool=None).as_dict()  # fmt: skip
        self._transports: dict[bool, httpx.AsyncHTTPTransport] = {}
        self._urls: dict[str, httpx.URL] = {}

    @asynccontextmanager
    async def stream(self, url: str, content: bytes, headers: dict[str, str], fresh: bool = False) -> AsyncIterator[Response]:
        """POST ``content`` to ``url``; yields the response with its body unread.

        Raises :class:`StaleConnection` when a reused connection failed before any response byte
        (never for ``fresh=True``, which opens a new connection)."""
        attempt = _Attempt()
        token = _ATTEMPT.set(attempt)
        try:
            if self.kind == "aiohttp":
                resp: Response = _AiohttpResponse(await self._session(fresh).post(
                    url, data=content, headers=headers, timeout=self._aiohttp_timeout))  # fmt: skip
            else:
                resp = await self._httpx(url, content, headers, fresh, attempt)
        except (httpx.HTTPError, aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            if attempt.reused and not _is_timeout(exc):
                raise StaleConnection(f"{type(exc).__name__}: {exc}") from exc
            raise
        finally:
            _ATTEMPT.reset(token)
        try:
            yield resp
        finally:
            await resp.aclose()

    def _session(self, fresh: bool) -> aiohttp.ClientSession:
        """The pooled or the fresh-connection session, created on first use inside the running loop."""
        session = self._sessions.get(fresh)
        if session is None:
            connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0, force_close=fresh)
            session = self._sessions[fresh] = aiohttp.ClientSession(
                connector=connector, cookie_jar=aiohttp.DummyCookieJar(), trace_configs=[] if fresh else [_REUSE_TRACE],
                auto_decompress=False, skip_auto_headers=("User-Agent",))  # fmt: skip
        return session

    async def _httpx(self, url: str, content: bytes, headers: dict[str, str], fresh: bool,
                     attempt: _Attempt) -> httpx.Response:  # fmt: skip
        transport = self._transports.get(fresh)
        if transport is None:
            keep = 0 if fresh else self.max_connections
            limits = httpx.Limits(max_connections=self.max_connections, max_keepalive_connections=keep)
            transport = self._transports[fresh] = httpx.AsyncHTTPTransport(limits=limits, trust_env=False)
        u = self._urls.get(url)
        if u is None:
            u = self._urls[url] = httpx.URL(url)
        ext: dict[str, object] = {"timeout": self._httpx_timeout}
        if not fresh:
            ext["trace"] = _httpcore_trace(attempt)
        return await transport.handle_async_request(httpx.Request("POST", u, content=content, headers=headers,
                                                                  extensions=ext))  # fmt: skip

    async def aclose(self) -> None:
        for session in self._sessions.values():
            await session.close()
        for transport in self._transports.values():
            await transport.aclose()


def _httpcore_trace(attempt: _Attempt) -> Callable[[str, dict[str, object]], Awaitable[None]]:
    """httpcore's per-request trace hook: a request that starts writing without having opened a TCP
    connection went out on a pooled one."""
    connected = False

    async def trace(event: str, _: dict[str, object]) -> None:
        nonlocal connected
        if event.startswith("connection.connect_tcp."):
            connected = True
        elif event == "http11.send_request_headers.started" and not connected:
            attempt.reused = True

    return trace


def _is_timeout(exc: BaseException) -> bool:
    """A timeout means the server may have the request (or is too slow to take it): never resent."""
    return isinstance(exc, httpx.TimeoutException | asyncio.TimeoutError | TimeoutError)


def make_client(
    kind: str = "aiohttp", max_connections: int = 1024, connect_timeout: float = 10.0,
    stall_timeout: float = STALL_TIMEOUT_S,
) -> HttpClient:  # fmt: skip
    """``stall_timeout`` is the longest wait for any byte of a response (headers included)."""
    return HttpClient(kind, max_connections, connect_timeout, stall_timeout)


async def execute(
    client: HttpClient, backend: Backend, req: GenRequest, rec: RequestRecord, clock: RunClock,
    timeout: float = REQUEST_TIMEOUT_S,
) -> str:
    """Send ``req``, fill ``rec`` (times, events, counts, error) and return the response text.

    Never raises for server or network faults (they become ``rec.error``); on cancellation the record
    is closed as ``cancelled`` and the cancellation propagates.
    """
    call = backend.build(req)
    reader = StreamReader(backend, rec, clock)
    content = orjson.dumps(call.body)
    expect = "text/event-stream" if call.stream else "application/json"
    # identity: the body is read raw (no decompression), and a JSON answer is worth a server's gzip
    headers = {"content-type": "application/json", "accept": expect, "accept-encoding": "identity", **call.headers}
    url = backend.base_url + call.path
    fresh = False
    while True:
        rec.sent = clock.now()  # a retried request's send time is the retry's
        try:
            async with client.stream(url, content, headers, fresh) as resp:
                rec.headers = clock.now()
                rec.status = resp.status_code
                ctype = resp.headers.get("content-type", "")
                if resp.status_code >= 400 or expect not in ctype:
                    body = await _read_limited(resp)
                    _http_error(rec, resp.status_code, ctype, body, expect)
                elif not call.stream:
                    try:
                        body = await asyncio.wait_for(_read_all(resp), max(0.0, rec.sent + timeout - clock.now()))
                    except asyncio.TimeoutError:
                        rec.set_error("timeout", f"request took longer than {timeout:g} s")
                    else:
                        reader.whole(body, call, clock.now())
                else:
                    deadline = t = rec.sent + timeout
                    chunks = resp.aiter_raw()
                    async for chunk in chunks:
                        t = clock.now()
                        if reader.feed(chunk, t) or t > deadline:
                            break
                    else:
                        reader.close(clock.now())
                    if rec.error is None and t > deadline:
                        rec.set_error("timeout", f"request took longer than {timeout:g} s")
                    elif rec.error is None and reader.done and not _body_read(resp):
                        await _drain_after_end(chunks)
        except StaleConnection:  # nothing reached the server: once more, on a connection of its own
            rec.retries += 1
            fresh = True
            continue
        except asyncio.CancelledError:
            rec.end = clock.now()
            rec.set_error("cancelled", "run interrupted")
            reader.finish(req)
            raise
        except (httpx.HTTPError, aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            rec.set_error(_classify(exc, rec.headers is not None), f"{type(exc).__name__}: {exc}")
        break
    rec.end = clock.now()
    text = reader.finish(req)
    if not call.counted:
        rec.prompt_tokens_intended = None
    return text


def _body_read(resp: Response) -> bool:
    """Nothing of the body is left to read: draining it would only cost a task and a timer (~0.1 ms of
    CPU per request, a quarter of a short stream's). Known for aiohttp; httpx's responses are drained."""
    return isinstance(resp, _AiohttpResponse) and resp.body_read()


async def _drain_after_end(chunks: AsyncIterator[bytes]) -> None:
    """After the end marker: read what is left of the body (the chunked terminator, normally there at
    once) so that the connection can be reused, but never wait on a stream held open after it (a proxy):
    after ``DONE_GRACE_S`` of silence the connection is closed instead. Nothing read here is content,
    and no fault here is an error: the answer was complete."""
    try:  # anext with a default ends in None, not StopAsyncIteration: an exception kept by wait_for's task
        # would hold the frames in a reference cycle, each request's garbage for the cyclic GC's pauses
        while await asyncio.wait_for(anext(chunks, None), DONE_GRACE_S) is not None:
            pass
    except (asyncio.TimeoutError, httpx.HTTPError, aiohttp.ClientError, OSError):
        pass


async def _read_all(resp: Response) -> bytes:
    """A whole JSON answer (an embeddings response is ~10 kB per input): no limit but the request's timeout."""
    return b"".join([chunk async for chunk in resp.aiter_raw()])


async def _read_limited(resp: httpx.Response) -> bytes:
    body = b""
    async for chunk in resp.aiter_raw():
        body += chunk
        if len(body) >= _ERROR_BODY_LIMIT:
            break
    return body


def _http_error(rec: RequestRecord, status: int, ctype: str, body: bytes, expect: str) -> None:
    text = body.decode("utf-8", "replace")
    try:  # OpenAI-style {"error": {"message": ...}} bodies: keep just the message
        obj = json.loads(text)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        text = str(err.get("message", err) if isinstance(err, dict) else err)
    except ValueError:
        pass
    if status == 429:
        kind = "http_429"
    elif status >= 500:
        kind = "http_5xx"
    elif status >= 400:
        kind = "http_4xx"
    else:
        kind = "protocol"
        text = f"expected {expect}, got {ctype or 'no content-type'}: {text}"
    rec.set_error(kind, f"HTTP {status}: {text}" if status >= 400 else text)


def _classify(exc: BaseException, got_headers: bool) -> str:
    cause = exc.__cause__ or exc
    if isinstance(cause, aiohttp.ServerDisconnectedError | httpx.RemoteProtocolError | aiohttp.ClientPayloadError):
        return "disconnect"
    if isinstance(cause, httpx.ConnectTimeout | httpx.ConnectError | aiohttp.ClientConnectorError
                  | aiohttp.ConnectionTimeoutError) and not got_headers:  # fmt: skip
        return "connect"
    if isinstance(exc, httpx.TimeoutException):
        return "stall" if got_headers else "timeout"
    if isinstance(cause, asyncio.TimeoutError | TimeoutError):
        return "stall" if got_headers else "timeout"
    if got_headers:
        return "disconnect"
    return "connect"


async def probe(base_url: str, path: str = "/health", timeout: float = 5.0) -> bool:
    """Is a server still there? Any HTTP answer (even 404 or 503) or a slow one (it accepted the
    connection) says yes; a refused, reset or closed connection says no."""
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=timeout) as c:
            await c.get(base_url + path)
    except httpx.TimeoutException as exc:
        return not isinstance(exc, httpx.ConnectTimeout)
    except (httpx.HTTPError, OSError):
        return False
    return True
