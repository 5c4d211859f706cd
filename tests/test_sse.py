import pytest

from loadgen.client.sse import SSEError, SSEEvent, SSEParser


def feed_all(chunks):
    p = SSEParser()
    out = []
    for c in chunks:
        out += p.feed(c)
    return out + p.close()


STREAM = (b": keep-alive comment\n\ndata: {\"a\": 1}\n\nid: 7\nretry: 100\ndata: line1\ndata: line2\n\n"
          b"event: error\ndata: {\"error\": \"boom\"}\n\ndata: [DONE]\n\n")
EXPECTED = [SSEEvent('{"a": 1}'), SSEEvent("line1\nline2"), SSEEvent('{"error": "boom"}', "error"), SSEEvent("[DONE]")]


def test_parses_comments_multiline_data_and_event_fields():
    assert feed_all([STREAM]) == EXPECTED


@pytest.mark.parametrize("newline", [b"\r\n", b"\r"])
def test_crlf_and_cr_line_ends_split_anywhere(newline):
    stream = STREAM.replace(b"\n", newline)
    for cut in range(1, len(stream)):
        assert feed_all([stream[:cut], stream[cut:]]) == EXPECTED, cut
    assert feed_all([bytes([b]) for b in stream]) == EXPECTED


def test_byte_by_byte_equals_whole():
    assert feed_all([bytes([b]) for b in STREAM]) == EXPECTED


def test_data_without_space_and_event_without_data():
    assert feed_all([b"data:x\n\nevent: error\n\n"]) == [SSEEvent("x"), SSEEvent("", "error")]


def test_garbage_line_is_a_protocol_error():
    p = SSEParser()
    with pytest.raises(SSEError, match="not an SSE line"):
        p.feed(b"data: ok\n\nthis is not sse\n\n")


def test_invalid_utf8_is_an_error():
    with pytest.raises(SSEError, match="UTF-8"):
        SSEParser().feed(b"data: \xff\xfe\n\n")


def test_last_event_without_blank_line_is_accepted_at_close():
    assert feed_all([b"data: a\n\ndata: [DONE]\n"]) == [SSEEvent("a"), SSEEvent("[DONE]")]


def test_stream_cut_mid_line_is_an_error_at_close():
    p = SSEParser()
    assert p.feed(b"data: a\n\ndata: {\"choi") == [SSEEvent("a")]
    with pytest.raises(SSEError, match="mid-line"):
        p.close()


def test_non_sse_json_body_is_rejected():
    p = SSEParser()
    with pytest.raises(SSEError):
        p.feed(b'{"error": {"message": "bad"}}\n\n')
