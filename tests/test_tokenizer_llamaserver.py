"""The GGUF-built tokenizer and the workloads' exact prompt lengths, checked by llama.cpp itself.

llama-server's ``/tokenize`` (with ``parse_special``) is the reference for the bundled model: same ids for
varied text, and every workload prompt is exactly ``prompt_tokens`` long when the server tokenizes it.
"""

import random
from itertools import islice

import httpx
import pytest

from backends.launcher import ServerProcess, free_port, render_command
from reference_server.model_files import default_model_path, tokenizer_from_gguf
from workloads.loader import load_workload
from workloads.text import DATA

pytestmark = pytest.mark.llamaserver
SERVER = "llama-server -m {model} -t 1 -c 512 -np 1 --host 127.0.0.1 --port {port}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("llama") / "server.log"
    with ServerProcess(render_command(SERVER, {}, port), port, log, health_timeout_s=120) as srv:
        with httpx.Client(base_url=srv.base_url, timeout=30) as client:
            yield client


def server_ids(client: httpx.Client, text: str) -> list[int]:
    r = client.post("/tokenize", json={"content": text, "add_special": False, "parse_special": True})
    r.raise_for_status()
    return r.json()["tokens"]


def _texts() -> list[str]:
    rng = random.Random(5)
    pool = list("abcXYZ0123456789 \n\t.,;:'\"()[]{}<>-_=+*/\\|@#$%&~`éüß日本語中文한국어Ω€🙂²½٣")
    pool += ["<|im_start|>", "<|im_end|>", "'s", "'ll", "    ", "\n\n", "  7", "\n\n12"]
    texts = ["".join(rng.choice(pool) for _ in range(rng.randint(1, 100))) for _ in range(150)]
    texts += [
        "Numbers: 0 1 12 123 1234 3.14159 -42 2026-11-21 $1,000.00 ½ ² Ⅻ ٣",
        "a\n\n123  4\t\t5",
        "def f(x):\n    return x ** 2  # square\n",
        "<|im_start|>system\nHi<|im_end|>\n<|im_start|>user\n42<|im_end|>\n<|im_start|>assistant\n",
    ]
    return texts


def test_ids_match_llama_cpp(server):
    tok = tokenizer_from_gguf(default_model_path())
    for text in _texts():
        assert tok.encode(text).ids == server_ids(server, text), repr(text)


@pytest.mark.parametrize("name", ["chat-short", "shared-system-prompt", "code-edit", "prefill-2000"])
def test_workload_prompt_lengths_as_llama_cpp_counts_them(server, name):
    for sess in islice(load_workload(name).sessions(2), 6):
        req = sess.first()
        assert len(server_ids(server, req.prompt)) == req.prompt_tokens


def test_mooncake_sample_lengths_as_llama_cpp_counts_them(server):
    for sess in islice(load_workload(str(DATA / "sample_mooncake.jsonl"), limit=10).sessions(0), 10):
        req = sess.first()
        assert len(server_ids(server, req.prompt)) == req.prompt_tokens
