"""Pooling requests' embeddings (``Sequence`` with no sampling parameters): the mean of the final-norm hidden
states over the prompt, L2-normalised, summed chunk by chunk as the scheduler computes the prompt."""

from __future__ import annotations

import torch

from reference_server.engine.scheduler import ScheduledBatch
from reference_server.engine.sequence import Sequence
from reference_server.model.model import LlamaModel


def pool(model: LlamaModel, batch: ScheduledBatch, hidden: torch.Tensor) -> None:
    """Add each pooling sequence's rows of ``hidden``, final-normed, in float32, to its ``pooled`` sum (a
    chunk from position 0 starts it afresh: a first chunk, or a recompute after preemption); a sequence
    whose prompt is now computed gets its ``embedding``: the L2-normalised sum, which is the normalised
    mean. Each row depends only on its own sequence's tokens (causal attention over its own blocks), so
    the embedding does not depend on the batch it ran in, beyond the float rounding of the batch shape."""
    spans: list[tuple[Sequence, int, int]] = []
    row = 0
    for seq, n in batch.items:  # the batch's rows in order (ModelRunner.prepare): n per sequence, padding rows after
        if seq.pooling:
            spans.append((seq, row, n))
        row += n
    pooled_rows = torch.cat([torch.arange(r, r + n) for _, r, n in spans]).to(hidden.device)
    normed = model.norm(hidden.index_select(0, pooled_rows)).float()
    at = 0
    for seq, _, n in spans:
        chunk = normed[at : at + n].sum(0)
        at += n
        seq.pooled = chunk if seq.num_computed_tokens == 0 or seq.pooled is None else seq.pooled + chunk
        if seq.num_computed_tokens + n == seq.num_tokens:
            seq.embedding = torch.nn.functional.normalize(seq.pooled, dim=0)
