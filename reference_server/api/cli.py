"""OpenAI-compatible HTTP front end (FastAPI + uvicorn) over the engine thread.

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming with ``[DONE]``), ``/v1/models``,
``/health``, ``/metrics`` (Prometheus) and ``GET /v1/iterations?since=N`` (exact per-step records).

One request can never stop the server: bad input is a 4xx naming the field (as strict as vLLM; a field
the server does not implement is rejected unless null or its neutral default, so that vLLM's `bench serve`,
guidellm and the `openai` package work unchanged), a fault while serving one request is a 500 (or an
``error`` event on its stream) for that request alone, a client that goes away has its request aborted
(streaming or not), and if the engine loop ever dies ``/health`` and every request answer 503 at once.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import fields
from pathlib import Path

import uvicorn

from reference_server.api.app import create_app
from reference_server.config import EngineConfig
from reference_server.engine.engine import Engine
from reference_server.model.quant import linear_bytes

# Flag groups in --help order; every EngineConfig field is a flag (``--field-name``) whose group and help are
# its field metadata (config.flag). Choices come from the modules that check them; defaults from EngineConfig.
FLAG_GROUPS = {
    "model": "which model is served, and how it is computed",
    "engine": "KV cache and engine bookkeeping",
    "batching": "how requests are batched into engine steps",
    "scheduling": "which waiting request runs next, and admission",
    "speculation": "speculative decoding",
    "server": "HTTP front end",
}
_HIDDEN = ("model", "step_sleep_ms")  # --model is added by hand; step_sleep_ms is a test-only env knob


def _choices() -> dict[str, tuple[str, ...]]:
    from reference_server.config import KERNELS, KV_CACHE_DTYPES, QUANTIZATIONS, SPEC_METHODS
    from reference_server.engine.batching import BATCHING
    from reference_server.engine.policies import POLICIES

    return {"kernels": KERNELS, "quantization": QUANTIZATIONS, "kv_cache_dtype": KV_CACHE_DTYPES, "batching": BATCHING,
            "policy": POLICIES, "spec": SPEC_METHODS}


def build_parser(prog: str = "python -m reference_server") -> argparse.ArgumentParser:
    """The server's flags, grouped, each with its meaning, choices and default."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    groups = {name: p.add_argument_group(name, desc) for name, desc in FLAG_GROUPS.items()}
    model, server = groups["model"], groups["server"]
    model.add_argument("--model", type=Path, default=None, help="Llama-architecture GGUF file (default: the "
                       "bundled SmolLM2-135M-Instruct Q4_1)")  # fmt: skip
    model.add_argument("--served-model-name", default=None, help="model id in the API (default: the file's stem)")
    server.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s, loopback only)")
    server.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    server.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                        help="server log level (default: %(default)s)")  # fmt: skip
    defaults = EngineConfig(model=Path("."))
    choices = _choices()
    for f in fields(EngineConfig):
        if f.name in _HIDDEN:
            continue
        group, text = f.metadata["group"], f.metadata["help"]
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        shown = "" if default is None or "default:" in text else " (default: %(default)s)"
        if isinstance(default, bool):
            groups[group].add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=text + shown)
        else:
            kind = {"threads": int, "max_model_len": int, "num_kv_blocks": int, "draft_model": str}.get(f.name, type(default))
            groups[group].add_argument(flag, type=kind, default=default, choices=choices.get(f.name),
                                       help=text + shown)  # fmt: skip
    return p


def serve(argv: list[str] | None = None, prog: str = "python -m reference_server") -> None:
    """Parse ``argv``, load the model, then serve until interrupted (``python -m reference_server``)."""
    from reference_server.model_files import default_model_path

    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = args.model or default_model_path()
    if not model.is_file():
        raise SystemExit(f"error: model file {model} does not exist")
    t0 = time.perf_counter()
    try:
        config = EngineConfig(model=model, **{f.name: getattr(args, f.name) for f in fields(EngineConfig)
                                               if f.name not in _HIDDEN})
        engine = Engine.on_own_thread(config)
    except ValueError as e:  # bad flag values (batching, policy, speculation) are reported, not raised
        raise SystemExit(f"error: {e}") from None
    threads = f", {engine.runner.threads} threads" if engine.runner.device.type == "cpu" else ""
    threads += (f", kernels {engine.runner.kernels}, weights {engine.runner.quantization_note}: linears "
                f"{linear_bytes(engine.runner.model) / 2**20:.0f} MiB")
    print(f"loaded {model.name} on {engine.runner.device} ({engine.runner.dtype}{threads}) in {time.perf_counter() - t0:.1f} s; "
          f"KV pool {engine.runner.num_blocks} x {config.block_size} tokens, {engine.runner.kv_capacity()}; "
          f"serving on http://{args.host}:{args.port}",
          flush=True)
    uvicorn.run(create_app(engine, args.served_model_name or model.stem), host=args.host, port=args.port,
                log_level=args.log_level, access_log=False)
