"""``make gpu-check``'s engine checks, run in this process on the device: ``identity`` (CPU against device,
greedy), ``decode`` (the decode step against its bandwidth bound) and ``batching`` (continuous batching against
a static batch), with the device helpers they share."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gpu_check_models import CONTEXT, SHAPES, write_seeded_gguf
from gpu_check_plan import Context, Plan, Record

from reference_server.config import EngineConfig
from reference_server.engine.engine import Engine
from reference_server.engine.sequence import SamplingParams, SeqStatus, Sequence
from reference_server.model.gguf_loader import ModelSpec, load_gguf
from reference_server.model.kv_cache import block_bytes
from reference_server.model.model_runner import ModelRunner
from reference_server.model.text import TextCodec


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


def free(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


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
        from reference_server.model.cuda_graphs import pick_bucket

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
