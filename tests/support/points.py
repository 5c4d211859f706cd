"""One load point against the null/fault server (``tests/test_engine_*.py``)."""

from backends.openai import OpenAIBackend
from loadgen.dispatch.engine import run_point
from loadgen.experiments.calibrate import FixedWorkload
from loadgen.timing.clock import RunClock
from workloads.contracts import read_jsonl


def ns(**kw):
    return {"nullserver": kw}


async def point(url, tmp_path, load, wl=None, backend=None, **kw):
    backend = backend or OpenAIBackend(url, model="null")
    s = await run_point(backend, wl or FixedWorkload(max_tokens=8), load, tmp_path / "p", RunClock(), **kw)
    return s, read_jsonl(tmp_path / "p" / "requests.jsonl")
