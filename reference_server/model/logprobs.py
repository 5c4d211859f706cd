"""Logprobs of output tokens, for the requests that ask (``SamplingParams.logprobs``), computed in the step's
one host sync: the model's **raw** distribution, log_softmax of the logits before temperature, top-k and top-p
(vLLM's default ``logprobs_mode="raw_logprobs"``). A speculating request's rows are the target model's, as in
vLLM. A step where no request asks does none of this."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reference_server.engine.sequence import Sequence


@dataclass(frozen=True)
class TokenLogprobs:
    """One output token's logprob and the ``k`` most likely tokens at its position, best first."""

    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob)


class StepLogprobs:
    """The logit rows of one step whose requests asked for logprobs: :meth:`add` them while sampling,
    :meth:`read_back` the step's tokens together with their logprobs, then :meth:`of` each request."""

    def __init__(self) -> None:
        self.rows: list[int] = []  # logits rows, in order of addition
        self.drafted: list[int] = []  # per row: its draft token (0 where none)
        self.chosen: list[torch.Tensor] = []  # per added request: its rows' tokens (on the device)
        self.owners: dict[str, tuple[int, list[int]]] = {}  # seq_id -> (its first gathered row, its draft)
        self.k = 0  # the most top alternatives any of them asked for
        self.values: list[float] = []

    def add(self, seq: Sequence, first_row: int, tokens: torch.Tensor, start: int, draft: list[int]) -> None:
        """If ``seq`` asked: its ``len(draft) + 1`` logits rows from ``first_row``, whose tokens are
        ``tokens[start:]`` (on the device): the sampled token, or for a draft the tokens its verification
        emits at a rejection (the target's own), the last one the bonus. A draft token, when kept, is emitted
        in place of its row's token: both logprobs are gathered."""
        if seq.params.logprobs is None:
            return
        n = len(draft) + 1
        self.owners[seq.seq_id] = (len(self.rows), draft)
        self.rows += range(first_row, first_row + n)
        self.drafted += [*draft, 0]
        self.chosen.append(tokens[start : start + n])
        self.k = max(self.k, seq.params.logprobs)

    def read_back(self, tokens: torch.Tensor, logits: torch.Tensor) -> list[int]:
        """``tokens`` (int64, on the device) on the host, and with them the added rows' logprobs: one copy."""
        if not self.rows:
            return tokens.tolist()
        n = len(self.rows)
        meta = torch.tensor(self.rows + self.drafted, device=logits.device)  # one host-to-device copy
        logp = torch.log_softmax(logits.index_select(0, meta[:n]).float(), dim=-1)
        top = logp.topk(self.k, dim=-1)
        candidates = torch.stack((torch.cat(self.chosen), meta[n:]), dim=1)
        gathered = torch.cat([t.double() for t in (logp.gather(1, candidates), top.values, top.indices)], 1)
        values = torch.cat((tokens.double(), gathered.view(-1))).tolist()
        self.values = values[tokens.shape[0] :]
        return [int(v) for v in values[: tokens.shape[0]]]

    def of(self, seq: Sequence, emitted: list[int]) -> list[TokenLogprobs] | None:
        """The logprobs of ``seq``'s ``emitted`` tokens (None if it did not ask)."""
        if seq.seq_id not in self.owners:
            return None
        first, draft = self.owners[seq.seq_id]
        width, k = 2 + 2 * self.k, seq.params.logprobs or 0
        out = []
        for j, tok in enumerate(emitted):
            v = self.values[(first + j) * width : (first + j + 1) * width]
            logprob = v[1] if j < len(draft) and tok == draft[j] else v[0]
            top = zip(v[2 + self.k : 2 + self.k + k], v[2 : 2 + k], strict=True)  # (id, logprob), best first
            out.append(TokenLogprobs(logprob, [(int(i), lp) for i, lp in top]))
        return out
