"""Test servers: the fault-injecting null SSE server (:mod:`.null`, its responses in :mod:`.stream`) and the
known-answer service model (:mod:`.servicemodel`), each run in its own process by ``python -m``."""
