"""The client's hot path (raw SSE frames + ``Backend.plain_texts``) records exactly what the general
path (``SSEParser.feed`` + ``Backend.parse`` per event) records, for plain and unusual streams."""

import json

import pytest

from backends.base import ParseState
from backends.openai import OpenAIBackend
from loadgen.client.streamreader import StreamReader
from loadgen.timing.clock import RunClock
from workloads.contracts import GenRequest, RequestRecord


class GeneralOnly(OpenAIBackend):
    """Same protocol, but overriding ``parse`` turns the fast path off: every event goes through it."""

    def parse(self, data: str, state: ParseState):
        return super().parse(data, state)


def data(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def cmpl(text, finish=None, **extra) -> bytes:
    return data({"id": "c", "choices": [{"index": 0, "text": text, "finish_reason": finish}], **extra})


def chat(delta, finish=None) -> bytes:
    return data({"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


USAGE = data({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}})
DONE = b"data: [DONE]\n\n"

STREAMS = {
    "plain": cmpl("a") + cmpl(" b") + cmpl("") + cmpl(" c") + cmpl(" d", "length") + USAGE + DONE,
    "chat": chat({"role": "assistant", "content": ""}) + chat({"reasoning_content": "hm"}) + chat({"content": "x"})
    + chat({"content": None}) + chat({}, "stop") + USAGE + DONE,
    "continuous_usage": b"".join(
        cmpl("ab", usage={"prompt_tokens": 5, "completion_tokens": 2 * i}) for i in range(1, 4)
    ) + DONE,
    "token_ids": cmpl("a") + data({"choices": [{"text": "bc", "token_ids": [7, 8]}]}) + cmpl("d") + DONE,
    "no_done": cmpl("a") + cmpl("b"),
    "bad_json": cmpl("a") + b"data: {not json\n\n" + cmpl("b") + DONE,
    "not_utf8": cmpl("a") + b'data: {"choices":[{"text":"\xff"}]}\n\n' + DONE,
    "not_object": cmpl("a") + b"data: [1, 2]\n\n" + DONE,
    "error_payload": cmpl("a") + data({"error": {"message": "boom"}}) + cmpl("b") + DONE,
    "error_event": cmpl("a") + b'event: error\ndata: {"error": "boom"}\n\n' + cmpl("b") + DONE,
    "general_frames": b": keep-alive\r\n\r\n" + cmpl("a").replace(b"\n", b"\r\n") + b'data: {"choices":\ndata: [{"text": "b"}]}\n\n'
    + b"id: 3\n" + cmpl("c") + DONE,
    "after_done": cmpl("a") + DONE + cmpl("ignored") + USAGE,
    "null_choices": data({"choices": None}) + cmpl("a") + DONE,
    "cut": cmpl("a") + b'data: {"choices":[{"te',
    "garbage": cmpl("a") + b"this is not sse\n\n" + DONE,
    "inline_think": chat({"content": "\n"}) + chat({"content": "<think>"}) + chat({"content": "Let me"})
    + chat({"content": " see.</think>"}) + chat({"content": "\n\nParis"}) + chat({"content": "."}, "stop") + DONE,
    "inline_think_one_event": cmpl("<think>hm</think>Paris") + cmpl(" is") + cmpl(" big", "length") + DONE,
    "think_later": cmpl("Paris") + cmpl(" <think>no</think>") + DONE,
    "inline_think_in_pieces": b"".join(cmpl(t) for t in ("<", "think", ">Let me", " see.</", "think", ">\n\nParis",
                                                          ".")) + DONE,
    "less_than": cmpl("<") + cmpl("3 is less") + DONE,
    "only_less_than": cmpl("<", "stop") + DONE,
}  # fmt: skip


def record(backend, stream: bytes, size: int) -> tuple[dict, str]:
    rec = RequestRecord(id="r")
    reader = StreamReader(backend, rec, RunClock())
    for i in range(0, len(stream), size):
        if reader.feed(stream[i : i + size], float(i)):
            break
    else:
        reader.close(-1.0)
    text = reader.finish(GenRequest("r", "p", 4, prompt_tokens=3))
    return rec.to_dict(), text


@pytest.mark.parametrize("name", sorted(STREAMS))
@pytest.mark.parametrize("size", [1, 7, 64, 1 << 20])
def test_fast_path_records_what_the_general_path_records(name, size):
    stream = STREAMS[name]
    fast = record(OpenAIBackend("http://x"), stream, size)
    assert fast == record(GeneralOnly("http://x"), stream, size)
    rec, text = fast
    if name == "plain" and size > len(stream):  # one chunk: one arrival time; and the right figures
        assert text == "a b c d" and rec["events"] == [[0.0, 1]] * 4 and rec["error"] is None
        assert (rec["output_tokens"], rec["output_tokens_source"], rec["finish_reason"]) == (4, "usage", "length")
    if name in ("bad_json", "not_utf8", "not_object", "garbage"):
        assert rec["error"]["kind"] == "protocol"


def test_plain_texts_takes_the_leading_run_of_plain_events_only():
    b = OpenAIBackend("http://x")
    payloads = [p[6:-2] for p in (cmpl("a"), chat({"content": "b"}), cmpl("", None), cmpl("c", "length"), cmpl("d"))]
    assert b.plain_texts(payloads) == ["a", "b", ""]  # stops at the finish reason, parse() reads the rest
    assert b.plain_texts([b"{not json", payloads[0]]) == []
    assert b.plain_texts([data({"choices": [{"text": "a"}], "usage": {"completion_tokens": 1}})[6:-2]]) == []
    assert b.plain_texts([data({"choices": [{"text": "a", "token_ids": [1]}]})[6:-2]]) == []
    assert GeneralOnly("http://x").plain_texts(payloads) == []  # a subclass's own parse() sees every event


def test_stream_cost_benchmark_reads_every_event():
    from loadgen.experiments.calibrate import stream_cost

    assert 0 < stream_cost(events=20, read_size=7, repeat=3) < 1  # raises if a null stream were misread


def test_a_run_freezes_what_survives_a_young_pass_and_the_settings_come_back_after_overlapping_runs():
    """While requests run, a young GC pass freezes its survivors (no later pass walks them: each pass stays
    short), young cyclic garbage still dies in a young pass, and the collector is as before once the last of
    two overlapping runs ends."""
    import gc

    from loadgen.dispatch.gcpolicy import GC_YOUNG, _freeze_survivors, run_gc

    before = gc.get_threshold()
    a, b = run_gc(), run_gc()
    a.__enter__()
    b.__enter__()
    assert gc.get_threshold()[0] == GC_YOUNG > before[0]
    frozen = gc.get_freeze_count()
    kept = [[i] for i in range(1000)]  # alive across the next young pass
    gc.collect(0)
    assert gc.get_freeze_count() >= frozen + len(kept)
    cycle: list = []
    cycle.append(cycle)
    del cycle
    assert gc.collect(0) >= 1  # a cycle that died young is collected, not frozen
    a.__exit__(None, None, None)  # the first run ends while the second still runs
    assert gc.get_threshold()[0] == GC_YOUNG and _freeze_survivors in gc.callbacks
    b.__exit__(None, None, None)
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0 and _freeze_survivors not in gc.callbacks


def test_reading_stops_at_the_end_marker():
    """``feed`` says stop at ``[DONE]``: whatever follows (a proxy holding the stream open, stray events) is
    never waited for, so a finished answer cannot turn into a stall; events of one read share its time."""
    rec = RequestRecord(id="r")
    reader = StreamReader(OpenAIBackend("http://x", model="m"), rec, RunClock())
    assert reader.feed(cmpl("a") + cmpl(" b"), 1.0) is False
    assert reader.feed(cmpl(" c", "length") + USAGE + DONE + cmpl("late"), 2.0) is True
    reader.finish(GenRequest(request_id="r", prompt="p", max_tokens=4))
    assert rec.error is None and [e[0] for e in rec.events] == [1.0, 1.0, 2.0]
    assert rec.output_tokens == 4 and rec.output_tokens_source == "usage"


@pytest.mark.parametrize("size", [7, 4096])
def test_an_inline_think_that_opens_the_content_is_reasoning(size):
    """A server with no reasoning parser streams a thinking model's reasoning inline, as <think>...</think>
    at the start of the content: those events are reasoning (first_output marks the answer's first), and
    the answer alone is the response text; a tag later in an answer is just text."""
    cases = [  # stream, first answer event, events (None: not checked), response text
        ("inline_think", 4, 6, "\n\nParis."),
        ("inline_think_one_event", 0, None, "Paris is big"),
        ("think_later", 0, None, "Paris <think>no</think>"),
        ("inline_think_in_pieces", 5, 7, "\n\nParis."),  # a tokenizer without a <think> token: tags in pieces
        ("less_than", 0, None, "<3 is less"),
        ("only_less_than", 0, None, "<"),
    ]
    for backend in (OpenAIBackend("http://x"), GeneralOnly("http://x")):
        for name, first, events, want in cases:
            rec, text = record(backend, STREAMS[name], size)
            assert (rec["first_output"], text) == (first, want), name
            assert events is None or len(rec["events"]) == events, name
