"""A strict, incremental Server-Sent Events parser.

Feed it the raw bytes of a response as they arrive; it returns each complete event. It accepts what
the SSE spec allows (LF, CRLF or CR line ends, ``:`` comment lines, multi-line ``data:`` joined with
``\\n``, ``event:``/``id:``/``retry:`` fields) and rejects what a real server never sends: any other
line is a protocol error, as is invalid UTF-8 or a stream that ends in the middle of a line.
"""

from __future__ import annotations

from dataclasses import dataclass


class SSEError(ValueError):
    """The byte stream is not valid SSE."""


@dataclass(slots=True)
class SSEEvent:
    data: str
    event: str | None = None  # the ``event:`` field; None means the default "message"


_KNOWN_IGNORED = (b"id", b"retry")


class SSEParser:
    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Events completed by ``chunk`` (an event ends at a blank line)."""
        return [SSEEvent(decode_data(f)) if type(f) is bytes else f for f in self.frames(chunk)]  # type: ignore[misc]

    def frames(self, chunk: bytes) -> list[bytes | SSEEvent]:
        """Like :meth:`feed`, but the common frame, one ``data: ...`` line, comes back as its raw
        payload bytes, not yet checked as UTF-8: the caller validates it (a JSON decoder rejects invalid
        UTF-8) or decodes it with :func:`decode_data`. Anything else is an :class:`SSEEvent`."""
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
            # a CR at the very end may be the first half of a CRLF split across chunks
            held = buf.endswith(b"\r")
            buf = buf[:-1].replace(b"\r", b"\n") + b"\r" if held else buf.replace(b"\r", b"\n")
        blocks = buf.split(b"\n\n")
        self._buf = blocks.pop()
        n = len(blocks)
        # all blocks single ``data: `` lines: the separators are the only newlines and each is followed
        # by ``data: `` (the first block is checked on its own)
        if n and buf.count(b"\n", 0, len(buf) - len(self._buf)) == 2 * n and blocks[0][:6] == b"data: " and (
            n == 1 or buf.count(b"\n\ndata: ", 0, len(buf) - len(self._buf)) == n - 1
        ):
            return [b[6:] for b in blocks]
        out: list[bytes | SSEEvent] = []
        append = out.append
        for block in blocks:
            if block[:6] == b"data: " and b"\n" not in block:  # the common case, inline
                append(block[6:])
            elif (ev := _parse_block(block)) is not None:
                append(ev)
        return out

    def close(self) -> list[SSEEvent]:
        """End of stream: a last event without its blank line is accepted, a cut-off line is not."""
        rest, self._buf = self._buf.replace(b"\r", b"\n"), b""
        if not rest.strip(b"\n"):
            return []
        if not rest.endswith(b"\n"):
            raise SSEError(f"stream ended mid-line: {rest[-80:]!r}")
        ev = _parse_block(rest.rstrip(b"\n"))
        return [ev] if ev is not None else []


def _parse_block(block: bytes) -> SSEEvent | None:
    data: list[bytes] = []
    event: str | None = None
    for line in block.split(b"\n"):
        if not line or line[0] == 58:  # empty (leading blank lines) or ":" comment
            continue
        name, _, value = line.partition(b":")
        if value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            data.append(value)
        elif name == b"event":
            event = decode_data(value)
        elif name not in _KNOWN_IGNORED:
            raise SSEError(f"not an SSE line: {line[:120]!r}")
    if not data and event is None:
        return None  # comments / keep-alives only
    return SSEEvent(decode_data(b"\n".join(data)), event)


def decode_data(raw: bytes) -> str:
    """Field bytes (e.g. a raw payload from :meth:`SSEParser.frames`) as text; SSEError when not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SSEError(f"event is not UTF-8: {raw[:80]!r}") from exc
