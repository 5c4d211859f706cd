"""Turns a scheduled batch into one flattened forward pass over the paged KV cache, then samples.

Size: one model step and what it needs: KV pool sizing, prefill/decode batch building, CUDA graphs and the
kernel choice share the runner's buffers.
"""

from __future__ import annotations

import os
from itertools import accumulate
from pathlib import Path
from typing import Protocol

import psutil
import torch

from reference_server.config import DEFAULT_CPU_KV_BLOCKS, EngineConfig
from reference_server.engine.scheduler import ScheduledBatch
from reference_server.engine.sequence import SamplingParams, Sequence
from reference_server.kernels.native import CpuKernels, cpu_kernels, supports
from reference_server.model.cuda_graphs import DecodeGraphs, graph_buckets
from reference_server.model.fused_decode import FusedDecode
from reference_server.model.gguf_loader import ModelSpec, load_gguf
from reference_server.model.kv_cache import LayerKV, allocate, block_bytes, capacity_line, pick_kv_dtype
from reference_server.model.logprobs import StepLogprobs, TokenLogprobs
from reference_server.model.model import AttnBatch, LlamaModel, PagedAttention, PagedBatch, PrefillGroup
from reference_server.model.pooling import pool
from reference_server.model.quant import Quantizer, auto_quantization
from reference_server.model.sampler import sample


class Speculator(Protocol):
    """What a step needs of speculative decoding (``spec_decode.SpecDecoder``): the draws that verify a
    drafted row, computed on the device, and the tokens they let through, once read back."""

    def draws(self, seq: Sequence, logits: torch.Tensor) -> torch.Tensor: ...

    def verify(self, seq: Sequence, k: int, draws: list[int]) -> list[int]: ...


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if _cpu_has_bf16() else torch.float32
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if name not in dtypes:
        raise ValueError(f"unknown dtype {name!r}; use auto, bf16, fp16 or fp32")
    return dtypes[name]


def cpu_threads(sample_s: float = 0.3) -> int:
    """Default intra-op threads: all cores on an idle machine, 1 on a busy one.

    With every core busy, each parallel op waits for its descheduled OpenMP threads; measured here at
    load 4-5 on 2 cores: 166 output tok/s with 1 thread vs 27 with 2 (engine only, 16 streams).
    "Busy" is the machine's CPU use over ``sample_s`` seconds before the model is built (psutil, as the
    host telemetry; this process sleeps meanwhile), not the 1-minute load average: that lags by minutes,
    so a server started right after another benchmark ended chose 1 thread on an idle machine (every
    server of ``bench experiment``)."""
    cores = os.cpu_count() or 1
    busy_cores = psutil.cpu_percent(interval=sample_s) / 100 * cores
    return cores if busy_cores < 0.5 else 1


def _cpu_has_bf16() -> bool:
    """AVX512-BF16 makes bf16 matmuls native on CPU; without it bf16 is emulated and slower than fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512_bf16" in f.read()
    except OSError:
        return False


def triton_attention() -> PagedAttention | str:
    """The Triton paged-attention kernel, or why it cannot be had (Triton not installed)."""
    try:
        from reference_server.kernels.triton_attention import paged_attention
    except ImportError as e:
        return f"Triton is not installed ({e}); pip install 'triton' for the paged GPU kernel"
    return paged_attention


def pick_kernels(choice: str, device: torch.device, dtype: torch.dtype, spec: ModelSpec,
                 block_size: int) -> tuple[CpuKernels | None, PagedAttention | None, str]:
    """The native CPU kernels, or on CUDA the Triton paged-attention kernel, when ``choice`` allows them
    and they can run here; else None (PyTorch ops only). Also returns a line saying which, and why."""
    if choice == "torch":
        return None, None, "torch (--kernels torch)"
    interpreted = choice == "triton" and os.environ.get("TRITON_INTERPRET") == "1"  # tests: the kernel on CPU
    if (device.type == "cuda" and choice == "auto") or choice == "triton" and (device.type == "cuda" or interpreted):
        paged: PagedAttention | str = triton_attention()
        if block_size < 16 or block_size & (block_size - 1):
            paged = f"block size {block_size} (the Triton kernel needs a power of two >= 16)"
        if not isinstance(paged, str):
            return None, paged, "triton"
        if choice == "triton":
            raise ValueError(f"--kernels triton is unavailable: {paged}; use --kernels torch or auto")
        return None, None, f"torch ({paged})"
    if choice == "triton":
        raise ValueError(f"--kernels triton runs on CUDA (or under TRITON_INTERPRET=1), this is {device.type}; "
                         "use --kernels auto")
    why: str | None = None
    if device.type != "cpu" or dtype != torch.bfloat16:
        why = f"the native kernels are for bf16 on CPU, this is {str(dtype).removeprefix('torch.')} on {device.type}"
    else:
        why = supports(spec.head_dim, spec.n_heads, spec.n_kv_heads, block_size)
    if why is None:
        kernels = cpu_kernels()
        if not isinstance(kernels, str):
            return kernels, None, kernels.name
        why = kernels
    if choice == "native":
        raise ValueError(f"--kernels native is unavailable: {why}; use --kernels torch or auto")
    return None, None, f"torch ({why})"


def kv_blocks_for_memory(total: int, used: int, peak_activations: int, utilization: float, block_bytes: int) -> int:
    """KV blocks that fit when this process may use ``utilization`` of the device's ``total`` bytes:
    what is ``used`` already (weights, CUDA context, other processes) and the step's ``peak_activations``
    come off first (vLLM's and nano-vllm's rule)."""
    return max(0, (int(total * utilization) - used - peak_activations) // block_bytes)


def pick_quantization(choice: str, config_model: Path, device: torch.device, native: CpuKernels | None,
                      kernels_note: str) -> tuple[str, str]:
    """The weight quantisation to run (none, int8, int4) and a line saying why. The quantised kernels are
    native CPU kernels (AVX512-BF16, bf16 model); elsewhere an explicit choice is refused."""
    if choice == "none":
        return "none", "none"
    if device.type != "cpu" or native is None:
        why = (f"the quantised kernels are native CPU kernels, this is {device.type} with kernels "
               f"{kernels_note}")  # fmt: skip
        if choice == "auto":
            return "none", f"none (auto: {why})"
        raise ValueError(f"--quantization {choice} is not available on this device: {why}; use --quantization none")
    if choice == "auto":
        mode, why = auto_quantization(config_model)
        return mode, f"{mode} (auto: {why})"
    return choice, choice


class ModelRunner:
    """Owns the weights and the per-layer KV cache tensors ``[kv_heads, num_blocks, block_size, head_dim]``."""

    def __init__(self, config: EngineConfig, spec: ModelSpec | None = None,
                 weights: dict[str, torch.Tensor] | None = None) -> None:
        if spec is None or weights is None:
            spec, weights = load_gguf(config.model)
        self.spec = spec
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        self.threads = torch.get_num_threads()
        if self.device.type == "cpu":
            self.threads = config.threads or cpu_threads()
            torch.set_num_threads(self.threads)
        self.block_size = config.block_size
        self.kv_dtype = pick_kv_dtype(config.kv_cache_dtype, self.dtype, self.device)
        self.native, self.paged, self.kernels = pick_kernels(config.kernels, self.device, self.dtype, spec,
                                                             config.block_size)
        if self.paged is not None and self.kv_dtype == torch.int8:
            why = "the Triton kernel reads bf16/fp16 caches, not int8"
            if config.kernels == "triton":
                raise ValueError(f"--kernels triton with --kv-cache-dtype int8: {why}; use --kernels auto")
            self.paged, self.kernels = None, f"torch ({why})"
        self.quantization, self.quantization_note = pick_quantization(config.quantization, config.model, self.device,
                                                                      self.native, self.kernels)
        quant = None
        if self.quantization != "none":  # CPU only (pick_quantization): the weights are where the kernels are
            assert self.native is not None
            quant = Quantizer(self.quantization, config.model, spec, weights, self.native)
        # dequantised once (load_gguf), moved once, then converted and fused on the device itself
        on_device = {name: w.to(self.device) for name, w in weights.items()}
        self.model = LlamaModel(spec, on_device, self.dtype, self.native, self.paged, quant).eval()
        del on_device
        self.max_model_len = min(config.max_model_len or spec.context_length, spec.context_length)
        self.use_graphs = config.cuda_graphs and self.device.type == "cuda" and self.paged is not None
        self.graphs: DecodeGraphs | None = None
        # the pool's blocks, and the memory it stands for (kv_capacity compares the dtypes in it)
        kv_block = block_bytes(spec, self.block_size, self.kv_dtype)
        self.fused = None  # (set below: a CUDA pool is sized by a forward pass first)
        if config.num_kv_blocks is not None or self.device.type == "cuda":
            self.num_blocks = config.num_kv_blocks or self._blocks_from_memory(config)
            self.kv_pool_bytes = self.num_blocks * kv_block
        else:  # a memory budget: that of the default pool in the model's dtype
            self.kv_pool_bytes = DEFAULT_CPU_KV_BLOCKS * block_bytes(spec, self.block_size, self.dtype)
            self.num_blocks = self.kv_pool_bytes // kv_block
        self.kv_caches = self._allocate_kv(self.num_blocks + self.use_graphs)  # + the graphs' scratch block
        # small decode steps of the quantised CPU model: one native call (fused_decode.py)
        self.fused: FusedDecode | None = (FusedDecode(self.model, self.kv_caches, self.native)
                      if self.native is not None and FusedDecode.available(self.model, self.native) else None)
        if self.use_graphs:
            with torch.inference_mode():
                self.graphs = DecodeGraphs(
                    lambda ids, pos, attn, rows: self.model(ids, pos, self.kv_caches, attn, rows),
                    graph_buckets(config.max_num_seqs), -(-self.max_model_len // self.block_size),
                    self.num_blocks, self.block_size, self.device)

    def _allocate_kv(self, num_blocks: int) -> list[LayerKV]:
        return allocate(self.spec, num_blocks, self.block_size, self.kv_dtype, self.device)

    def kv_capacity(self) -> str:
        """The start-up line's KV part: the pool's bytes per token, tokens and longest sequences, for the
        chosen cache dtype and, in the same memory, the others (kv_cache.capacity_line)."""
        return capacity_line(self.spec, self.block_size, self.kv_pool_bytes, self.kv_dtype, self.dtype,
                             self.max_model_len)

    def _blocks_from_memory(self, config: EngineConfig) -> int:
        """KV pool size from free device memory: one prefill of a full token budget runs on a temporary
        cache to measure the step's activation peak, then the pool takes what ``gpu_memory_utilization``
        leaves."""
        tokens = min(config.max_num_batched_tokens, self.max_model_len)
        nblk = -(-tokens // self.block_size)
        self.num_blocks = nblk
        self.kv_caches = self._allocate_kv(nblk)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        probe = Sequence([0] * tokens, SamplingParams(max_tokens=1))
        probe.block_table = list(range(nblk))
        self.forward(ScheduledBatch([(probe, tokens)]))  # (no graphs yet: eager)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del self.kv_caches
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        blocks = kv_blocks_for_memory(total, total - free, peak, config.gpu_memory_utilization,
                                      block_bytes(self.spec, self.block_size, self.kv_dtype))
        if blocks < -(-self.max_model_len // self.block_size):
            raise ValueError(f"{blocks} KV blocks fit in {config.gpu_memory_utilization:.0%} of the GPU's "
                             f"{total / 2**30:.1f} GiB ({(total - free) / 2**30:.1f} GiB in use): too few for one "
                             f"{self.max_model_len}-token context; raise --gpu-memory-utilization or lower --max-model-len")
        return blocks

    def _cache_rows(self, tables: torch.Tensor) -> torch.Tensor:
        """Block tables ``[..., nblk]`` -> rows ``h * num_blocks + b`` of the cache viewed as
        ``[KVH * blocks, block_size * D]``, flattened in ``[..., KVH, nblk]`` order."""
        heads = torch.arange(self.spec.n_kv_heads)[:, None] * self.num_blocks
        return (tables.unsqueeze(-2) + heads).view(-1).to(self.device)

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttnBatch, list[int]]:
        """Flatten the batch; returns input ids, positions, attention metadata and the rows to sample."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        dec_rows: list[int] = []
        dec_seqs: list[tuple[list[int], int]] = []  # (block table, context length) per decode row
        prefill_specs: list[tuple[int, int, int, list[int]]] = []
        per_seq: list[tuple[int, int, int, list[int]]] = []  # (first row, new tokens, context, block table)
        for seq, n in batch.items:
            start, row = seq.num_computed_tokens, len(ids)
            end = start + n
            tokens = seq.token_ids + seq.spec_token_ids if seq.spec_token_ids else seq.token_ids
            ids.extend(tokens[start:end])
            pos.extend(range(start, end))
            new_slots = self._slots(seq, start, end)
            slots.extend(new_slots)
            per_seq.append((row, n, end, seq.block_table))
            if end == len(tokens) and not seq.pooling:  # a draft being verified needs the logits of all its positions
                logit_rows.extend(range(row + n - 1 - len(seq.spec_token_ids), row + n))
            if n == 1 or seq.spec_token_ids:  # a decode, or a draft being verified: a decode row per token,
                for j in range(n):  # each seeing the context up to itself (all its KV is written first)
                    dec_rows.append(row + j)
                    dec_seqs.append((seq.block_table, start + j + 1))
            else:
                prefill_specs.append((row, n, start, seq.block_table[: -(-end // self.block_size)]))
        for seq in batch.padding:  # recompute the last fed position: same token, same KV, output unused
            p = seq.num_computed_tokens
            per_seq.append((len(ids), 1, p + 1, seq.block_table))
            logit_rows.append(len(ids))
            dec_rows.append(len(ids))
            dec_seqs.append((seq.block_table, p + 1))
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.extend(self._slots(seq, p, p + 1))
        dev = self.device
        attn = AttnBatch(slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev), prefills=[])
        if self.paged is not None:  # the GPU kernel: every row, per sequence, read in place through the tables
            s, nblk = len(per_seq), max(-(-ctx // self.block_size) for _, _, ctx, _ in per_seq)
            flat = [r for r, _, _, _ in per_seq] + [n for _, n, _, _ in per_seq] + [c for _, _, c, _ in per_seq]
            for *_, table in per_seq:
                flat += table[:nblk] + [0] * (nblk - len(table[:nblk]))
            meta = torch.tensor(flat, dtype=torch.int32).to(dev)  # one host-to-device copy
            attn.paged = PagedBatch(meta[3 * s :].view(s, nblk), meta[:s], meta[s : 2 * s], meta[2 * s : 3 * s],
                                    max(n for _, n, _, _ in per_seq))
            return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev),
                    attn, logit_rows)
        if dec_rows:  # keys of all decode rows: block tables padded to the longest
            bs = self.block_size
            nblk = max(-(-ctx // bs) for _, ctx in dec_seqs)
            tables = torch.tensor([t[:nblk] + [0] * (nblk - len(t[:nblk])) for t, _ in dec_seqs])
            lens = torch.tensor([ctx for _, ctx in dec_seqs])
            attn.decode_rows = torch.tensor(dec_rows, dtype=torch.long, device=dev)
            if self.native is not None:  # read in place through the tables
                attn.decode_tables, attn.decode_lens = tables, lens
            else:  # gathered as cache rows, padding masked by a bias
                attn.decode_cache_rows = self._cache_rows(tables)
                pad = torch.arange(nblk * bs)[None, :] >= lens[:, None]
                bias = torch.zeros(pad.shape, dtype=self.dtype).masked_fill_(pad, float("-inf"))
                attn.decode_bias = bias.repeat_interleave(self.spec.n_kv_heads, dim=0)[:, None, :].to(dev)
        for row, n, start, blocks in prefill_specs:
            mask = None
            if start > 0:  # query i (position start+i) sees keys 0..start+i
                mask = (torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]).to(dev)
            attn.prefills.append(PrefillGroup(slice(row, row + n), self._cache_rows(torch.tensor(blocks)), start + n, mask))
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev),
                attn, logit_rows)

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, num_layers: int | None = None) -> torch.Tensor:
        """Float32 logits, on the device, for every sampling sequence of ``batch`` that reaches its last token
        this step; the pooling sequences' rows are pooled (:func:`pooling.pool`). A decode-only step of the whole
        model replays its CUDA graph when one is captured."""
        ids, pos, attn, rows = self.prepare(batch)
        rows_t = torch.tensor(rows, dtype=torch.long, device=self.device)
        if any(seq.pooling for seq, _ in batch.items):
            hidden = self.model.hidden(ids, pos, self.kv_caches, attn, num_layers)
            pool(self.model, batch, hidden)
            return self.model.logits(hidden, rows_t)
        if self.graphs is not None and num_layers is None and len(rows) == len(ids):
            logits = self.graphs.run(ids, pos, attn)
            if logits is not None:
                return logits
        if self.fused is not None and FusedDecode.serves(attn, len(ids), rows):
            return self.fused(ids, pos, attn, num_layers)
        return self.model(ids, pos, self.kv_caches, attn, rows_t, num_layers)

    def _generator(self, seq: Sequence) -> None:
        """A seeded request samples with a generator on the model's device (made once, from its seed)."""
        if seq.generator is not None and seq.generator.device.type != self.device.type and seq.params.seed is not None:
            seq.generator = torch.Generator(self.device).manual_seed(seq.params.seed)

    @torch.inference_mode()
    def step(self, batch: ScheduledBatch,
             spec: Speculator | None = None) -> list[tuple[Sequence, list[int], list[TokenLogprobs] | None]]:
        """Run ``batch``; return ``(seq, new_tokens, their logprobs)`` for the sequences that completed their
        gap: one sampled token each, the verified draft prefix plus one token for a speculating sequence, or
        none for a pooling sequence (its ``embedding`` is set instead); logprobs None unless asked for.

        Sampling, verification and the logprobs asked for run on the logits' device; their results come back
        to the host in one copy, the step's only wait for the device."""
        complete = [seq for seq, n in batch.items
                    if seq.num_computed_tokens + n == seq.num_tokens + len(seq.spec_token_ids)]  # fmt: skip
        if not batch.items:
            return []
        logits = self.forward(batch)
        out: list[tuple[Sequence, list[int], list[TokenLogprobs] | None]] = [
            (seq, [], None) for seq in complete if seq.pooling]  # embedding set
        done = [seq for seq in complete if not seq.pooling]
        if not done:  # only prefill chunks short of their last token, or pooling: nothing to sample
            return out
        for seq in done:
            self._generator(seq)
            assert spec is not None or not seq.spec_token_ids, "draft tokens without a speculative decoder"
        first_rows = list(accumulate((len(s.spec_token_ids) + 1 for s in done[:-1]), initial=0))  # in the logits
        plain = [(s, r) for s, r in zip(done, first_rows, strict=True) if not s.spec_token_ids]
        wanted = StepLogprobs()
        pending: list[torch.Tensor] = []
        if plain:
            rows = logits
            if len(plain) != len(logits):  # index_select: advanced indexing by a list is ~10x slower
                rows = logits.index_select(0, torch.tensor([r for _, r in plain], device=logits.device))
            argmax = self.native.argmax if self.native is not None else None
            pending.append(sample(rows, [s for s, _ in plain], argmax))
            for i, (s, r) in enumerate(plain):
                wanted.add(s, r, pending[0], i, [])
        for s, r in zip(done, first_rows, strict=True):
            if s.spec_token_ids:
                assert spec is not None
                k = len(s.spec_token_ids)
                pending.append(spec.draws(s, logits[r : r + k + 1]))
                wanted.add(s, r, pending[-1], pending[-1].shape[0] - k - 1, s.spec_token_ids)  # see add
        values = wanted.read_back(pending[0] if len(pending) == 1 else torch.cat(pending), logits)  # the one sync
        i_plain, at = 0, len(plain)
        for seq in done:
            k = len(seq.spec_token_ids)
            if k:
                assert spec is not None
                n = k + 1 if seq.params.greedy else 2 * k + 1
                toks = spec.verify(seq, k, values[at : at + n])
                at += n
            else:
                toks = [values[i_plain]]
                i_plain += 1
            out.append((seq, toks, wanted.of(seq, toks)))
        return out
