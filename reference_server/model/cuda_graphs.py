"""CUDA graphs for decode steps, one per batch-size bucket (as nano-vllm does).

A decode step of a small model on a GPU is launch-bound: ~10 kernels per layer, each a few microseconds of
work behind a few microseconds of CPU-side launch. A captured graph replays the whole step's kernels in
one launch. A graph has fixed shapes and fixed addresses, so the step's inputs are copied into static
buffers, a batch of ``n`` sequences runs the graph of the smallest bucket ``>= n``, and the rows past
``n`` are padding: they read and write only a scratch KV block that no sequence owns.

Prefill chunks (varying token counts) and speculative verification run eagerly."""

from __future__ import annotations

from collections.abc import Callable

import torch

from reference_server.model.model import AttnBatch, PagedBatch

MAX_GRAPH_BATCH = 512  # larger decode batches run eagerly (launch cost is small against their work)


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 16 up to the most sequences that can
    decode together (nano-vllm's choice: padding wastes at most 15 rows, and the graphs' count stays small)."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    small = [b for b in (1, 2, 4, 8) if b < top]
    return small + list(range(16, top, 16)) + [top]


def pick_bucket(buckets: list[int], n: int) -> int | None:
    """The smallest captured batch size that holds ``n`` rows; None when ``n`` exceeds them all (eager)."""
    return next((b for b in buckets if b >= n), None)


StepFn = Callable[[torch.Tensor, torch.Tensor, AttnBatch, torch.Tensor], torch.Tensor]


class DecodeGraphs:
    """Captured decode steps over static input buffers. ``step(ids, positions, batch, rows)`` is the model's
    forward (float32 logits for ``rows``); ``scratch_block`` a KV block outside the block manager's pool.
    ``capture=False`` replays by calling ``step`` again on the same buffers instead of capturing: the buffer
    and padding logic without a GPU (tests)."""

    def __init__(self, step: StepFn, buckets: list[int], max_blocks_per_seq: int, scratch_block: int,
                 block_size: int, device: torch.device, capture: bool = True) -> None:
        self.buckets = buckets
        top = buckets[-1]
        i32 = {"dtype": torch.int32, "device": device}
        self.ids = torch.zeros(top, dtype=torch.long, device=device)
        self.pos = torch.zeros(top, dtype=torch.long, device=device)
        self.slots = torch.full((top,), scratch_block * block_size, dtype=torch.long, device=device)
        self.tables = torch.full((top, max_blocks_per_seq), scratch_block, **i32)
        self.ctx_len = torch.ones(top, **i32)
        self.q_start = torch.arange(top, **i32)
        self.n_new = torch.ones(top, **i32)
        self.rows = torch.arange(top, dtype=torch.long, device=device)
        self.scratch_slot, self.scratch_block = scratch_block * block_size, scratch_block
        self.replays: dict[int, Callable[[], object]] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.num_replays = 0
        pool = None
        for b in reversed(buckets):  # the largest first: the smaller ones reuse its memory pool
            batch = AttnBatch(self.slots[:b], [], paged=PagedBatch(self.tables[:b], self.q_start[:b],
                                                                   self.n_new[:b], self.ctx_len[:b], 1))
            args = (self.ids[:b], self.pos[:b], batch, self.rows[:b])
            if not capture:
                self.replays[b] = lambda b=b, args=args: self.logits.__setitem__(b, step(*args))
                continue
            step(*args)  # warm-up: compiles the Triton kernels, initialises cuBLAS, outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.logits[b] = step(*args)
            pool = graph.pool()
            self.replays[b] = graph.replay
        if capture:
            torch.cuda.synchronize()

    def run(self, ids: torch.Tensor, pos: torch.Tensor, batch: AttnBatch) -> torch.Tensor | None:
        """Logits of a decode-only step through its bucket's graph; None when no bucket holds it."""
        paged = batch.paged
        n = ids.shape[0]
        b = pick_bucket(self.buckets, n)
        if b is None or paged is None or paged.max_new != 1:
            return None
        w = paged.tables.shape[1]
        self.ids[:n].copy_(ids)
        self.pos[:n].copy_(pos)
        self.slots[:n].copy_(batch.slot_mapping)
        self.tables[:n, :w].copy_(paged.tables)
        self.ctx_len[:n].copy_(paged.ctx_len)
        # padding rows: position 0 of the scratch block, a one-token context (last step's rows may be here)
        self.ids[n:b].zero_()
        self.pos[n:b].zero_()
        self.slots[n:b].fill_(self.scratch_slot)
        self.tables[n:b, :1].fill_(self.scratch_block)
        self.ctx_len[n:b].fill_(1)
        self.replays[b]()
        self.num_replays += 1
        return self.logits[b][:n]
