"""The engine's heap stays flat under steps of ever new sizes (oneDNN's primitive caches are bounded), and
what the model loader used (its freed temporaries, the GGUF reader) does not stay resident. Each check
runs in a fresh process: oneDNN reads its cache capacities once, at its first use in a process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from reference_server.engine.cpu_memory import CACHE_ENV, ONEDNN_CACHE_CAPACITY

PROBE = r"""
import ctypes, json, os, sys
import torch
from reference_server.config import EngineConfig
from reference_server.engine.cpu_memory import CACHE_ENV
from reference_server.engine.engine import Engine
from reference_server.engine.sequence import SamplingParams
from reference_server.model_files import default_model_path

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]

try:
    mallinfo2 = ctypes.CDLL(None).mallinfo2
except AttributeError:
    print(json.dumps({"skip": "no glibc mallinfo2"}))
    sys.exit(0)
mallinfo2.restype = MallInfo2

def heap_in_use():  # MB: malloc'd and not freed (heap chunks + mmapped chunks)
    m = mallinfo2()
    return (m.uordblks + m.hblkhd) / 2**20

engine = Engine(EngineConfig(model=default_model_path(), threads=1, num_kv_blocks=64, enable_prefix_caching=False))
if engine.runner.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
    print(json.dumps({"skip": "the linears run through oneDNN only in bf16 on CPU"}))
    sys.exit(0)
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
before = rss()
ctypes.CDLL(None).malloc_trim(0)
released_by_trim = before - rss()  # what the engine left resident but free
from reference_server.model.gguf_loader import gguf_reader
readers_kept = gguf_reader.cache_info().currsize
params = SamplingParams(temperature=0, max_tokens=1)
def prefill(lengths):  # one step per prompt length: every linear sees a new number of rows
    for n in lengths:
        engine.generate([[(7 * i) % 1000 + 10 for i in range(n)]], params)
prefill(range(1, int(sys.argv[1])))
warm = heap_in_use()
prefill(range(int(sys.argv[1]), int(sys.argv[2])))
print(json.dumps({"released_by_trim_mb": released_by_trim, "readers_kept": readers_kept, "growth_after_warmup_mb": heap_in_use() - warm,
                  "cache_env": [os.environ.get(n) for n in CACHE_ENV]}))
"""


def test_heap_flat_under_new_step_sizes_and_loader_heap_released() -> None:
    # 80 prompt lengths fill the caches (4+ primitives each, > 256); 80 more added 157 MB with the old caps
    done = subprocess.run([sys.executable, "-c", PROBE, "81", "161"], capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items() if k not in CACHE_ENV})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    assert out["cache_env"] == [str(ONEDNN_CACHE_CAPACITY)] * len(CACHE_ENV)
    assert out["growth_after_warmup_mb"] < 40, out
    assert out["released_by_trim_mb"] < 64, out  # was ~400 MB: the loader's freed temporaries, kept resident
    assert out["readers_kept"] == 0, out  # the GGUF reader held ~220 MB (its objects, the file's map)
