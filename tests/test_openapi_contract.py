"""The reference server's OpenAPI document says what it does: schemathesis, with all its checks, against
``/openapi.json`` of a live server (valid bodies accepted, invalid ones rejected, every status, content type
and body documented, no 5xx). The one exception is the rule no schema can state, prompt + max_tokens within
the context (tests/support/openapi_hooks.py). Bounded and repeatable: the small_server's 64-token context
caps each request's work, a fixed seed and example count make CI send the same cases every time. A response
may take as long as the request timeout: schemathesis' own 10 s limit failed a rerank of 2048 documents, which
took 10.9 s on one thread of an AMD Zen 3 in float32."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.contract  # its own CI step (make test-contract), beside the default suite
SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"


def test_schemathesis_all_checks_find_nothing(small_server, tmp_path):
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.support.openapi_hooks", "PYTHONPATH": str(Path(__file__).parents[1])}
    out = subprocess.run([str(SCHEMATHESIS), "run", f"{small_server.url}/openapi.json", "--checks", "all",
                          "--max-examples", "15", "--seed", "1", "--request-timeout", "120", "--max-response-time", "120",
                          "--workers", "1"],
                         capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    report = out.stdout + out.stderr
    assert out.returncode == 0, report[-6000:]
    assert "Tested: 10" in report and " generated, " in report, report[-3000:]  # every operation, cases sent
