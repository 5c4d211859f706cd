"""The known-answer service models (loadgen.testservers.servicemodel) that the capacity tests search."""

from __future__ import annotations

from loadgen.testservers.servicemodel import ServiceModel

SIM = ServiceModel()  # 8 slots, prefill 4 ms + 0.1 ms/token, decode step 4 ms + 1 ms per occupied slot
SIM_JOB = (60, 16)
SIM_MIX = [(p, o) for p in range(20, 401, 20) for o in range(2, 41, 2)]  # each request its own lengths


# The live known-answer server: 8 slots, prefill 3 ms + 0.075 ms/token, decode step 3 ms + 6 ms per occupied
# slot. Its latencies sit tens of ms from the SLOs of the live tests (tests/test_capacity_cli.py), so a loaded
# machine's scheduling delay does not move the answer; the statistics at p90/p99 and the seed counts are the
# virtual-time tests' job.
LIVE = ServiceModel(slots=8, prefill_base=0.003, prefill_per_token=0.000075, decode_base=0.003, decode_per_seq=0.006)

# Issue 40's reference server on chat-short (64-256 token prompts, 32-128 token answers): its decode step grows by
# ~2.2 ms per session (TPOT p90 120 ms at 53 sessions, 144 ms at 64, as measured there), 256 slots (no queue).
REFERENCE_LIKE = ServiceModel(slots=256, prefill_base=0.01, prefill_per_token=0.001, decode_base=0.0032,
                              decode_per_seq=0.0022)  # fmt: skip
CHAT_SHORT = [(p + 20, o) for p in range(64, 257, 16) for o in range(32, 129, 8)]  # + the chat template's tokens
