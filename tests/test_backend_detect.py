"""``--backend auto``: identification from recorded TGI/SGLang answers (replayed over HTTP), plain
OpenAI for a server that answers none of the probes, and an unreachable server as an error.

llama-server, the reference server and vLLM are detected live in test_llamaserver.py,
test_reference_sweep.py and test_vllm.py.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from backends.detect import PROBE_PATHS, ServerUnreachable, detect, identify
from backends.launcher import free_port

FIXTURES = Path(__file__).parent / "fixtures" / "servers"
TGI = {"/info": ("tgi_info.json", {})}
SGLANG = {"/get_server_info": ("sglang_get_server_info.json", {"server": "uvicorn"})}


def _replay(routes: dict[str, tuple[str, dict[str, str]]]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path not in routes:
                body, status, headers = b'{"error": "not found"}', 404, {}
            else:
                name, headers = routes[self.path]
                body, status = (FIXTURES / name).read_bytes(), 200
            self.send_response(status)
            self.send_header("content-type", "application/json")
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    return Handler


@pytest.fixture
def replay(request: pytest.FixtureRequest) -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _replay(request.param))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize(("replay", "backend", "server"), [
    (TGI, "tgi", "text-generation-inference 3.2.1"),
    (SGLANG, "sglang", "SGLang 0.0.0.dev1+gd852f26cb"),
], indirect=["replay"])  # fmt: skip
def test_recorded_servers_are_identified(replay, backend, server):
    det = detect(replay)
    assert (det.backend, det.server) == (backend, server), det


def test_each_recording_matches_only_its_own_endpoint():
    """TGI's /info body is no SGLang server info and the reverse; neither is vLLM's /version."""
    tgi = (FIXTURES / "tgi_info.json").read_bytes()
    sgl = (FIXTURES / "sglang_get_server_info.json").read_bytes()
    for path in PROBE_PATHS:
        t, s = identify(path, 200, {}, tgi), identify(path, 200, {}, sgl)
        assert (t.backend if t else None) == ("tgi" if path == "/info" else None), path
        assert (s.backend if s else None) == ("sglang" if path == "/get_server_info" else None), path
    assert identify("/info", 404, {}, tgi) is None  # only a 200 answer counts


def test_header_and_model_owner_rules():
    assert identify("/v1/models", 200, {"server": "llama.cpp"}, b"").backend == "llamacpp"  # type: ignore[union-attr]
    models = json.dumps({"data": [{"id": "m", "owned_by": "vllm"}]}).encode()
    assert identify("/v1/models", 200, {}, models).backend == "vllm"  # type: ignore[union-attr]
    assert identify("/version", 200, {}, b'{"version": "0.32.0"}').backend == "vllm"  # type: ignore[union-attr]
    assert identify("/version", 200, {}, b'{"version": "1", "name": "other"}') is None


def test_a_server_answering_none_is_plain_openai(null_server):
    det = detect(null_server)
    assert det.backend == "openai" and det.server is None and "none of GET" in det.evidence


def test_unreachable_server_is_an_error():
    with pytest.raises(ServerUnreachable, match="cannot connect"):
        detect(f"http://127.0.0.1:{free_port()}")


def test_bench_run_prints_and_records_the_choice(null_server, tmp_path):
    from typer.testing import CliRunner

    from loadgen.cli.app import app

    res = CliRunner().invoke(app, ["run", "--url", null_server, "--concurrency", "1", "--num-requests", "3",
                                   "--output-dir", str(tmp_path), "--run-id", "d", "--poll-hz", "0",
                                   "--telemetry-hz", "0"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "backend: openai (auto: unknown server, plain OpenAI; none of GET" in " ".join(res.output.split())
    run = json.loads((tmp_path / "d" / "run.json").read_text())
    assert run["backend_detection"]["requested"] == "auto" and run["backend_detection"]["backend"] == "openai"
    assert run["backend"]["backend"] == "openai"


def test_bench_run_against_nothing_exits_server_gone(tmp_path):
    from typer.testing import CliRunner

    from loadgen.cli.app import app
    from loadgen.exitcodes import ExitCode

    res = CliRunner().invoke(app, ["run", "--url", f"http://127.0.0.1:{free_port()}", "--output-dir", str(tmp_path)])
    assert res.exit_code == ExitCode.SERVER_GONE and "cannot connect" in res.output, res.output
