"""What a command runs against: the workload it loads, the server it finds or starts, the backend for it.

Shared by ``bench run``/``sweep``, ``capacity`` and ``gate --ab``; every failure is a
:class:`~loadgen.exitcodes.UsageError` (exit 2) or :class:`~loadgen.exitcodes.ServerGone` (exit 3).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from backends.base import Backend
from backends.detect import Detection, ServerUnreachable, detect
from backends.launcher import LaunchError, ServerProcess, free_port
from backends.profile import profile_of
from backends.registry import available, get_backend, server_profiles
from loadgen.cli.exits import console
from loadgen.defaults import REQUEST_TIMEOUT_S
from loadgen.dispatch.sweep import RESET_TIMEOUT_S
from loadgen.exitcodes import ServerGone, UsageError
from workloads.base import Workload
from workloads.contracts import POOLING_APIS, GenRequest


def load_workload(name: str, tokenizer: str | None = None, field: str | None = None) -> Workload:
    from workloads.loader import load_workload as _load

    try:
        return _load(name, tokenizer=tokenizer, field=field)
    except (FileNotFoundError, KeyError, ValueError) as exc:
        raise UsageError(f"workload {name!r}: {exc}") from None


AUTO_TOKENIZER = "auto"


@dataclass(frozen=True)
class TokenizerChoice:
    """What ``--tokenizer`` resolved to. ``spec``: the tokenizer the workloads cut prompts with (None: each
    workload's own, the bundled model's unless its file names another). ``unconfirmed``: ``auto`` found no
    tokenizer of the served model's, so only the server's own count (:func:`server_counts`) can say whether
    the prompts are the lengths asked."""

    spec: str | None
    unconfirmed: bool = False


def resolve_tokenizer(spec: str, url: str | None, model: str | None, api_key: str | None) -> TokenizerChoice:
    """``--tokenizer``, checked and resolved before anything starts. A given one must load (a file, a model
    folder, a Hugging Face id). ``auto`` (the default), against ``--url``: the served model's own, where its id
    (``model``, else GET /v1/models) names a folder or a file here, or a Hugging Face id (through the cache;
    ``HF_HUB_OFFLINE=1`` keeps to it); else, and for a server bench starts itself, the workload's own, which
    :func:`server_counts` then holds against the server's tokenize endpoint."""
    from workloads.text import load_tokenizer

    if spec != AUTO_TOKENIZER:
        try:
            load_tokenizer(spec)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--tokenizer: {exc}") from None
        return TokenizerChoice(spec)
    if url is None:
        return TokenizerChoice(None, unconfirmed=True)
    served = model or _first_model(url, api_key)
    if served is not None:
        try:
            load_tokenizer(served)
        except (OSError, ValueError):
            pass
        else:
            console.print(f"[dim]tokenizer: the served model's ({served})[/]")
            return TokenizerChoice(served)
    why = f"no tokenizer of the served model {served!r} here" if served else "the server names no model"
    console.print(f"[dim]tokenizer: the workload's own ({why})[/]")
    return TokenizerChoice(None, unconfirmed=True)


def is_finite(workload: Workload) -> bool:
    """A trace or a dataset ends by itself; synthetic workloads are infinite."""
    return workload.finite


def read_api_key(api_key_env: str | None) -> str | None:
    """The API key from the environment variable named by --api-key-env (the key itself is never stored)."""
    if not api_key_env:
        return None
    api_key = os.environ.get(api_key_env)
    if not api_key:
        raise UsageError(f"--api-key-env {api_key_env}: that environment variable is not set")
    return api_key


def reset_cache_path(backend: Backend) -> str:
    """The path whose ``POST`` empties the server's prefix cache (``--reset-cache``), found by trying the
    backend's own, then every known server's, on the server itself (so the first reset happens here)."""
    paths = dict.fromkeys(p for p in (profile_of(backend).reset_cache, *(q.reset_cache for q in server_profiles())) if p)
    tried: list[str] = []
    with httpx.Client(timeout=RESET_TIMEOUT_S, trust_env=False, headers=backend.auth_headers()) as client:
        for path in paths:
            try:
                status = client.post(backend.base_url + path).status_code
            except httpx.HTTPError as exc:
                raise ServerGone(f"--reset-cache: POST {path}: {type(exc).__name__}: {exc}") from None
            if 200 <= status < 300:
                return path
            tried.append(f"POST {path}: {status}")
    raise UsageError(
        f"--reset-cache: the server at {backend.base_url} offers no prefix-cache reset ({'; '.join(tried)}). vLLM "
        "serves POST /reset_prefix_cache only with VLLM_SERVER_DEV_MODE=1 set; SGLang has POST /flush_cache; "
        "llama-server has none. Without it, each point's fresh prompts (the default) already miss the cache."
    )


def detect_server(url: str, api_key: str | None) -> Detection:
    """What the server at ``url`` is (backends.detect); an unreachable one is :class:`ServerGone`."""
    try:
        return detect(url, api_key)
    except ServerUnreachable as exc:
        raise ServerGone(f"{exc}\n  is the server running? (bench run without --url starts the bundled one)") from None


def make_backend(
    name: str, url: str, model: str | None, api: str | None, api_key: str | None, continuous_usage: bool,
    extra_body: str | None,
) -> Backend:  # fmt: skip
    """The backend ``name`` for ``url``; ``auto`` asks the server (:func:`detect_server`)."""
    if name == "auto":
        name = detect_server(url, api_key).backend
    try:
        extra = json.loads(extra_body) if extra_body else {}
    except json.JSONDecodeError as exc:
        raise UsageError(f"--extra-body is not valid JSON: {exc}") from None
    if not isinstance(extra, dict):
        raise UsageError("--extra-body must be a JSON object")
    try:
        cls = get_backend(name)
    except KeyError:
        raise UsageError(f"unknown backend {name!r}; available: auto, {', '.join(available())}") from None
    opts: dict[str, Any] = {"api": api, "extra_body": extra}
    if continuous_usage:
        opts["continuous_usage"] = True
    try:
        return cls(url, model=model or _first_model(url, api_key), api_key=api_key, **opts)  # type: ignore[call-arg]
    except (TypeError, ValueError) as exc:
        raise UsageError(f"backend {name!r}: {exc}") from None


TOKENIZE_TIMEOUT_S = 10.0  # a tokenize endpoint's answer, asked before any load


def server_counts(
    backend: Backend, workloads: Sequence[Workload], seed: int, unconfirmed: bool = False
) -> list[str]:
    """Before any load: the first completions prompt of each workload counted by the server's own tokenizer
    (its tokenize endpoint: the backend's, else the first known server's that answers) against the length the
    workload meant; a warning for each past :data:`loadgen.metrics.definitions.PROMPT_MISMATCH` (every run
    compares all its prompts with the server's usage afterwards; this says it before the run is spent).
    ``unconfirmed`` (:class:`TokenizerChoice`): the tokenizer is auto's fallback, so a server without an
    endpoint to confirm it gets a warning too; one whose count agrees (the bundled model served) gets none."""
    from loadgen.metrics.definitions import PROMPT_MISMATCH

    firsts = []
    for wl in workloads:
        req = next(iter(wl.sessions(seed)), None)
        first = req.first() if req is not None else None
        if first is not None and isinstance(first.prompt, str) and first.prompt_tokens:
            firsts.append((wl.name, first))
    fallback = (
        f" (--tokenizer auto: no tokenizer of the served model {backend.model!r} here)" if unconfirmed else ""
    )
    ways = dict.fromkeys(t for t in (profile_of(backend).tokenize, *(p.tokenize for p in server_profiles())) if t)
    with httpx.Client(base_url=backend.base_url, timeout=TOKENIZE_TIMEOUT_S, trust_env=False,
                      headers=backend.auth_headers()) as c:  # fmt: skip
        for path, key in ways:
            counted = [_counted(c, path, key, backend.model, first) for _, first in firsts]
            if firsts and None not in counted:
                return [f"the server counts {n} tokens in {name}'s first prompt, cut to {first.prompt_tokens}: the "
                        f"prompts are not the lengths asked{fallback}; pass the served model's --tokenizer"
                        for (name, first), n in zip(firsts, counted, strict=True)
                        if abs(n / first.prompt_tokens - 1) > PROMPT_MISMATCH]  # type: ignore[operator]  # fmt: skip
    if unconfirmed and firsts:
        return [f"the server has no tokenize endpoint to check the prompts against{fallback}: they are cut with the "
                "workload's own tokenizer (bundled unless its file names one) and may not be the lengths asked "
                "(each run compares them with the server's usage); pass the served model's --tokenizer"]  # fmt: skip
    return []


def _counted(client: httpx.Client, path: str, key: str, model: str | None, req: GenRequest) -> int | None:
    """The server's count of what ``req``'s intended prompt tokens count: its prompt, or a pooling request's
    inputs (summed); None when the endpoint does not answer."""
    counts = [_count(client, path, {key: text, "model": model}) for text in req.inputs or (req.prompt,)]
    return None if None in counts else sum(counts)  # type: ignore[arg-type]


def _count(client: httpx.Client, path: str, body: dict[str, Any]) -> int | None:
    """A tokenize endpoint's token count (``count``, a ``tokens`` list, or a list); None when it has none."""
    try:
        r = client.post(path, json=body)
        data = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    if isinstance(data, dict) and isinstance(data.get("count"), int):
        return data["count"]
    tokens = data.get("tokens") if isinstance(data, dict) else data
    return len(tokens) if isinstance(tokens, list) else None


def _first_model(url: str, api_key: str | None) -> str | None:
    """The server's first model from GET /v1/models; None when it has no such endpoint."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=10, trust_env=False)
        data = r.json().get("data") or []
        return str(data[0]["id"]) if r.status_code == 200 and data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return None


@contextmanager
def embedded_server(log_path: Path, timeout: float = REQUEST_TIMEOUT_S) -> Iterator[str]:
    """Start the bundled reference server on a free loopback port (the one :class:`ServerProcess`, in its
    own session: a terminal's Ctrl-C is bench's to handle); yields its URL; stops it after."""
    port = free_port()
    srv = ServerProcess([sys.executable, "-m", "reference_server", "--host", "127.0.0.1", "--port", str(port)],
                        port, log_path, health_timeout_s=timeout, stop_grace_s=15.0)  # fmt: skip
    console.print(f"[dim]starting the reference server on {srv.base_url} (log: {log_path})[/]")
    try:
        srv.start()
    except LaunchError as exc:
        raise UsageError(f"the reference server did not start: {exc}\n  see {log_path}") from None
    try:
        yield srv.base_url
    finally:
        srv.stop()


def pooling_run(api: str | None, workloads: Sequence[Workload]) -> bool:
    """Does the run call a pooling API (embeddings, rerank): ``--api``, else its workloads' requests?"""
    if api is not None:
        return api in POOLING_APIS
    firsts = [next(iter(wl.sessions(0)), None) for wl in workloads]
    return all(s is not None and s.first().api in POOLING_APIS for s in firsts)


def check_pooling_slos(metric_tags: Sequence[str], api: str | None, workloads: Sequence[Workload]) -> None:
    """A pooling run generates no token, so an SLO on a token's latency could never hold: refused before any
    load (its E2E is the latency to limit)."""
    from loadgen.metrics.definitions import TPOT, TTFO, TTFT

    if pooling_run(api, workloads) and (bad := [t for t in metric_tags if t in (TTFT.tag, TTFO.tag, TPOT.tag)]):
        raise UsageError(f"--slo {', '.join(bad)}: an embeddings or rerank run generates no token, so it has no "
                         f"{' or '.join(bad)}; limit its e2e instead (e.g. --slo e2e_p90=2s)")  # fmt: skip
