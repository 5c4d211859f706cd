"""Workloads: exact token lengths, reproducibility, shared prefixes, multi-turn, the built-ins, the shipped text
(workload files, their validation and the CLI: ``tests/test_workload_files.py``)."""

import json
import random
import re
import unicodedata
from dataclasses import asdict
from itertools import islice

import pytest
from support.hub import offline_hub_cache
from support.workload_file import write

from workloads.loader import builtin_names, load_workload
from workloads.text import CHATML_USER, builder_for, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("bundled")


def n_tokens(tok, text: str) -> int:
    return len(tok.encode(text).ids)


LENGTHS = [1, 2, 3, 5, 8, 31, 64, 100, 255, 511, 512, 513, 1000, 2000, 3000]


def test_fill_is_exact_for_the_final_string(tok):
    b = builder_for("bundled")
    rng = random.Random(3)
    for n in LENGTHS + [rng.randint(1, 1500) for _ in range(60)]:
        assert n_tokens(tok, b.fill(n, rng)) == n
    # with fixed text around it: the body adds exactly n tokens, the head's tokens are untouched
    head = "<|im_start|>system\nYou answer in one line.<|im_end|>\n" + CHATML_USER[0]
    for n in (1, 7, 300):
        text = b.fill(n, rng, before=head, after=CHATML_USER[1])
        ids = tok.encode(text).ids
        assert len(ids) == n_tokens(tok, head) + n + n_tokens(tok, CHATML_USER[1])
        assert ids[: n_tokens(tok, head)] == tok.encode(head).ids


def test_long_prompts_wrap_the_corpus_and_stay_exact(tok):
    """Bodies longer than the corpus (58k tokens) wrap around it, more than once for 128k; only the seams are
    encoded to check them, so each is encoded whole here."""
    b = builder_for("bundled")
    assert b.seams_only  # the bundled tokenizer passes the seam self-check
    rng = random.Random(11)
    for n in (20_000, sum(b.counts) + 1, 128_000):
        text = b.fill(n, rng)
        assert n_tokens(tok, text) == n
    text = b.fill(70_000, rng, before=CHATML_USER[0], after=CHATML_USER[1])
    assert n_tokens(tok, text) == n_tokens(tok, CHATML_USER[0]) + 70_000 + n_tokens(tok, CHATML_USER[1])


def test_a_tokenizer_that_fails_the_seam_check_is_verified_whole(tok, monkeypatch):
    from workloads import text as text_mod

    monkeypatch.setattr(text_mod.PromptBuilder, "_seams_hold", lambda self: False)
    b = text_mod.PromptBuilder(tok, text_mod.CORPUS.read_text(encoding="utf-8"))
    assert not b.seams_only
    rng = random.Random(5)
    for n in (1, 300, 5000):
        assert n_tokens(tok, b.fill(n, rng, after="\n")) == n + 1


def test_synthetic_prompt_lengths_are_exact(tmp_path, tok):
    classes = "".join(
        f'[[classes]]\nname = "p{n}-{tpl}"\nprompt = {n}\noutput = 4\ntemplate = "{tpl}"\n\n'
        for n in LENGTHS
        for tpl in ("none", "chatml")
        if tpl == "none" or n > 20
    )
    classes += '[[classes]]\nname = "prefixed"\nprompt = 900\ntemplate = "chatml"\nshared_prefix = { tokens = 600, fraction = 0.5 }\n'
    classes += '[[classes]]\nname = "prefixed-plain"\nprompt = 777\nshared_prefix = { tokens = 300, fraction = 0.5 }\n'
    wl = load_workload(str(write(tmp_path, classes)))
    seen = set()
    for sess in islice(wl.sessions(11), 300):
        req = sess.first()
        want = {"prefixed": 900, "prefixed-plain": 777}.get(req.workload_class) or int(
            req.workload_class[1:].split("-")[0]
        )
        assert n_tokens(tok, req.prompt) == req.prompt_tokens == want, req.workload_class
        seen.add(req.workload_class)
    assert len(seen) > 20


def test_tokenizer_json_path_is_used(tmp_path, tok):
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    wl = load_workload(str(write(tmp_path, '[[classes]]\nname = "a"\nprompt = 123\n')), tokenizer=str(path))
    req = next(iter(wl.sessions(0))).first()
    assert n_tokens(tok, req.prompt) == req.prompt_tokens == 123
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        load_workload("chat-short", tokenizer=str(tmp_path / "missing.json"))


def test_tokenizer_from_a_model_folder_or_a_hugging_face_id_in_the_cache(tmp_path, tok, monkeypatch):
    """``--tokenizer`` takes a model's folder and a hub id (``org/name``): the id resolves through the Hugging
    Face cache (here one laid out as huggingface_hub writes it, offline), and a missing id says so."""
    folder = tmp_path / "model"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    offline_hub_cache(tmp_path / "hf", "acme/tiny-lm", tok, monkeypatch)
    wf = write(tmp_path, '[[classes]]\nname = "a"\nprompt = 77\n')
    for spec in (str(folder), "acme/tiny-lm"):
        req = next(iter(load_workload(str(wf), tokenizer=spec).sessions(0))).first()
        assert n_tokens(tok, req.prompt) == req.prompt_tokens == 77, spec
    with pytest.raises(FileNotFoundError, match="acme/missing-lm.*Hugging Face cache"):
        load_workload(str(wf), tokenizer="acme/missing-lm")


def _stream(name: str, seed: int, n: int = 40) -> str:
    out = []
    for sess in islice(load_workload(name).sessions(seed), n):
        req = sess.first()
        out.append(json.dumps(asdict(req), sort_keys=True))
        reply = sess.next("a fixed reply")
        while reply is not None:
            out.append(json.dumps([reply[0], asdict(reply[1])], sort_keys=True))
            reply = sess.next("another fixed reply")
    return "\n".join(out)


@pytest.mark.parametrize("name", ["short-long-50-50", "multiturn-chat", "rag", "creative", "code-edit"])
def test_same_seed_same_stream_byte_for_byte(name):
    a, b = _stream(name, 7), _stream(name, 7)
    assert a == b
    assert a != _stream(name, 8)


def test_shared_prefix_requests_share_their_first_n_tokens(tok):
    reqs = [s.first() for s in islice(load_workload("shared-system-prompt").sessions(3), 60)]
    ids = [tok.encode(r.prompt).ids for r in reqs]
    first = {tuple(i[:512]) for i in ids}
    # 90 % share one prefix: the most common 512-token start covers most requests, the rest differ
    counts = {p: sum(1 for i in ids if tuple(i[:512]) == p) for p in first}
    shared = max(counts.values())
    assert 45 <= shared <= 59 and len(first) == 1 + 60 - shared
    assert len({tuple(i[512:]) for i in ids}) == 60  # what follows the prefix is each request's own
    # rag: 4 documents of 1536 tokens, every request starts with one of them
    rag = [tok.encode(s.first().prompt).ids for s in islice(load_workload("rag").sessions(0), 30)]
    assert len({tuple(i[:1536]) for i in rag}) == 4
    assert len({tuple(i[1536:]) for i in rag}) == 30


def test_short_long_mix_and_output_lengths():
    reqs = [s.first() for s in islice(load_workload("short-long-50-50").sessions(0), 400)]
    short = [r for r in reqs if r.workload_class == "short"]
    assert 160 < len(short) < 240
    assert all(r.max_tokens < 10 for r in short)
    assert all(r.max_tokens > 500 for r in reqs if r.workload_class == "long")


def test_multiturn_carries_history_and_ends(tmp_path, tok):
    wl = load_workload("multiturn-chat")
    sess = next(iter(wl.sessions(0)))
    req = sess.first()
    assert req.api == "chat" and [m["role"] for m in req.prompt] == ["user"]
    turns = 1
    while (nxt := sess.next(f"reply number {turns}")) is not None:
        think, req = nxt
        assert 1.0 <= think <= 3.0
        roles = [m["role"] for m in req.prompt]
        assert roles == ["user", "assistant"] * turns + ["user"]
        assert req.prompt[-2]["content"] == f"reply number {turns}"
        turns += 1
    assert turns == sess.turns and 2 <= turns <= 5
    # completions flavour: the transcript is one string whose token count is exact
    p = write(tmp_path, '[[classes]]\nname = "c"\nprompt = 40\ntemplate = "chatml"\nturns = { count = 3 }\n')
    sess = next(iter(load_workload(str(p)).sessions(0)))
    req = sess.first()
    assert n_tokens(tok, req.prompt) == req.prompt_tokens == 40
    think, req2 = sess.next("Hello there.")
    assert think == 0 and req2.prompt.startswith(req.prompt + "Hello there.<|im_end|>\n")
    assert n_tokens(tok, req2.prompt) == req2.prompt_tokens
    assert req2.request_id == "r0.1"


def test_code_edit_prompt_contains_the_code_and_creative_is_open_ended(tok):
    req = next(iter(load_workload("code-edit").sessions(0))).first()
    assert "renamed to" in req.prompt and req.prompt.endswith("<|im_start|>assistant\n```python\n")
    code = req.prompt.split("```python\n")[1].split("```")[0]
    assert req.max_tokens == n_tokens(tok, code) + 8 and n_tokens(tok, req.prompt) == req.prompt_tokens
    chat = next(iter(load_workload("code-edit", api="chat").sessions(0))).first()
    assert chat.api == "chat" and chat.prompt[-1]["content"].startswith("Rewrite the following Python code")
    req = next(iter(load_workload("creative").sessions(0))).first()
    assert req.temperature > 0 and req.seed is not None


def test_every_builtin_loads_and_generates():
    names = builtin_names()
    for want in ("chat-short", "short-long-50-50", "shared-system-prompt", "long-prefill", "code-edit", "creative",
                 "multiturn-chat", "rag"):  # fmt: skip
        assert want in names
    for name in names:
        wl = load_workload(name)
        assert [s.first().max_tokens > 0 for s in islice(wl.sessions(1), 3)] == [True] * 3


def test_shipped_text_avoids_the_known_pre_tokenizer_divergence():
    """transformers' GGUF conversion (served by vLLM from the converted model) splits with GPT-2's regex; it
    only differs from `smollm` on non-ASCII numerals and whitespace runs before a digit, which must stay
    out of the shipped text so that exact lengths hold for that tokenizer too."""
    from workloads.text import DATA

    files = [DATA / "corpus.txt", DATA / "creative_prompts.txt", *sorted((DATA / "code").glob("*.py"))]
    assert len(files) >= 7
    for f in files:
        text = f.read_text()
        assert re.search(r"\s\s\d", text) is None, f
        assert not any(unicodedata.category(ch).startswith("N") and not ch.isascii() for ch in text), f


def test_the_points_of_a_sweep_send_fresh_prompts_and_keep_a_shared_prefix_within_each(tok):
    """Each point and trial of a sweep gets its own seed (loadgen.dispatch.sweep.point_seed), so a point's prompts are
    not another's (a server's prefix cache would answer them: with one seed every point re-sent the first's
    24), while shared-system-prompt's requests still share their prefix within each point. Prompts start at
    a corpus sentence, so two of 144 can begin alike by chance (one 32-token start here)."""
    from loadgen.dispatch.loadspec import LoadSpec
    from loadgen.dispatch.sweep import loads_from, plan_points

    wl = load_workload("chat-short")
    plans = plan_points([wl], loads_from(LoadSpec(concurrency=1, num_requests=24, seed=7), concurrency=[1, 4, 16]), repeat=2)
    assert len({p.load.seed for p in plans}) == 6
    assert [p.load.seed for p in plan_points([wl], loads_from(LoadSpec(concurrency=1, num_requests=24, seed=7), concurrency=[1, 4, 16]), 2)] == [
        p.load.seed for p in plans]  # the run's seed gives them again
    starts = [{tuple(tok.encode(s.first().prompt).ids[:32]) for s in islice(wl.sessions(p.load.seed), 24)}
              for p in plans]
    assert all(len(s) == 24 for s in starts)
    assert sum(map(len, starts)) - len(set().union(*starts)) <= 1  # (was 120: every point the first's 24)
    shared = load_workload("shared-system-prompt")
    for p in plan_points([shared], loads_from(LoadSpec(concurrency=1, num_requests=40, seed=7), concurrency=[1, 4])):
        ids = [tok.encode(s.first().prompt).ids[:512] for s in islice(shared.sessions(p.load.seed), 40)]
        assert max(ids.count(i) for i in ids) >= 30
