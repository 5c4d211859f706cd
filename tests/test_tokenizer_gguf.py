"""The GGUF-built tokenizer must tokenize exactly like transformers' own GGUF tokenizer loading."""

import random
import re
import unicodedata

import pytest

from reference_server.model_files import default_model_path, read_gguf_metadata, tokenizer_from_gguf

SAMPLES = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Numbers: 0 1 12 123 1234 3.14159 -42 1e10 2026-11-21 12:30:45 $1,000,000.00 ½ ² Ⅻ ٣",
    "  leading spaces, trailing spaces   \n\n\n\ttabs\t\tand\r\nCRLF \u00a0nbsp \u2003em-space",
    "Ünïcödé: naïve café façade — “quotes” ‘single’ … 日本語のテキスト 中文字符 한국어 Ελληνικά русский עברית العربية",
    "Emoji: 🙂🚀👩‍👩‍👧 ✔︎ 🇫🇷 and combining e\u0301 a\u0308",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\nclass A:\n    def __init__(self):\n        self.y = [1, 2, 3]\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; } // dot\n#include <stdio.h>\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi 42<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep>y<jupyter_code>z",
    "don't won't it's we're they've I'm you'll he'd DON'T",
    "!!! ??? ... --- *** ___ ~~~ ``` ''' \"\"\" <<>> {{}} [[]] ((  )) ||| &&& @@@ ### %%%",
    "",
    " ",
    "\n",
    "a" * 300 + " " + "ab" * 100,
]


def _random_texts(n: int, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    pool = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
    pool += list(" \n\t\r   .,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`")
    pool += list("éüßøæœçñ日本語中文한국어Ωπ€£¥©®™°±×÷🙂🚀")
    pool += ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "'s", "'ll", "    ", "\n\n", "123", " 7"]
    return ["".join(rng.choice(pool) for _ in range(rng.randint(1, 120))) for _ in range(n)]


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")  # a dev dependency: installed by `make setup`
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_default_model_path_is_the_bundled_gguf():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    meta = read_gguf_metadata(path)
    assert meta["general.architecture"] == "llama"
    assert meta["tokenizer.ggml.pre"] == "smollm"
    assert len(meta["tokenizer.ggml.tokens"]) == 49152


def _has_non_ascii_number(text: str) -> bool:
    return any(unicodedata.category(ch).startswith("N") and not ch.isascii() for ch in text)


def _gpt2_split_differs(text: str) -> bool:
    """Where GPT-2's split alone differs from splitting digits off first (see below)."""
    return _has_non_ascii_number(text) or re.search(r"\s\s\d", text) is not None


def _assert_same(tok, hf, texts):
    for text in texts:
        ours = tok.encode(text).ids
        theirs = hf(text, add_special_tokens=False)["input_ids"]
        assert ours == theirs, text
        assert tok.decode(ours, skip_special_tokens=False) == hf.decode(theirs)


def test_matches_transformers_gguf_tokenizer(hf_tokenizer):
    """Same ids as transformers' GGUF loader wherever its pre-tokenizer agrees with `smollm`.

    transformers maps no split regex for `smollm` and keeps GPT-2's. SmolLM2's vocabulary has no multi-digit
    tokens, so that only differs on non-ASCII numbers (``²``, ``Ⅻ``, ``٣``), which llama.cpp and SmolLM2's
    own tokenizer.json split off one by one, and on a whitespace run before a digit (``"a\\n\\n1"``: digits
    first leaves ``"\\n\\n"`` whole, GPT-2's ``\\s+(?!\\S)`` cuts it). Those texts are covered by the next test.
    """
    tok = tokenizer_from_gguf(default_model_path())
    texts = [t for t in SAMPLES + _random_texts(400) if not _gpt2_split_differs(t)]
    assert len(texts) > 300
    _assert_same(tok, hf_tokenizer, texts)


def test_matches_transformers_with_smollm2_pre_tokenizer(hf_tokenizer):
    """With SmolLM2's tokenizer.json pre-tokenizer, transformers' GGUF vocabulary agrees on every text."""
    from tokenizers import pre_tokenizers

    backend = hf_tokenizer.backend_tokenizer
    saved = backend.pre_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    try:
        texts = SAMPLES + _random_texts(400, seed=2) + ["½ ² Ⅻ ٣ x² 10³", "a\n\n123  4"]
        assert sum(_gpt2_split_differs(t) for t in texts) > 20
        _assert_same(tokenizer_from_gguf(default_model_path()), hf_tokenizer, texts)
    finally:
        backend.pre_tokenizer = saved


def test_control_tokens_are_single_ids_and_digits_split():
    tok = tokenizer_from_gguf(default_model_path())
    assert tok.encode("<|im_start|>").ids == [1]
    assert tok.encode("<|im_end|>").ids == [2]
    assert tok.encode("<|endoftext|>").ids == [0]
    assert tok.encode("<|im_start|>user").ids[0] == 1
    # smollm pre-tokenizer: every digit is its own token
    assert tok.encode("2026").tokens == ["2", "0", "2", "6"]
    text = "naïve café 世界 🙂\n\tx  y"
    assert tok.decode(tok.encode(text).ids) == text


def test_cached_per_path():
    path = default_model_path()
    assert tokenizer_from_gguf(path) is tokenizer_from_gguf(str(path))


def test_not_a_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 32)
    with pytest.raises(ValueError, match="not a GGUF file"):
        tokenizer_from_gguf(bad)
