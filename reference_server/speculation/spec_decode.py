"""Lossless speculative decoding: proposers guess k tokens, one target pass scores k+1 positions.

Verification is the standard rejection rule (Leviathan et al. 2023; Chen et al. 2023): draft token ``x``
drawn from ``q`` is kept with probability ``min(1, p(x) / q(x))``; at the first rejection a token is
drawn from ``norm(max(0, p - q))`` and the rest of the draft is dropped; when every draft token is kept a
bonus token comes from ``p`` at the last position. The emitted tokens then follow ``p`` exactly. A
deterministic proposer (n-gram lookup) is the special case ``q = one_hot(x)``. Under greedy decoding the
rule reduces to "keep while the draft equals the target's argmax", so outputs are bit-identical to
non-speculative decoding.

Size: the drafters (n-gram, draft model) and the verify/accept step share one protocol; one file keeps the
acceptance rule beside them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from reference_server.config import EngineConfig
from reference_server.engine.block_manager import BlockManager
from reference_server.engine.iteration import IterationRecord
from reference_server.engine.scheduler import ScheduledBatch
from reference_server.engine.sequence import Sequence
from reference_server.model.model_runner import ModelRunner
from reference_server.model.sampler import target_probs


@dataclass
class Draft:
    """What a proposer guessed for one request: tokens and, for sampled drafts, their distributions."""

    tokens: list[int]
    probs: torch.Tensor | None = None  # (len(tokens), vocab) q rows; None = deterministic proposal

    def __len__(self) -> int:
        return len(self.tokens)


class Proposer(Protocol):
    def propose(self, token_ids: list[int], k: int) -> Draft:
        """Up to ``k`` draft tokens continuing ``token_ids`` (may be fewer, or none)."""
        ...


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens, copy what followed.

    No draft model; pays off when the output repeats its input (code edits, summaries, quoting).
    """

    def __init__(self, n_max: int = 4, n_min: int = 1) -> None:
        self.n_max, self.n_min = n_max, n_min

    def propose(self, token_ids: list[int], k: int) -> Draft:
        arr = np.asarray(token_ids, dtype=np.int64)
        total = len(arr)
        for n in range(min(self.n_max, total - 1), self.n_min - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(arr[: total - 1], n)  # excludes the suffix itself
            hits = np.flatnonzero((windows == arr[total - n :]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return Draft(arr[start : start + k].tolist())
        return Draft([])


def verify_greedy(draft: list[int], target_argmax: list[int]) -> list[int]:
    """Tokens to emit: the draft while it equals the target's argmax, then the target's own token.

    ``target_argmax`` has ``len(draft) + 1`` entries (the last position gives the bonus token).
    """
    out: list[int] = []
    for guess, best in zip(draft, target_argmax, strict=False):
        out.append(best)
        if guess != best:
            return out
    out.append(target_argmax[len(draft)])
    return out


def sampled_draws(draft: Draft, target_probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Every random draw the rejection rule may need, made at once on the probabilities' device with no
    host sync: int64 ``[2k + 1]`` = k accept flags, k residual samples (one per position, used only at the
    first rejection), the bonus sample. :func:`accept_sampled` turns them into tokens once on the host.

    ``target_probs`` is ``(len(draft) + 1, vocab)`` (rows already temperature/top-k/top-p processed):
    row i scores the token after draft position i-1."""
    k = len(draft)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"need {k + 1} target rows for {k} draft tokens, got {target_probs.shape[0]}")
    p_all = target_probs.float()
    p = p_all[:k]
    x = torch.tensor(draft.tokens, dtype=torch.long, device=p.device)
    p_x = p.gather(1, x[:, None])[:, 0]
    if draft.probs is None:  # a deterministic draft: q = one_hot(x)
        q_x = torch.ones_like(p_x)
        residual = p.scatter(1, x[:, None], 0.0)
    else:
        q = draft.probs.to(p.device).float()
        q_x = q.gather(1, x[:, None])[:, 0]
        residual = (p - q).clamp_min(0.0)
    # p == q up to rounding: the residual is undefined, p is exact
    residual = torch.where(residual.sum(1, keepdim=True) > 0.0, residual, p)
    u = torch.rand(k, generator=generator, device=p.device)
    accept = u * q_x < p_x  # accept with probability min(1, p(x) / q(x))
    resampled = torch.multinomial(residual, 1, generator=generator)[:, 0] if k else x
    bonus = torch.multinomial(p_all[k], 1, generator=generator)
    return torch.cat((accept.long(), resampled, bonus))


def accept_sampled(draft_tokens: list[int], draws: list[int]) -> list[int]:
    """Tokens to emit from :func:`sampled_draws`' values: the draft up to its first rejection, replaced
    there by that position's residual sample; the bonus sample when every draft token is kept."""
    k = len(draft_tokens)
    for i in range(k):
        if not draws[i]:
            return draft_tokens[:i] + [draws[k + i]]
    return draft_tokens + [draws[2 * k]]


def verify_sampled(draft: Draft, target_probs: torch.Tensor, generator: torch.Generator | None = None) -> list[int]:
    """The rejection rule on probabilities: :func:`sampled_draws`, read back, then :func:`accept_sampled`."""
    return accept_sampled(draft.tokens, sampled_draws(draft, target_probs, generator).tolist())


class AdaptiveK:
    """Per-request draft length: one longer after a fully accepted draft, one shorter after a draft with
    nothing accepted. A partly accepted draft keeps the length: the match held for a while, and a shorter
    draft would have lost those tokens while costing about as much (a verification pass costs little
    more per extra row while decode is bound by weight bytes; the step cost is the governor's business)."""

    def __init__(self, k_max: int, adaptive: bool = True) -> None:
        self.k_max, self.adaptive = k_max, adaptive
        self.k = k_max

    def update(self, drafted: int, accepted: int) -> None:
        if not self.adaptive or drafted == 0:
            return
        if accepted == drafted:
            self.k = min(self.k_max, self.k + 1)
        elif accepted == 0:
            self.k = max(1, self.k - 1)


class Governor:
    """How many draft tokens pay, per step: the measured output tokens per second of decode-only steps
    under each draft cap (the most draft tokens any request gets in the step: 0 = off, 1, 2, 4, ...,
    ``k_max``), per number of decoding requests (its own arms for 1, 2, 3-4, 5-8, ...: the step cost
    grows with the rows of the batch while the gain of a draft does not). Each arm keeps an exponential
    moving average over its steps; once each arm has ``WARMUP`` steps (the longest drafts first), the best
    arm runs, and one step in ``EXPLORE`` of that batch size tries a neighbouring cap (one shorter, one
    longer, in turn), so that a change (the text turns unpredictable, the machine gets busy) is noticed and
    a wrong choice costs at most that share of the steps. A drafting step counts only when a draft was found
    (:meth:`SpecDecoder.propose`). What it measures is the whole step: the proposer's time, the longer
    verification pass, the acceptance, all in one number."""

    EXPLORE = 16
    WARMUP = 4  # steps of each arm before the averages are compared
    WEIGHT = 0.2  # of the newest step in the moving average

    def __init__(self, k_max: int) -> None:
        self.caps = sorted({0, k_max} | {1 << i for i in range(k_max.bit_length()) if 1 << i < k_max})
        self.rate: dict[tuple[int, int], float] = {}
        self.count: dict[tuple[int, int], int] = {}
        self.steps: dict[int, int] = {}
        self.last: tuple[int, int] | None = None  # the arm of the step under way

    @staticmethod
    def bucket(num_decoding: int) -> int:
        return 1 << (num_decoding - 1).bit_length()  # 1, 2, 4, 8, ...

    def choose(self, num_decoding: int) -> int:
        """The draft cap for a step with ``num_decoding`` decoding requests (0: no drafts)."""
        b = self.bucket(num_decoding)
        n = self.steps[b] = self.steps.get(b, 0) + 1
        warming = [cap for cap in reversed(self.caps) if self.count.get((b, cap), 0) < self.WARMUP]
        if warming:
            cap = warming[0]
        else:
            best = max(range(len(self.caps)), key=lambda i: self.rate[(b, self.caps[i])])
            if n % self.EXPLORE == 0:  # a neighbour: shorter and longer in turn (the other one at an end)
                side = 1 if (n // self.EXPLORE) % 2 else -1
                best = best + side if 0 <= best + side < len(self.caps) else best - side
            cap = self.caps[best]
        self.last = (b, cap)
        return cap

    def observe(self, rec: IterationRecord) -> None:
        """The step's outcome (an engine ``on_iteration`` hook): decode-only steps count."""
        arm, self.last = self.last, None
        seconds = rec.t_end_unix - rec.t_unix
        if arm is None or rec.prefill_tokens or rec.output_tokens == 0 or seconds <= 0:
            return
        rate = rec.output_tokens / seconds
        old = self.rate.get(arm)
        self.rate[arm] = rate if old is None else old + self.WEIGHT * (rate - old)
        self.count[arm] = self.count.get(arm, 0) + 1


class ModelProposer:
    """Drafts with a Llama model: the target's first layers (self-draft) or a separate small GGUF.

    Self-draft (``separate=False``) runs the first ``num_layers`` layers of the target plus its final
    norm and head on the target's own KV cache: those layers' keys and values for accepted tokens are
    exactly what the draft needs, and the draft's writes at draft positions are overwritten by the
    verification pass. A separate draft model keeps shadow sequences in its own KV pool
    (``separate=True``, ``blocks`` its own pool), catching up on accepted tokens at the start of each proposal.
    """

    def __init__(self, runner: ModelRunner, blocks: BlockManager, num_layers: int | None = None,
                 separate: bool = False) -> None:
        self.runner, self.blocks, self.num_layers, self.separate = runner, blocks, num_layers, separate
        self.shadows: dict[str, Sequence] = {}

    def _shadow(self, seq: Sequence) -> Sequence:
        if not self.separate:  # self-draft: a view sharing the target's block table
            view = Sequence(list(seq.token_ids), seq.params, seq_id=seq.seq_id)
            view.block_table = seq.block_table
            view.num_computed_tokens = seq.num_computed_tokens
            return view
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = self.shadows[seq.seq_id] = Sequence(list(seq.token_ids), seq.params, seq_id=seq.seq_id)
        common = 0  # keep the draft KV of the longest prefix the shadow shares with the target
        for a, b in zip(shadow.token_ids[: shadow.num_computed_tokens], seq.token_ids, strict=False):
            if a != b:
                break
            common += 1
        shadow.token_ids = list(seq.token_ids)
        shadow.num_computed_tokens = common
        return shadow

    def propose_batch(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        """Up to ``ks[i]`` draft tokens for each decoding sequence, all sequences stepping together."""
        drafts = [Draft([], None) for _ in seqs]
        rows: list[list[torch.Tensor]] = [[] for _ in seqs]
        shadows = [self._shadow(s) for s in seqs]
        for step in range(max(ks, default=0)):
            live = [i for i in range(len(seqs)) if step < ks[i] and len(drafts[i]) == step]
            live = [i for i in live if self.blocks.can_grow(shadows[i], shadows[i].num_tokens)]
            if not live:
                break
            for i in live:  # self-draft: grows the target's table, which verification needs anyway
                self.blocks.grow(shadows[i], shadows[i].num_tokens)
            batch = ScheduledBatch([(shadows[i], shadows[i].num_tokens - shadows[i].num_computed_tokens) for i in live])
            logits = self.runner.forward(batch, num_layers=self.num_layers)
            for row, i in enumerate(live):
                sh, seq = shadows[i], seqs[i]
                if seq.params.greedy:
                    tok = int(logits[row].argmax())
                else:
                    q = target_probs(logits[row], seq.params)
                    tok = int(torch.multinomial(q, 1, generator=seq.generator))
                    rows[i].append(q)
                drafts[i].tokens.append(tok)
                sh.num_computed_tokens = sh.num_tokens
                sh.token_ids.append(tok)
        for i, d in enumerate(drafts):
            if rows[i]:
                d.probs = torch.stack(rows[i])
        return drafts

    def release(self, seq: Sequence) -> None:
        """Drop a finished request's shadow (separate draft model only)."""
        shadow = self.shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self.blocks.release(shadow)


class SpecDecoder:
    """The engine's speculation hook: propose before scheduling, verify after the forward pass.

    Proposals are stored as ``seq.spec_token_ids``; the scheduler then gives such a decode request
    ``1 + len(spec_token_ids)`` tokens under the same budget rule as everything else (and may cut the
    draft short), and the model runner returns logits for all of them.
    """

    def __init__(self, cfg: EngineConfig, proposer: Proposer | ModelProposer) -> None:
        self.cfg, self.proposer = cfg, proposer
        self.ks: dict[str, AdaptiveK] = {}
        self.drafts: dict[str, Draft] = {}
        self.num_drafted = 0
        self.num_accepted = 0
        self.num_steps = 0  # verification steps that carried a draft
        self.governor = Governor(cfg.spec_k) if cfg.spec_adaptive else None

    def active(self, num_decoding: int) -> bool:
        """Speculation pays while decode is memory-bound; a big batch already fills the compute."""
        return num_decoding <= self.cfg.spec_max_batch

    def propose(self, decoding: list[Sequence]) -> None:
        """Attach drafts to the requests about to decode (none when the batch is too big to pay)."""
        for seq in decoding:  # a draft left from a step that did not schedule the request is dropped
            seq.spec_token_ids = []
        if self.governor is not None:
            self.governor.last = None
        if not decoding or not self.active(len(decoding)):
            return
        cap = self.governor.choose(len(decoding)) if self.governor is not None else self.cfg.spec_k
        if cap == 0:
            return
        ks = [self.ks.setdefault(s.seq_id, AdaptiveK(self.cfg.spec_k, self.cfg.spec_adaptive)).k for s in decoding]
        ks = [max(0, min(k, cap, s.params.max_tokens - s.num_output_tokens - 1)) for k, s in zip(ks, decoding, strict=True)]
        if isinstance(self.proposer, ModelProposer):
            drafts = self.proposer.propose_batch(decoding, ks)
        else:
            drafts = [self.proposer.propose(s.token_ids, k) if k else Draft([]) for s, k in zip(decoding, ks, strict=True)]
        for seq, draft in zip(decoding, drafts, strict=True):
            if draft.tokens:
                self.drafts[seq.seq_id] = draft
                seq.spec_token_ids = list(draft.tokens)
        if self.governor is not None and not any(d.tokens for d in drafts):
            self.governor.last = None  # nothing to verify: the step says nothing about drafting

    def draws(self, seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
        """What verifying ``seq`` needs from its ``1 + k`` logit rows (k = draft tokens actually scheduled),
        computed on their device without a host sync: the rows' argmax when greedy, else
        :func:`sampled_draws`. :meth:`verify` takes them back as a list."""
        if seq.params.greedy:
            return logits.argmax(dim=-1)
        k = logits.shape[0] - 1
        draft = self.drafts[seq.seq_id]
        draft = Draft(draft.tokens[:k], None if draft.probs is None else draft.probs[:k])
        return sampled_draws(draft, torch.stack([target_probs(row, seq.params) for row in logits]), seq.generator)

    def verify(self, seq: Sequence, k: int, draws: list[int]) -> list[int]:
        """Tokens to emit for ``seq`` after ``k`` scheduled draft tokens, from :meth:`draws` read back."""
        draft = self.drafts.pop(seq.seq_id, Draft([]))
        tokens = draft.tokens[:k]
        out = verify_greedy(tokens, draws) if seq.params.greedy else accept_sampled(tokens, draws)
        accepted = len(out) - 1
        self.num_drafted += k
        self.num_accepted += accepted
        self.num_steps += 1
        seq.spec_drafted += k
        seq.spec_accepted += accepted
        seq.spec_token_ids = []
        seq.num_computed_tokens -= k - accepted  # the step computes 1 + k; KV past the kept tokens is void
        self.ks[seq.seq_id].update(k, accepted)
        return out

    def release(self, seq: Sequence) -> None:
        self.ks.pop(seq.seq_id, None)
        self.drafts.pop(seq.seq_id, None)
        seq.spec_token_ids = []
        if isinstance(self.proposer, ModelProposer):
            self.proposer.release(seq)


def make_spec_decoder(cfg: EngineConfig, runner: ModelRunner, blocks: BlockManager) -> SpecDecoder | None:
    """The decoder for ``cfg.spec`` (None when off). A separate draft model gets its own runner and KV pool
    (same block size and pool size as the target's)."""
    if cfg.spec == "off":
        return None
    if cfg.spec == "ngram":
        return SpecDecoder(cfg, NgramProposer(cfg.spec_ngram_max, cfg.spec_ngram_min))
    if cfg.spec == "self":
        layers = min(cfg.self_draft_layers, runner.spec.n_layers)
        return SpecDecoder(cfg, ModelProposer(runner, blocks, num_layers=layers))
    draft_cfg = replace(cfg, model=Path(cfg.draft_model), num_kv_blocks=runner.num_blocks)
    draft = ModelRunner(draft_cfg)
    if draft.spec.vocab != runner.spec.vocab:
        raise ValueError(f"draft model vocabulary ({draft.spec.vocab}) differs from the model's ({runner.spec.vocab})")
    own = BlockManager(draft.num_blocks, cfg.block_size, enable_prefix_caching=False)
    return SpecDecoder(cfg, ModelProposer(draft, own, separate=True))
