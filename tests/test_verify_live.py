"""``bench verify`` against a real llama-server (-np 4) on the bundled GGUF, as a user types it."""

import json

import pytest
from support.cli import fixed_workload
from test_llamaserver import _llama_server, llama_binary  # noqa: F401  (tests/ is on sys.path; the binary's fixture)
from typer.testing import CliRunner

from loadgen.cli.app import app

pytestmark = [pytest.mark.llamaserver, pytest.mark.agreement]  # make test-agreement (a CI step), not the default suite


@pytest.fixture(scope="module")
def server4(tmp_path_factory):
    yield from _llama_server(tmp_path_factory, 4)


def test_bench_verify_live(server4, tmp_path):
    """Issue 39: 8 short prompts, 16-token greedy answers, alone then at concurrency 1 and 4: no errors, a
    verdict per load point, the exit code as the verdicts say, and a margin for every divergence
    (llama-server answers logprobs). Measured with build 11434 on 2 shared cores: identical 100 % at both,
    the reference's prompts served from the prefix cache (96 % of prompt tokens cached)."""
    wl = fixed_workload(tmp_path / "wl.toml", prompt=24, output=16)
    res = CliRunner().invoke(app, [
        "verify", "--url", server4.base_url, "--workload", str(wl), "--concurrency", "1,4", "--num-requests", "8",
        "--output-dir", str(tmp_path), "--run-id", "v",
    ])  # fmt: skip
    assert res.exit_code in (0, 1), res.output
    points = {p["point_id"]: p for p in json.loads((tmp_path / "v" / "summary.json").read_text())["points"]}
    assert list(points) == ["reference", "c001", "c004"]
    assert all(p["counts"]["errors"] == 0 and p["counts"]["ok"] == 8 for p in points.values()), res.output
    verdicts = []
    for pid in ("c001", "c004"):
        q = points[pid]["quality"]
        assert q["compared"] == 8 and q["verdict"] in ("pass", "fail")
        assert all(d["margin"] is not None for d in q["diverged"]), q["diverged"]
        verdicts.append(q["verdict"])
    assert ("fail" in verdicts) == (res.exit_code == 1), res.output
