"""``bench verify``'s margin at a divergence (:mod:`loadgen.experiments.verify`): how undecided the server was at
the token where two answers part, asked of it alone with the top two logprobs of each token."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import httpx

from backends.base import Backend
from workloads.contracts import GenRequest

PROBE_PATH = "/v1/completions"
PROBE_TIMEOUT_S = 60.0
PROBE_SLACK_TOKENS = 4  # a continuation of n characters has at most n tokens, a few more where bytes split a character
PROBE_MAX_TOKENS = 256


def token_tops(answer: dict[str, Any]) -> list[tuple[str, list[tuple[str, float]]]] | None:
    """Each generated token of a completions answer with its top logprobs, highest first: llama-server's and
    OpenAI chat's ``logprobs.content`` list, or the legacy ``logprobs.tokens``/``top_logprobs`` (vLLM, the
    reference server); None when the answer has none."""
    try:
        lp = answer["choices"][0]["logprobs"]
        if not lp:
            return None
        if "content" in lp:
            pairs = [(c["token"], [(t["token"], float(t["logprob"])) for t in c["top_logprobs"]]) for c in lp["content"]]
        else:
            pairs = [(tok, [(k, float(v)) for k, v in tops.items()]) for tok, tops in zip(lp["tokens"], lp["top_logprobs"], strict=True)]
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        return None
    return [(str(tok), sorted(tops, key=lambda t: -t[1])) for tok, tops in pairs]


@dataclass(frozen=True)
class Margin:
    """The reference's choice at a divergence, asked of the server alone: ``value`` = logprob(top 1) − logprob(top 2)
    at the token that holds the first differing character (None, and ``why``, when it cannot be known), that
    token (``token``), the runner-up (``second``) and where the token starts in the answer (``start``)."""

    value: float | None
    why: str = ""
    token: str | None = None
    second: str | None = None
    start: int = 0

    def cells(self, reference: str, answer: str) -> dict[str, Any]:
        """The diverged entry's fields: the margin, the server's top two there, and whether the two answers went on
        with those two, one each (``top_two``, read by text: a near-tie tipped over, not some other token)."""
        if self.value is None:
            return {"margin": None, "margin_unknown": self.why}
        assert self.token is not None and self.second is not None
        ref, ans = reference[self.start:], answer[self.start:]
        pair = (ref.startswith(self.token) and ans.startswith(self.second)) or \
            (ref.startswith(self.second) and ans.startswith(self.token))  # fmt: skip
        return {"margin": self.value, "token": self.token, "second": self.second, "top_two": bool(self.second) and pair}


async def margin(client: httpx.AsyncClient, backend: Backend, req: GenRequest, reference: str, at: int) -> Margin:
    """The margin at ``reference``'s character ``at`` (the first that differs) of ``req``'s answer: one request
    alone continues the prompt from the reference's last space before ``at`` (a token boundary for BPE
    vocabularies) for as many tokens as reach ``at``, with the top two logprobs of each, and the margin is read at
    the token that holds character ``at``, once the continuation has repeated the reference up to it."""
    if req.temperature:
        return Margin(None, "a sampled answer: a seeded draw can flip at any token, not only at a near-tie of the top two")
    if not isinstance(req.prompt, str) or (backend.api or req.api) != "completions":
        return Margin(None, "a chat request: no completion can continue a partial answer")
    cut = max(reference.rfind(" ", 0, at), 0)
    body = {**backend.body_extras({}), "prompt": req.prompt + reference[:cut], "temperature": 0, "logprobs": 2,
            "max_tokens": min(at - cut + PROBE_SLACK_TOKENS, PROBE_MAX_TOKENS), "stream": False,
            **({"model": model} if (model := req.model or backend.model) else {})}  # fmt: skip
    try:
        resp = await client.post(backend.base_url + PROBE_PATH, json=body)
        tokens = token_tops(resp.json()) if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError) as exc:
        return Margin(None, f"POST {PROBE_PATH}: {type(exc).__name__}: {exc}"[:200])
    if not tokens:
        return Margin(None, f"POST {PROBE_PATH} with logprobs=2 gave no logprobs per token (HTTP {resp.status_code})")
    pos = cut
    for i, (text, _) in enumerate(tokens):
        if pos + len(text) > at:
            tops = tokens[i][1]
            break
        if not reference.startswith(text, pos):
            return Margin(None, f"alone, the server now answers otherwise before the divergence (at character {pos})")
        pos += len(text)
    else:
        return Margin(None, f"the continuation asked alone ended before character {at}")
    if len(tops) < 2 or not all(map(math.isfinite, (tops[0][1], tops[1][1]))):
        return Margin(None, f"POST {PROBE_PATH} with logprobs=2 gave fewer than two logprobs at the divergence")
    return Margin(tops[0][1] - tops[1][1], token=tops[0][0], second=tops[1][0], start=pos)
