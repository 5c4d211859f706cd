"""Killing a run mid-way leaves a valid requests.jsonl holding every finished request."""

import json
import signal
import subprocess
import sys
import time

import pytest
from support.signals import sigint_default

SCRIPT = """
import sys
from pathlib import Path
from backends.openai import OpenAIBackend
from loadgen.experiments.calibrate import FixedWorkload
from loadgen.timing.clock import RunClock
from loadgen.dispatch.engine import run_point
from loadgen.dispatch.loadspec import LoadSpec
from loadgen.dispatch.signals import run_async
wl = FixedWorkload(max_tokens=5, extra_bodies=[{"nullserver": {"itl": 0.01}}])
run_async(run_point(OpenAIBackend(sys.argv[1], model="null"), wl, LoadSpec("closed", concurrency=4,
          num_requests=100000), Path(sys.argv[2]), RunClock()))
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_killed_run_leaves_valid_jsonl(null_server, tmp_path, sig):
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, null_server, str(tmp_path)], stderr=subprocess.PIPE,
                            preexec_fn=sigint_default)
    path = tmp_path / "requests.jsonl"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (not path.exists() or path.read_text().count("\n") < 20):
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.05)
    proc.send_signal(sig)
    proc.wait(20)
    lines = path.read_text().split("\n")
    assert lines[-1] == ""  # every written line is complete
    recs = [json.loads(line) for line in lines[:-1]]
    assert len(recs) >= 20
    finished = [r for r in recs if r["error"] is None]
    assert all(r["output_tokens"] == 5 and len(r["events"]) == 5 for r in finished)
    if sig == signal.SIGINT:  # Ctrl-C: the requests in flight are closed as cancelled, then the process exits
        cancelled = [r for r in recs if r["error"] is not None]
        assert 1 <= len(cancelled) <= 4 and {r["error"]["kind"] for r in cancelled} == {"cancelled"}
        assert len(recs) == len({r["id"] for r in recs})
