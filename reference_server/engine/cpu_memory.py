"""Process-wide memory settings of the engine on CPU: bounded oneDNN caches, and freed heap handed back.

PyTorch runs the bf16 linears (and other CPU matmuls) through oneDNN, which JIT-compiles a primitive for
every distinct shape and keeps it in two LRU caches of 1024 entries each: ideep's (``LRU_CACHE_CAPACITY``)
and oneDNN's own (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``); a primitive lives while either cache holds it.
An engine step has any number of rows from 1 to its token budget, so under varied traffic the caches
kept filling: in a 10-minute soak the heap in use grew by ~290 MB in 4.5 minutes with the Python object
count flat (measured with glibc's ``mallinfo2``; ~0.45-0.6 MB per primitive here, 4 linear shapes x
192 row counts took 470 MB). See docs/reference-server.md, "Soak"."""

from __future__ import annotations

import ctypes
import os

ONEDNN_CACHE_CAPACITY = 256
"""Primitives each cache keeps (both at 64 held 29 MB here, at 1024 470 MB). A decode step of ``b`` requests
uses 5 linear primitives (QKV, output, gate/up, down, head), so 256 holds the decode shapes of every
batch up to ~50 requests; a miss costs one JIT compile (~1-5 ms measured here)."""

CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> None:
    """Cap both caches at ``capacity`` primitives, unless the environment already sets them. oneDNN and
    ideep read these variables once, at their first use in the process: call this before the first
    CPU matmul (the engine does, before it builds the model)."""
    for name in CACHE_ENV:
        os.environ.setdefault(name, str(capacity))


def release_free_heap() -> bool:
    """Hand the heap that freed allocations left behind back to the OS (glibc's ``malloc_trim``).

    Loading the model dequantises and converts every weight through temporaries; glibc keeps the freed
    heap mapped, and ~420 MB of it stayed resident for the server's whole life. False where the C
    library has no ``malloc_trim`` (not glibc) or nothing was released."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):
        return False
    return bool(trim(0))
