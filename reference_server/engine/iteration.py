"""One engine step's record (``GET /v1/iterations``), read by the engine's log and the speculation governor."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class IterationRecord:
    """One engine step, exactly: wall-clock (unix) start/end, who was in the batch, what it computed."""

    i: int
    t_unix: float  # step start
    t_end_unix: float
    seq_ids: list[str]
    prefill_tokens: int
    decode_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_running: int
    num_waiting: int
    preempted: list[str]
    padding_tokens: int = 0  # static/dynamic batching: rows computed for finished members (output unused)
    output_tokens: int = 0  # tokens emitted to requests (sampled tokens plus accepted draft tokens)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)
