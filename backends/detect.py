"""``--backend auto``: identify the server from what it answers and pick its dialect.

Each server family has an endpoint only it answers in its own shape (formats and their sources in
``tests/fixtures/servers/README.md``); they are asked in this order and the first match wins:

============================  ==========================================================  ============
request                       match                                                       backend
============================  ==========================================================  ============
any response                  ``Server`` header names llama.cpp                           ``llamacpp``
``GET /v1/models``            ``owned_by`` ``servelab`` (the bundled reference server)    ``openai``
``GET /v1/models``            ``owned_by`` ``llamacpp`` / ``vllm`` / ``sglang``           that one
``GET /props``                ``default_generation_settings`` + ``total_slots`` (llama)   ``llamacpp``
``GET /get_server_info``      ``internal_states`` or ``version`` + ``tp_size`` (SGLang)   ``sglang``
``GET /info``                 ``router`` = ``text-generation-router`` or ``model_id`` +   ``tgi``
                              ``max_total_tokens`` (TGI)
``GET /version``              exactly ``{"version": ...}`` (vLLM)                         ``vllm``
============================  ==========================================================  ============

A server that answers none of them is driven as plain OpenAI. Only a refused connection is an error
(:class:`ServerUnreachable`); timeouts and odd answers just mean "not that one".
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import httpx

PROBE_PATHS = ("/v1/models", "/props", "/get_server_info", "/info", "/version")
_OWNED_BY = {"servelab": ("servelab reference server", "openai"), "llamacpp": ("llama.cpp llama-server", "llamacpp"),
             "vllm": ("vLLM", "vllm"), "sglang": ("SGLang", "sglang")}  # fmt: skip


class ServerUnreachable(RuntimeError):
    """Nothing accepts connections at the URL."""


@dataclass(frozen=True)
class Detection:
    backend: str  # the dialect to drive it with
    server: str | None  # what the server is, None when unknown
    evidence: str  # the request and what in its answer decided it

    def describe(self) -> dict[str, Any]:
        return asdict(self)


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


def _version(obj: Mapping[str, Any]) -> str:
    v = obj.get("version") or (obj.get("build_info") if isinstance(obj.get("build_info"), str) else None)
    return f" {v}" if v else ""


def identify(path: str, status: int, headers: Mapping[str, str], body: bytes) -> Detection | None:
    """The server, if this one answer (to ``GET path``) gives it away."""
    server_header = headers.get("server", "")
    if "llama.cpp" in server_header.lower():
        return Detection("llamacpp", "llama.cpp llama-server", f"GET {path}: Server: {server_header}")
    obj = _json(body) if status == 200 else None
    rule = _RULES.get(path)
    return rule(obj) if rule is not None and isinstance(obj, dict) else None


def _models(obj: dict[str, Any]) -> Detection | None:
    data = obj.get("data")
    first = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
    owner = str(first.get("owned_by", ""))
    if owner in _OWNED_BY:
        server, backend = _OWNED_BY[owner]
        return Detection(backend, server, f"GET /v1/models: owned_by {owner!r}")
    return None


def _props(obj: dict[str, Any]) -> Detection | None:
    if "default_generation_settings" in obj and "total_slots" in obj:
        return Detection("llamacpp", "llama.cpp llama-server" + _version(obj),
                         "GET /props: default_generation_settings, total_slots")  # fmt: skip
    return None


def _server_info(obj: dict[str, Any]) -> Detection | None:
    if "internal_states" in obj or ("version" in obj and "tp_size" in obj):
        keys = "internal_states" if "internal_states" in obj else "version, tp_size"
        return Detection("sglang", "SGLang" + _version(obj), f"GET /get_server_info: {keys}")
    return None


def _info(obj: dict[str, Any]) -> Detection | None:
    if obj.get("router") == "text-generation-router":
        return Detection("tgi", "text-generation-inference" + _version(obj), "GET /info: router")
    if "model_id" in obj and "max_total_tokens" in obj:
        return Detection("tgi", "text-generation-inference" + _version(obj), "GET /info: model_id, max_total_tokens")
    return None


def _vllm_version(obj: dict[str, Any]) -> Detection | None:
    if set(obj) == {"version"}:
        return Detection("vllm", "vLLM" + _version(obj), 'GET /version: {"version": ...}')
    return None


_RULES: dict[str, Callable[[dict[str, Any]], Detection | None]] = {
    "/v1/models": _models, "/props": _props, "/get_server_info": _server_info, "/info": _info,
    "/version": _vllm_version,
}  # fmt: skip


def detect(base_url: str, api_key: str | None = None, timeout: float = 10.0) -> Detection:
    """Ask the server at ``base_url`` (see the module docstring); plain OpenAI when nothing matches."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = base_url.rstrip("/")
    with httpx.Client(timeout=timeout, trust_env=False, headers=headers) as client:
        for i, path in enumerate(PROBE_PATHS):
            try:
                r = client.get(base + path)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                if i == 0:
                    raise ServerUnreachable(f"cannot connect to {base_url}: {exc}") from exc
                continue
            except httpx.HTTPError:
                continue
            found = identify(path, r.status_code, r.headers, r.content)
            if found is not None:
                return found
    return Detection("openai", None, f"none of GET {', '.join(PROBE_PATHS)} identified the server")
