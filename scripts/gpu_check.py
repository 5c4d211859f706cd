"""``make gpu-check``: the reference server on a GPU, checked and measured in one prepared run.

A GPU machine is lent to this project now and then, for 15 minutes in all, so this script is the whole
check, rehearsed on CPU (``--rehearse``: CPU device, tiny shapes, small counts; ``tests/test_gpu_check.py``)
before the GPU ever sees it. It makes its own models (the bundled 98 MB GGUF cannot travel): seeded weights
in the SmolLM2-135M shape and in bigger Llama shapes (Llama 3.2 1B's and 3.1 8B's layers), written as GGUF files
with the bundled model's tokenizer (``--tokenizer-gguf``: the bundled model itself, or the metadata-only
GGUF that ``--export-tokenizer`` writes for carrying), so the server loads them as it loads any model.

The checks, each independent (a failure is recorded and the next one runs), in order of value:
- ``pytest``: the engine tests (greedy invariance under prefix caching, chunked prefill and preemption; the
  paged forward against a dense recompute) and the Triton kernel against its float32 reference, run by pytest
  on this device with the small seeded model as the bundled one (``$SERVELAB_MODEL``).
- ``identity``: the same seeded weights, greedy, float32: CPU (PyTorch ops) and the device (Triton kernel,
  CUDA graphs) must give the same tokens; the device's bf16 default path against its float32 one is reported
  (agreement share, and where they part, the float32 logit margin between the two tokens).
- ``decode``: the decode step at c = 64 (bf16, CUDA graphs) of the small shape, Llama 1B's and Llama 8B's: its
  GPU time (graph replays timed with events) and the engine step's wall time, against the bandwidth bound
  (weights + KV bytes read per step over the device-to-device copy rate measured here), judged on the 8B
  shape: on an H100 the 135M and the 1B shapes' steps both took ~1.6 ms of GPU time at c = 1, i.e. a fixed
  cost per layer's kernels, not bytes, sets them; CUDA graphs on vs off for each shape.
- ``batching``: continuous batching (the engine, 64 slots) against a plain ``transformers`` static batch
  (``generate`` on batches of 64, each run to its longest output: the seeds' "naive" baseline) on the same
  device and shape, same requests: output tokens per second.
- ``sweep``: ``bench sweep`` against the reference server (started by the harness) at c = 1/16/64/256 with
  NVML telemetry on; the GPU utilisation, memory, power and SM clock series are counted in its results.

Writes ``OUT/gpu_check.json`` (figures and verdicts) and ``OUT/gpu_check.log`` and copies the sweep's
report; the last lines printed are a short table. ``--budget-s`` bounds the whole run: a check that would
start past it is recorded as not run.

    python3 scripts/gpu_check.py --out DIR                  # on the GPU machine (make gpu-check PY=python3)
    python3 scripts/gpu_check.py --rehearse --out DIR       # on CPU, tiny shapes
    python3 scripts/gpu_check.py --export-tokenizer .gpu/tokenizer.gguf
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from reference_server.config import EngineConfig  # noqa: E402
from reference_server.engine import Engine  # noqa: E402
from reference_server.gguf_loader import ModelSpec, load_gguf  # noqa: E402
from reference_server.kv_cache import block_bytes  # noqa: E402
from reference_server.model_files import MODEL_ENV, default_model_path  # noqa: E402
from reference_server.model_runner import ModelRunner  # noqa: E402
from reference_server.sequence import SamplingParams, SeqStatus, Sequence  # noqa: E402
from reference_server.text import TextCodec  # noqa: E402

Record = dict[str, Any]


@dataclass(frozen=True)
class Shape:
    """A Llama shape; the vocabulary is the tokenizer's."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int


SHAPES = {
    "smollm2-135m": Shape(30, 576, 9, 3, 1536),
    "llama-1b": Shape(16, 2048, 32, 8, 8192),  # Llama 3.2 1B's layers
    "llama-3b": Shape(28, 3072, 24, 8, 8192),  # Llama 3.2 3B's
    "llama-8b": Shape(32, 4096, 32, 8, 14336),  # Llama 3.1 8B's
    "tiny": Shape(2, 128, 4, 2, 256),  # the rehearsal's stand-ins
    "tiny-wide": Shape(2, 256, 8, 2, 512),
    "tiny-deep": Shape(4, 256, 8, 2, 512),
}
CONTEXT = 8192
ROPE_THETA = 500000.0
CHECKS = ("pytest", "identity", "decode", "batching", "sweep")
PYTEST_FILES = ("tests/test_reference_engine.py", "tests/test_triton_attention.py")
NVML_SERIES = {"util": "GPU utilisation", "mem_used_b": "memory used", "power_w": "power", "sm_clock_mhz": "SM clock"}


@dataclass(frozen=True)
class Plan:
    """Sizes of one run: the GPU's, or the rehearsal's."""

    device: str
    small: str
    big: str  # the batching comparison's and the sweep's model
    decode: tuple[str, ...]  # the decode check's shapes, the last judged against its bandwidth bound
    concurrency: int  # the decode and batching point
    requests: int  # the batching comparison's requests (a multiple of ``concurrency``)
    prompt: int
    output: tuple[int, int]  # the batching comparison's output lengths, uniform in [lo, hi]
    sweep: tuple[int, ...]
    sweep_s: float  # dispatch seconds per sweep point
    identity_prompts: int
    identity_tokens: int
    pytest: tuple[str, ...]


GPU_PLAN = Plan("cuda", "smollm2-135m", "llama-1b", ("smollm2-135m", "llama-1b", "llama-8b"), 64, 128, 128, (32, 256), (1, 16, 64, 256), 12.0, 16, 32,
                PYTEST_FILES)
REHEARSAL_PLAN = Plan("cpu", "tiny", "tiny-wide", ("tiny", "tiny-wide", "tiny-deep"), 4, 8, 16, (4, 12), (1, 4), 3.0, 4, 8,
                      ("tests/test_triton_attention.py::test_rejects_layouts_it_cannot_read",
                       "tests/test_reference_engine.py::test_greedy_same_with_prefix_cache_and_chunked_prefill"))


# -- the log ----------------------------------------------------------------------------------------------
class Log:
    """Lines to stdout and to the log file, each stamped with the seconds since the start."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("w")
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        line = f"[{time.perf_counter() - self.t0:7.1f}s] {msg}"
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()


# -- seeded models ----------------------------------------------------------------------------------------
def _copy_metadata(src: Path, writer: gguf.GGUFWriter, skip: Callable[[str], bool]) -> int:
    """Every key/value of ``src`` but those ``skip`` names; returns the tokenizer's vocabulary size."""
    reader = gguf.GGUFReader(str(src))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or skip(key):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def _is_model_key(key: str) -> bool:
    return key.startswith("llama.") or key in ("general.file_type", "general.quantization_version", "general.name",
                                              "general.size_label")


def export_tokenizer(src: Path, out: Path) -> None:
    """A GGUF with ``src``'s tokenizer and other non-model metadata and no tensors (a few MB to carry)."""
    writer = gguf.GGUFWriter(str(out), "llama")
    _copy_metadata(src, writer, _is_model_key)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_seeded_gguf(tokenizer: Path, out: Path, name: str, shape: Shape, seed: int, device: str) -> Path:
    """A Llama GGUF (float16) of ``shape`` with seeded weights, drawn on ``device``, and ``tokenizer``'s vocabulary.

    Scales keep a random model well conditioned: each linear keeps its input's scale (std 1/sqrt(fan-in)),
    the residual branches shrink by sqrt(2 * layers), and the embedding (tied output head) gives logits a std
    of about 3, so greedy choices are decided by margins far above float32 rounding."""
    writer = gguf.GGUFWriter(str(out), "llama")
    vocab = _copy_metadata(tokenizer, writer, _is_model_key)
    head_dim = shape.hidden // shape.heads
    writer.add_name(f"seeded {name} (seed {seed})")
    writer.add_block_count(shape.layers)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    gen = torch.Generator(device).manual_seed(seed)
    branch = 1 / math.sqrt(2 * shape.layers)

    def normal(rows: int, cols: int, std: float) -> np.ndarray:
        t = torch.empty(rows, cols, device=device, dtype=torch.float32).normal_(0.0, std, generator=gen)
        return t.to(torch.float16).cpu().numpy()

    ones = np.ones(shape.hidden, dtype=np.float32)
    h, kvd = shape.hidden, shape.kv_heads * head_dim
    writer.add_tensor("token_embd.weight", normal(vocab, h, 3 / math.sqrt(h)))
    for i in range(shape.layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", ones)
        writer.add_tensor(p + "attn_q.weight", normal(h, h, h**-0.5))
        writer.add_tensor(p + "attn_k.weight", normal(kvd, h, h**-0.5))
        writer.add_tensor(p + "attn_v.weight", normal(kvd, h, h**-0.5))
        writer.add_tensor(p + "attn_output.weight", normal(h, h, h**-0.5 * branch))
        writer.add_tensor(p + "ffn_norm.weight", ones)
        writer.add_tensor(p + "ffn_gate.weight", normal(shape.ffn, h, h**-0.5))
        writer.add_tensor(p + "ffn_up.weight", normal(shape.ffn, h, h**-0.5))
        writer.add_tensor(p + "ffn_down.weight", normal(h, shape.ffn, shape.ffn**-0.5 * branch))
    writer.add_tensor("output_norm.weight", ones)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# -- helpers ----------------------------------------------------------------------------------------------
def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Device memory bandwidth in bytes/s, counting bytes read plus written, from a large copy (median of 10)."""
    a = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    b = torch.empty_like(a)
    times = []
    for _ in range(13):
        sync(device)
        t0 = time.perf_counter()
        b.copy_(a)
        sync(device)
        times.append(time.perf_counter() - t0)
    del a, b
    return 2 * nbytes / float(np.median(times[3:]))


def weight_bytes(spec: ModelSpec, itemsize: int) -> int:
    """Bytes of the weights one decode step reads: every linear, the (tied) output head, the norms."""
    kvd = spec.n_kv_heads * spec.head_dim
    per_layer = spec.hidden * (spec.n_heads * spec.head_dim + 2 * kvd) + spec.n_heads * spec.head_dim * spec.hidden
    per_layer += 3 * spec.hidden * spec.ffn + 2 * spec.hidden
    return (spec.n_layers * per_layer + spec.vocab * spec.hidden + spec.hidden) * itemsize


def prompts(n: int, length: int, codec: TextCodec, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids, each a different window of a seeded stream of ordinary tokens."""
    g = torch.Generator().manual_seed(seed)
    vocab = codec.tokenizer.get_vocab_size(with_added_tokens=False)
    return torch.randint(100, vocab, (n, length), generator=g).tolist()


def make_engine(path: Path, weights: tuple[ModelSpec, dict[str, torch.Tensor]], **kw: Any) -> Engine:
    config = EngineConfig(model=path, enable_prefix_caching=False, **kw)
    return Engine(config, ModelRunner(config, *weights), TextCodec(path))


def child_env() -> dict[str, str]:
    """This environment with the repository first on PYTHONPATH: the subprocesses (pytest, bench sweep and the
    server it starts) import the project from the tree, installed or not."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}


def free(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# -- checks -----------------------------------------------------------------------------------------------
def check_pytest(ctx: Context) -> Record:
    env = {**child_env(), MODEL_ENV: str(ctx.small_path)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *ctx.plan.pytest]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=ctx.left(), check=False)
    ctx.log(proc.stdout[-4000:] + proc.stderr[-2000:])
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|error|errors)", proc.stdout)}
    ok = proc.returncode == 0 and counts.get("passed", 0) > 0
    return {"ok": ok, "returncode": proc.returncode, "passed": counts.get("passed", 0),
            "failed": counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0),
            "files": list(ctx.plan.pytest), "model": str(ctx.small_path)}


def _greedy(engine: Engine, batch: list[list[int]], tokens: int) -> list[list[int]]:
    return engine.generate(batch, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))


def _margin(engine: Engine, prefix: list[int], a: int, b: int) -> float:
    """float32 logit gap between tokens ``a`` and ``b`` after ``prefix`` (one fresh forward on ``engine``)."""
    seen: list[torch.Tensor] = []
    forward = engine.runner.forward
    engine.runner.forward = lambda batch, *x, **kw: seen.append(forward(batch, *x, **kw)) or seen[-1]  # type: ignore[method-assign]
    try:
        _greedy(engine, [prefix], 1)
    finally:
        engine.runner.forward = forward  # type: ignore[method-assign]
    logits = seen[-1][-1].float().cpu()
    return abs(float(logits[a] - logits[b]))


def compare(ref: list[list[int]], got: list[list[int]], batch: list[list[int]], judge: Engine) -> Record:
    """Share of identical outputs; per divergent one, where it parts and the reference's logit margin there."""
    parts = []
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        at = next((j for j, (x, y) in enumerate(zip(r, g, strict=True)) if x != y), None)
        if at is not None:
            parts.append({"prompt": i, "at": at, "ref": r[at], "got": g[at],
                          "margin": _margin(judge, batch[i] + r[:at], r[at], g[at])})
    return {"identical": len(ref) - len(parts), "of": len(ref), "divergent": parts[:8]}


def check_identity(ctx: Context) -> Record:
    plan, dev = ctx.plan, ctx.plan.device
    weights = load_gguf(ctx.small_path)
    codec = TextCodec(ctx.small_path)
    lengths = [16 + 37 * i % 200 for i in range(plan.identity_prompts)]  # mixed: chunked and single-chunk prefills
    batch = [p[:n] for p, n in zip(prompts(plan.identity_prompts, max(lengths), codec, 1), lengths, strict=True)]
    kw: Record = {"dtype": "fp32", "num_kv_blocks": 512, "max_num_batched_tokens": 256, "max_num_seqs": 16}
    cpu = make_engine(ctx.small_path, weights, device="cpu", kernels="torch", **kw)
    ref = _greedy(cpu, batch, plan.identity_tokens)
    gpu32 = make_engine(ctx.small_path, weights, device=dev, **kw)
    got32 = _greedy(gpu32, batch, plan.identity_tokens)
    one_by_one = [_greedy(gpu32, [p], plan.identity_tokens)[0] for p in batch]
    gpu16 = make_engine(ctx.small_path, weights, device=dev, dtype="auto",
                        **{k: v for k, v in kw.items() if k != "dtype"})
    got16 = _greedy(gpu16, batch, plan.identity_tokens)
    out = {"kernels": {"cpu": cpu.runner.kernels, dev: gpu32.runner.kernels},
           "graphs": gpu32.runner.graphs is not None, "prompt_lengths": lengths, "tokens": plan.identity_tokens,
           "fp32_cpu_vs_device": compare(ref, got32, batch, cpu),
           "fp32_device_batched_vs_alone": compare(got32, one_by_one, batch, cpu),
           "device_default_vs_fp32": {"dtype": str(gpu16.runner.dtype), **compare(got32, got16, batch, cpu)}}
    out["ok"] = (out["fp32_cpu_vs_device"]["identical"] == len(batch)
                 and out["fp32_device_batched_vs_alone"]["identical"] == len(batch))
    del cpu, gpu32, gpu16
    free(dev)
    return out


def _decode_point(engine: Engine, batch: list[list[int]], steps: int, device: str) -> Record:
    """All of ``batch`` prefilled, then ``steps`` decode steps: wall time per engine step (median), and with
    CUDA graphs the GPU time of one step (the bucket's graph replayed, timed with events)."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in batch]
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in seqs):  # (requests join at the next step)
        engine.step()
    for _ in range(3):  # warm: the bucket's first replays
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    out: Record = {"concurrency": len(batch), "wall_ms": 1e3 * float(np.median(times))}
    graphs = engine.runner.graphs
    if graphs is not None and device.startswith("cuda"):
        from reference_server.cuda_graphs import pick_bucket

        bucket = pick_bucket(graphs.buckets, len(batch))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graphs.replays[bucket]()
        end.record()
        torch.cuda.synchronize()
        out["gpu_ms"] = start.elapsed_time(end) / 20
        out["bucket"] = bucket
    out["mean_context"] = float(np.mean([s.num_computed_tokens for s in seqs]))
    _finish(engine, seqs)
    return out


def _finish(engine: Engine, seqs: list[Sequence]) -> None:
    while any(s.status is not SeqStatus.FINISHED for s in seqs):
        engine.step()


def check_decode(ctx: Context) -> Record:
    """Each of the plan's decode shapes (the largest last: the one judged against its bandwidth bound); a
    shape that is neither the small nor the big model is written for this check alone and removed after."""
    plan, dev = ctx.plan, ctx.plan.device
    out: Record = {"copy_bandwidth_gbs": ctx.bandwidth / 1e9, "judged": plan.decode[-1]}
    made = {plan.small: ctx.small_path, plan.big: ctx.big_path}
    for seed, name in enumerate(plan.decode, start=10):
        path = made.get(name) or write_seeded_gguf(ctx.tokenizer, ctx.work / f"{name}.gguf", name, SHAPES[name], seed, dev)
        weights = load_gguf(path)
        spec = weights[0]
        codec = TextCodec(path)
        rows: Record = {}
        for graphs in (True, False):
            engine = make_engine(path, weights, device=dev, cuda_graphs=graphs, num_kv_blocks=2048,
                                 max_num_seqs=plan.concurrency)
            for c in (1, plan.concurrency):
                point = _decode_point(engine, prompts(c, plan.prompt, codec, 2), 32, dev)
                rows[f"c{c}_{'graphs' if graphs else 'eager'}"] = point
                ctx.log(f"decode {name} c={c} graphs={graphs}: {point}")
            dtype = engine.runner.dtype
            del engine
            free(dev)
        top = rows[f"c{plan.concurrency}_graphs"]
        itemsize = torch.empty((), dtype=dtype).element_size()
        kv_read = top["mean_context"] * plan.concurrency * block_bytes(spec, 1, dtype)
        bound_ms = 1e3 * (weight_bytes(spec, itemsize) + kv_read) / ctx.bandwidth
        gains = {f"c{c}": rows[f"c{c}_eager"]["wall_ms"] / rows[f"c{c}_graphs"]["wall_ms"]
                 for c in (1, plan.concurrency)}
        out[name] = {"params": sum(t.numel() for t in weights[1].values()), "dtype": str(dtype),
                     "weight_bytes": weight_bytes(spec, itemsize), "kv_bytes_read": kv_read, "bound_ms": bound_ms,
                     "steps": rows, "graphs_gain": gains,
                     "gpu_over_bound": top["gpu_ms"] / bound_ms if "gpu_ms" in top else None,
                     "wall_over_bound": top["wall_ms"] / bound_ms}
        del weights
        if name not in made:
            path.unlink()
    out["ok"] = True
    return out


def _output_lengths(plan: Plan) -> list[int]:
    g = torch.Generator().manual_seed(3)
    lo, hi = plan.output
    return torch.randint(lo, hi + 1, (plan.requests,), generator=g).tolist()


def _engine_throughput(engine: Engine, batch: list[list[int]], outputs: list[int], device: str) -> float:
    """Output tokens per second of ``batch`` through the engine (its slots refilled as requests finish)."""
    sync(device)
    t0 = time.perf_counter()
    seqs = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
            for p, n in zip(batch, outputs, strict=True)]
    _finish(engine, seqs)
    dt = time.perf_counter() - t0
    assert [len(s.output_token_ids) for s in seqs] == outputs
    return sum(outputs) / dt


def _hf_throughput(model: Any, batch: list[list[int]], outputs: list[int], size: int, device: str) -> float:
    """Output tokens per second of ``batch`` as static batches of ``size``, each run to its longest output."""
    sync(device)
    t0 = time.perf_counter()
    for i in range(0, len(batch), size):
        ids = torch.tensor(batch[i : i + size], device=device)
        n = max(outputs[i : i + size])
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
    sync(device)
    return sum(outputs) / (time.perf_counter() - t0)


def check_batching(ctx: Context) -> Record:
    import transformers

    plan, dev = ctx.plan, ctx.plan.device
    weights = load_gguf(ctx.big_path)
    spec = weights[0]
    codec = TextCodec(ctx.big_path)
    batch = prompts(plan.requests, plan.prompt, codec, 4)
    varied, fixed = _output_lengths(plan), [plan.output[1] // 2] * plan.requests
    engine = make_engine(ctx.big_path, weights, device=dev, num_kv_blocks=4096, max_num_seqs=plan.concurrency)
    dtype = engine.runner.dtype
    _engine_throughput(engine, batch[: plan.concurrency], [8] * plan.concurrency, dev)  # warm
    ours = {"varied": _engine_throughput(engine, batch, varied, dev),
            "fixed": _engine_throughput(engine, batch, fixed, dev)}
    del engine, weights
    free(dev)
    config = transformers.LlamaConfig(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.ffn, num_hidden_layers=spec.n_layers,
        num_attention_heads=spec.n_heads, num_key_value_heads=spec.n_kv_heads, max_position_embeddings=CONTEXT,
        rms_norm_eps=spec.rms_eps, rope_theta=spec.rope_theta, tie_word_embeddings=True)  # fmt: skip
    with torch.device(dev):
        model = transformers.LlamaForCausalLM(config).to(dtype).eval()  # same shape: its speed needs no weights
    _hf_throughput(model, batch[: plan.concurrency], [8] * plan.concurrency, plan.concurrency, dev)  # warm
    static = {"varied": _hf_throughput(model, batch, varied, plan.concurrency, dev),
              "fixed": _hf_throughput(model, batch, fixed, plan.concurrency, dev)}
    del model
    free(dev)
    gain = {k: ours[k] / static[k] for k in ours}
    return {"concurrency": plan.concurrency, "requests": plan.requests, "prompt": plan.prompt,
            "outputs": {"varied": list(plan.output), "fixed": fixed[0]}, "dtype": str(dtype),
            "transformers": transformers.__version__, "engine_tok_s": ours, "static_tok_s": static,
            "gain": gain, "ok": True}


def _series(points: Path) -> Record:
    """Samples per NVML series in the sweep's telemetry, over all its points."""
    counts = dict.fromkeys(NVML_SERIES, 0)
    gpus: set[str] = set()
    for f in points.rglob("telemetry.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            for g in rec.get("gpus") or []:
                gpus.add(str(g.get("index")))
                for k in NVML_SERIES:
                    counts[k] += g.get(k) is not None
    return {"gpus": sorted(gpus), "samples": counts}


def check_sweep(ctx: Context) -> Record:
    plan = ctx.plan
    run = ctx.work / "sweep"
    workload = ctx.work / "gpu-check.toml"
    workload.write_text(f'api = "completions"\n[arrival]\nprocess = "closed"\nconcurrency = 1\n[[classes]]\n'
                        f'name = "fixed"\nprompt = {plan.prompt}\noutput = 128\nignore_eos = true\ntemperature = 0.0\n')
    server = (f"{sys.executable} -m reference_server --model {ctx.big_path} --port {{port}} "
              f"--max-num-seqs {max(plan.sweep)} --device {plan.device}")
    cmd = [sys.executable, "-c", "from loadgen.cli import main; main()", "sweep", "--server", server, "--workload", str(workload),
           "--concurrency", ",".join(map(str, plan.sweep)), "--duration", str(plan.sweep_s),
           "--tokenizer", str(ctx.big_path), "--output-dir", str(ctx.work), "--run-id", "sweep", "--warmup", "4"]
    env = child_env()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=ctx.left(), check=False)
    ctx.log(proc.stdout[-6000:] + proc.stderr[-3000:])
    points = []
    for f in sorted((run / "points").rglob("summary.json"), key=lambda p: p.stat().st_mtime):
        s = json.loads(f.read_text())
        lat = s.get("latency", {})
        points.append({"point": f.parent.name, "requests": s["counts"]["requests"], "errors": s["counts"]["errors"],
                       "output_tok_s": _dig(s, ("throughput", "steady", "output_tok_per_s")),
                       "ttft_p50_ms": 1e3 * lat["ttft"]["p50"] if lat.get("ttft") else None,
                       "itl_p50_ms": 1e3 * lat["itl"]["p50"] if lat.get("itl") else None})
    series = _series(run / "points")
    report = run / "report.html"
    if report.is_file():
        shutil.copy(report, ctx.out / "sweep_report.html")
    nvml = all(series["samples"][k] > 0 for k in NVML_SERIES) if plan.device.startswith("cuda") else None
    errors = sum(p["errors"] for p in points)
    return {"returncode": proc.returncode, "points": points, "errors": errors, "nvml": series, "nvml_ok": nvml,
            "report": report.is_file(), "ok": proc.returncode == 0 and len(points) == len(plan.sweep) and errors == 0}


# -- the run ----------------------------------------------------------------------------------------------
@dataclass
class Context:
    plan: Plan
    out: Path
    work: Path
    log: Log
    deadline: float
    tokenizer: Path = Path()
    small_path: Path = Path()
    big_path: Path = Path()
    bandwidth: float = 0.0

    def left(self) -> float:
        return max(1.0, self.deadline - time.perf_counter())


RUNNERS: dict[str, Callable[[Context], Record]] = {
    "pytest": check_pytest, "identity": check_identity, "decode": check_decode, "batching": check_batching,
    "sweep": check_sweep,
}


@contextlib.contextmanager
def timed(record: Record) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        record["seconds"] = round(time.perf_counter() - t0, 2)


def environment(device: str) -> Record:
    import triton

    env: Record = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
                   "device": device, "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count)
    from loadgen.sidecars.gpu import gpu_inventory

    env["nvml"] = gpu_inventory()
    return env


def verdicts(results: Record) -> Record:
    """The issue's acceptance figures and verdicts, from the checks' records: a check's ``ok`` says it ran
    and its outputs were right; these say whether the GPU met its targets (None: not measured here)."""
    c = results["checks"]
    get = lambda name, *keys: _dig(c.get(name, {}), keys)  # noqa: E731
    judged = get("decode", "judged")
    over = get("decode", judged, "gpu_over_bound")
    gain = get("batching", "gain", "varied")
    return {
        "engine_tests_on_device": get("pytest", "ok"),
        "greedy_identity_cpu_eq_device": get("identity", "ok"),
        "decode_judged_shape": judged,
        "decode_gpu_over_bound": over,
        "decode_wall_over_bound": get("decode", judged, "wall_over_bound"),
        "decode_gpu_within_2x_bound": None if over is None else over <= 2.0,
        "graphs_gain": {k: get("decode", k, "graphs_gain") for k in results["plan"]["decode"]},
        "continuous_over_static": get("batching", "gain"),
        "continuous_at_least_3x_static": None if gain is None else gain >= 3.0,
        "sweep_zero_errors": get("sweep", "ok"),
        "nvml_series_in_report": get("sweep", "nvml_ok"),
    }


def _dig(rec: Any, keys: tuple[str, ...]) -> Any:
    for k in keys:
        if not isinstance(rec, dict) or k not in rec:
            return None
        rec = rec[k]
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="folder for gpu_check.json, gpu_check.log and the sweep's report")
    ap.add_argument("--rehearse", action="store_true", help="CPU device, tiny shapes, small counts")
    ap.add_argument("--big", choices=sorted(SHAPES), help=f"the big shape (default {GPU_PLAN.big})")
    ap.add_argument("--checks", default=",".join(CHECKS), help="comma-separated subset of " + ",".join(CHECKS))
    ap.add_argument("--budget-s", type=float, default=450.0, help="the whole run's time limit (default: 450)")
    ap.add_argument("--work", type=Path, default=None, help="folder for the models and the sweep (default: OUT/work)")
    ap.add_argument("--tokenizer-gguf", type=Path, default=None,
                    help="GGUF whose tokenizer the seeded models get (default: .gpu/tokenizer.gguf, else the bundled model)")
    ap.add_argument("--export-tokenizer", type=Path, default=None, metavar="PATH",
                    help="only write the tokenizer-only GGUF (from --tokenizer-gguf) to PATH and exit")
    args = ap.parse_args(argv)
    carried = REPO / ".gpu" / "tokenizer.gguf"
    tokenizer = args.tokenizer_gguf or (carried if carried.is_file() else None)
    if args.export_tokenizer:
        export_tokenizer(tokenizer or default_model_path(), args.export_tokenizer)
        print(f"wrote {args.export_tokenizer} ({args.export_tokenizer.stat().st_size / 2**20:.1f} MiB)")
        return 0
    if args.out is None:
        ap.error("--out is required")
    checks = [c for c in args.checks.split(",") if c]
    if unknown := set(checks) - set(CHECKS):
        ap.error(f"unknown checks {sorted(unknown)}: choose from {', '.join(CHECKS)}")
    plan = REHEARSAL_PLAN if args.rehearse else GPU_PLAN
    if args.big:
        plan = Plan(**{**asdict(plan), "big": args.big})
    if plan.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device here: run with --rehearse on CPU")
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    log = Log(args.out / "gpu_check.log")
    ctx = Context(plan, args.out, work, log, time.perf_counter() + args.budget_s)
    results: Record = {"plan": asdict(plan), "environment": environment(plan.device), "checks": {}}
    log(f"environment: {results['environment']}")
    try:
        ctx.tokenizer = tok = tokenizer or default_model_path()
        with timed(results.setdefault("models", {})):
            ctx.small_path = write_seeded_gguf(tok, work / f"{plan.small}.gguf", plan.small, SHAPES[plan.small], 0, plan.device)
            ctx.big_path = write_seeded_gguf(tok, work / f"{plan.big}.gguf", plan.big, SHAPES[plan.big], 1, plan.device)
        results["models"].update(tokenizer=str(tok), small=plan.small, big=plan.big,
                                 big_file_gib=round(ctx.big_path.stat().st_size / 2**30, 2))
        log(f"models: {results['models']}")
        ctx.bandwidth = copy_bandwidth(plan.device, 2**31 if plan.device.startswith("cuda") else 2**26)
        log(f"device-to-device copy: {ctx.bandwidth / 1e9:.0f} GB/s (read + write)")
    except Exception as exc:  # no models: nothing else can run
        results["models"]["error"] = f"{type(exc).__name__}: {exc}"
        log(traceback.format_exc())
        checks = []
    for name in checks:
        rec: Record = {}
        if ctx.deadline - time.perf_counter() < 10:
            rec = {"ok": None, "error": "not run: out of time (--budget-s)"}
        else:
            log(f"== {name}")
            with timed(rec):
                try:
                    rec.update(RUNNERS[name](ctx))
                except Exception as exc:
                    rec.update(ok=False, error=f"{type(exc).__name__}: {exc}")
                    log(traceback.format_exc())
        results["checks"][name] = rec
        log(f"{name}: {json.dumps(rec, default=str)[:3000]}")
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
    results["acceptance"] = verdicts(results)
    (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
    log("summary:")
    for name in checks:
        r = results["checks"][name]
        log(f"  {name:9s} ok={r.get('ok')!s:5s} {r.get('seconds', '-')!s:>6s}s {r.get('error', '')}")
    for k, v in results["acceptance"].items():
        log(f"  {k}: {json.dumps(v, default=str)}")
    return 0 if all(results["checks"][n].get("ok") is not False for n in checks) and checks else 1


if __name__ == "__main__":
    sys.exit(main())
