"""Native CPU kernels (``csrc/cpu_kernels.c``) for the bf16 model: built on first use, loaded with ctypes.

* Paged decode attention. Through PyTorch ops, decode attention first gathers every sequence's blocks
  into a padded copy (``index_select``), then runs ``baddbmm`` / ``softmax`` / ``bmm`` on it: ~6 kernels per
  layer and a write plus a re-read of all the context's K/V. The kernel reads the blocks in place through
  the block table, in one pass (measured here, 16 sequences of ~110 tokens, 30 layers with cold caches:
  4.3-5.7 ms vs 10.7-13.4 ms; a whole decode step at 16 streams 12 % shorter, steps interleaved).
* RMSNorm, RoPE + the K/V cache write, and SiLU-and-multiply, each in one call instead of 2-6 small
  PyTorch kernels (at 16 rows the dispatch, not the arithmetic, is their cost: RMSNorm 10 vs 35 us here).
* Greedy argmax over the logits rows (``torch.argmax`` took 0.68 ms for 16 x 49152 float32 here).
* Weight-only quantised linears (model/quant.py), and with them a whole decode step in one call
  (``decode_forward``, model/fused_decode.py): the kernels above, op by op, in one OpenMP region.

They are written for an x86-64 CPU with AVX512-BF16 (the bf16 model dtype's own condition) and need a C
compiler (``$CC``, else ``cc``). On a CPU with AVX2 and FMA but without AVX-512 (an AMD Zen 3, say) the same
source builds against SIMDe's portable AVX-512 intrinsics (Debian's ``libsimde-dev``, and for the few it
lacks ``csrc/simde_extra.h``): slower, and used only where bf16 is asked for (``--dtype bf16``; ``auto`` is
float32 on such a CPU), but the same arithmetic, so that they run and are tested there too. The shared
object is cached under ``$SERVELAB_CACHE/native`` (default ``~/.cache/servelab``), keyed by the source,
flags and compiler, so the build (~1 s; with SIMDe 15 s) happens once. Where
any of this is missing, :func:`cpu_kernels` says why and the engine keeps the PyTorch ops. ctypes drops
the GIL during each call; the kernels' OpenMP loops run on PyTorch's own thread team (same libgomp)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from reference_server.kernels.quant_weight import QuantWeight

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.c"
HEADERS = [SOURCE.with_name("simde_extra.h")]
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]
# the compiler's instruction sets, each with the /proc/cpuinfo flags it needs: AVX-512 itself, else SIMDe's
AVX512 = "AVX-512"
ISAS = {AVX512: (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma"],
                    ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "fma")),
        "AVX-512 emulated on AVX2 by SIMDe": (["-DSERVELAB_SIMDE", "-mavx2", "-mfma", "-mf16c"], ("avx2", "fma", "f16c"))}


class QMat(ctypes.Structure):
    """A quantised weight (quant.QuantWeight) as ``decode_forward`` reads it (csrc/cpu_kernels.c: qmat)."""

    _fields_ = [("qw", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("minv", ctypes.c_void_p),
                ("n", ctypes.c_int32), ("k", ctypes.c_int32), ("bits", ctypes.c_int32), ("group", ctypes.c_int32)]


class QLayer(ctypes.Structure):
    """One decoder layer: norms, quantised linears and its KV cache (csrc/cpu_kernels.c: qlayer)."""

    _fields_ = [("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p), ("qkv", QMat), ("o", QMat),
                ("gate_up", QMat), ("down", QMat), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("k_scale", ctypes.c_void_p), ("v_scale", ctypes.c_void_p)]


class QModel(ctypes.Structure):
    """The whole model for ``decode_forward`` (csrc/cpu_kernels.c: qmodel)."""

    _fields_ = [(name, ctypes.c_int32) for name in ("n_layers", "hidden", "inter", "n_heads", "n_kv_heads", "head_dim",
                                                    "vocab", "num_blocks", "block_size", "vnni")] + [
        ("eps", ctypes.c_float), ("rope_len", ctypes.c_int64), ("embed", ctypes.c_void_p),
        ("rope_cos", ctypes.c_void_p), ("rope_sin", ctypes.c_void_p), ("norm", ctypes.c_void_p), ("head", QMat),
        ("layers", ctypes.POINTER(QLayer))]


class CpuKernels:
    """The loaded kernels. Tensors are bf16 on CPU; block ids must come from the block manager (< blocks)."""

    def __init__(self, lib: ctypes.CDLL, vnni: bool, isa: str) -> None:
        self.vnni = vnni  # the CPU has AVX512-VNNI: integer dot products for decode-size quantised linears
        self.name = "native" if isa == AVX512 else f"native ({isa})"  # the server's kernels line
        ptr = ctypes.c_void_p
        self._attn = lib.paged_decode_attention_bf16
        self._attn.restype = ctypes.c_int
        self._attn.argtypes = [ptr, ctypes.c_int64, ptr, ptr, ptr, ptr, ptr] + [ctypes.c_int] * 7
        self._attn_i8 = lib.paged_decode_attention_i8
        self._attn_i8.restype = ctypes.c_int
        self._attn_i8.argtypes = [ptr, ctypes.c_int64] + [ptr] * 7 + [ctypes.c_int] * 7
        self._kv_write_i8 = lib.kv_write_int8
        self._kv_write_i8.restype = ctypes.c_int
        self._kv_write_i8.argtypes = [ptr, ctypes.c_int64, ptr, ptr, ptr] + [ctypes.c_int] * 5
        self._norm = lib.rms_norm_bf16
        self._norm.restype = None
        self._norm.argtypes = [ptr, ctypes.c_int64, ptr, ptr, ctypes.c_int, ctypes.c_int, ctypes.c_float]
        self._rope = lib.rope_write_kv_bf16
        self._rope.restype = ctypes.c_int
        self._rope.argtypes = [ptr] * 6 + [ctypes.c_int] * 4 + [ctypes.c_int64]
        self._argmax = lib.argmax_rows_f32
        self._argmax.restype = None
        self._argmax.argtypes = [ptr, ptr, ctypes.c_int, ctypes.c_int]
        self._silu = lib.silu_mul_bf16
        self._silu.restype = ctypes.c_int
        self._silu.argtypes = [ptr, ptr, ctypes.c_int, ctypes.c_int]
        self._qlinear = lib.qlinear_bf16
        self._qlinear.restype = ctypes.c_int
        self._qlinear.argtypes = [ptr, ctypes.c_int64, ptr, ptr, ptr, ptr, ctypes.c_int64, ptr] + [ctypes.c_int] * 6
        self._decode = lib.decode_forward
        self._decode.restype = ctypes.c_int
        self._decode.argtypes = [ctypes.POINTER(QModel)] + [ptr] * 5 + [ctypes.c_int] * 3 + [ptr]
        self.direct_rows: int = lib.qlinear_direct_rows()  # up to this many rows x goes straight to the weights
        self._qdequant = lib.qdequant_bf16
        self._qdequant.restype = ctypes.c_int
        self._qdequant.argtypes = [ptr] * 4 + [ctypes.c_int] * 4

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim of ``x`` [T, N] (rows may be strided)."""
        t, n = x.shape
        if not (x.dtype == weight.dtype == torch.bfloat16 and x.stride(1) == 1 and weight.shape == (n,)
                and weight.is_contiguous()):
            raise ValueError("rms_norm: unexpected tensor layout or dtype")
        out = torch.empty((t, n), dtype=x.dtype)
        self._norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), t, n, eps)
        return out

    def rope_write_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                      k_cache: torch.Tensor | None, v_cache: torch.Tensor | None, n_heads: int) -> None:
        """RoPE on the Q heads of ``qkv`` [T, (H + 2 KVH) * D] in place; the rotated K and the V heads into
        the bf16 caches [KVH, blocks, block_size, D] at ``slots`` [T] (int64), or, without caches, the K
        heads rotated in place too (for :meth:`kv_write_int8`). ``cos``/``sin``: [T, 1, D], the model's
        rotate-half tables (sign folded into ``sin``)."""
        t = qkv.shape[0]
        d = cos.shape[-1]
        kvh = (qkv.shape[1] // d - n_heads) // 2
        nb, bs = (0, 0) if k_cache is None else k_cache.shape[1:3]
        caches_ok = (k_cache is None and v_cache is None) or (
            k_cache is not None and v_cache is not None and k_cache.dtype == v_cache.dtype == torch.bfloat16
            and k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape
            and k_cache.shape[0] == kvh and k_cache.shape[3] == d)
        if not (caches_ok and qkv.dtype == cos.dtype == sin.dtype == torch.bfloat16 and qkv.is_contiguous()
                and qkv.shape[1] == (n_heads + 2 * kvh) * d and cos.is_contiguous() and sin.is_contiguous()
                and cos.numel() == sin.numel() == t * d and slots.dtype == torch.int64 and slots.is_contiguous()
                and slots.shape == (t,)):
            raise ValueError("rope_write_kv: unexpected tensor layout or dtype")
        if self._rope(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                      None if k_cache is None else k_cache.data_ptr(), None if v_cache is None else v_cache.data_ptr(),
                      t, n_heads, kvh, d, nb * bs) != 0:
            raise ValueError(f"rope_write_kv: a slot outside the cache ({nb * bs} slots) or head_dim {d} unsupported")

    def kv_write_int8(self, rows: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor) -> None:
        """bf16 ``rows`` [T, KVH * D] (rows may be strided) into the int8 ``cache`` [KVH, blocks,
        block_size, D] at ``slots`` [T], updating its ``scales`` [KVH, blocks] (kv_cache.quantize_into's rule)."""
        kvh, nb, bs, d = cache.shape
        t = rows.shape[0]
        if not (rows.dtype == torch.bfloat16 and rows.shape[1] == kvh * d and rows.stride(1) == 1
                and cache.dtype == torch.int8 and cache.is_contiguous() and scales.dtype == torch.float32
                and scales.shape == (kvh, nb) and scales.is_contiguous() and slots.dtype == torch.int64
                and slots.is_contiguous() and slots.shape == (t,)):
            raise ValueError("kv_write_int8: unexpected tensor layout or dtype")
        if self._kv_write_i8(rows.data_ptr(), rows.stride(0), slots.data_ptr(), cache.data_ptr(), scales.data_ptr(),
                             t, kvh, d, nb, bs) != 0:
            raise ValueError(f"kv_write_int8: a slot outside the cache ({nb * bs} slots)")

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up`` [T, 2 I] = [gate | up]."""
        t, i2 = gate_up.shape
        if not (gate_up.dtype == torch.bfloat16 and gate_up.is_contiguous() and i2 % 32 == 0):
            raise ValueError("silu_mul: unexpected tensor layout or dtype (the width must be a multiple of 32)")
        out = torch.empty((t, i2 // 2), dtype=gate_up.dtype)
        self._silu(gate_up.data_ptr(), out.data_ptr(), t, i2 // 2)
        return out

    def qlinear(self, x: torch.Tensor, w: QuantWeight, residual: torch.Tensor | None = None,
                vnni: bool | None = None) -> torch.Tensor:
        """``x @ W.T (+ residual)`` for bf16 ``x`` [M, K] (rows may be strided) and a quantised ``W`` (model/quant.py).
        ``vnni``: the int8-activation integer path for up to 3 rows (default: where the CPU has it; False
        forces the bf16 path)."""
        m, k = x.shape
        if not (x.dtype == torch.bfloat16 and x.stride(1) == 1 and k == w.k and w.qweight.is_contiguous()
                and w.scale.is_contiguous() and w.minimum.is_contiguous()):
            raise ValueError("qlinear: unexpected tensor layout or dtype")
        if residual is not None and not (residual.dtype == torch.bfloat16 and residual.shape == (m, w.n)
                                         and residual.stride(1) == 1):
            raise ValueError("qlinear: unexpected residual layout or dtype")
        out = torch.empty((m, w.n), dtype=torch.bfloat16)
        rc = self._qlinear(x.data_ptr(), x.stride(0), w.qweight.data_ptr(), w.scale.data_ptr(), w.minimum.data_ptr(),
                           None if residual is None else residual.data_ptr(),
                           0 if residual is None else residual.stride(0), out.data_ptr(), m, w.n, k, w.bits, w.group,
                           int(self.vnni if vnni is None else vnni))
        if rc != 0:
            raise ValueError(f"qlinear: {w.bits}-bit weights in groups of {w.group} unsupported")
        return out

    def decode_forward(self, model: QModel, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                       tables: torch.Tensor, lens: torch.Tensor, num_layers: int) -> torch.Tensor:
        """Float32 logits [B, vocab] of a decode step through the first ``num_layers`` layers of ``model``:
        ``ids``, ``pos``, ``slots``, ``lens`` [B] and ``tables`` [B, n] int64, as :meth:`paged_attention`;
        each sequence's new K/V is written into the cache. The same kernels, op by op, as the per-op calls."""
        b = ids.shape[0]
        if not (all(t.dtype == torch.int64 and t.is_contiguous() and t.shape == (b,) for t in (ids, pos, slots, lens))
                and tables.dtype == torch.int64 and tables.is_contiguous() and tables.dim() == 2
                and tables.shape[0] == b):
            raise ValueError("decode_forward: unexpected tensor layout or dtype")
        out = torch.empty((b, model.vocab), dtype=torch.float32)
        if self._decode(ctypes.byref(model), ids.data_ptr(), pos.data_ptr(), slots.data_ptr(), tables.data_ptr(),
                        lens.data_ptr(), b, tables.shape[1], num_layers, out.data_ptr()) != 0:
            raise ValueError("decode_forward: a token, position, slot or context length out of range, or shapes "
                             "the kernels do not handle")
        return out

    def qdequant(self, w: QuantWeight) -> torch.Tensor:
        """The bf16 [N, K] weight that :meth:`qlinear` multiplies with."""
        out = torch.empty((w.n, w.k), dtype=torch.bfloat16)
        if self._qdequant(w.qweight.data_ptr(), w.scale.data_ptr(), w.minimum.data_ptr(), out.data_ptr(), w.n, w.k,
                          w.bits, w.group) != 0:
            raise ValueError(f"qdequant: {w.bits}-bit weights in groups of {w.group} unsupported")
        return out

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Row-wise argmax of float32 ``logits`` [B, V] into int64 [B], as ``torch.argmax`` (first maximum;
        first NaN)."""
        if not (logits.dtype == torch.float32 and logits.dim() == 2 and logits.is_contiguous()):
            raise ValueError("argmax: unexpected tensor layout or dtype")
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self._argmax(logits.data_ptr(), out.data_ptr(), logits.shape[0], logits.shape[1])
        return out

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                        lens: torch.Tensor, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Decode attention, one new token per sequence: ``q`` [B, H, D] bf16 (rows may be strided, heads
        contiguous), caches [KVH, blocks, block_size, D] contiguous, bf16, or int8 with their float32
        ``k_scale``/``v_scale`` [KVH, blocks] (model/kv_cache.py), ``tables`` [B, n] int64 block ids, ``lens`` [B]
        int64 context lengths (the new token included, its K/V already in the cache)."""
        b, h, d = q.shape
        kvh, nb, bs, _ = k_cache.shape
        scales = (k_scale, v_scale) if k_scale is not None and v_scale is not None else None
        kv_ok = k_cache.dtype == v_cache.dtype == (torch.int8 if scales else torch.bfloat16) and (
            scales is None or all(x.dtype == torch.float32 and x.is_contiguous() and x.shape == (kvh, nb) for x in scales))
        if not (kv_ok and q.dtype == torch.bfloat16 and q.stride()[1:] == (d, 1)
                and k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape
                and tables.dtype == lens.dtype == torch.int64 and tables.is_contiguous() and lens.is_contiguous()
                and tables.shape[0] == lens.shape[0] == b and k_cache.shape[3] == d):
            raise ValueError("paged attention: unexpected tensor layout or dtype")
        out = torch.empty((b, h, d), dtype=q.dtype)
        shapes = (out.data_ptr(), b, h, kvh, d, nb, bs, tables.shape[1])
        if scales:
            rc = self._attn_i8(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), scales[0].data_ptr(),
                               scales[1].data_ptr(), tables.data_ptr(), lens.data_ptr(), *shapes)
        else:
            rc = self._attn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                            lens.data_ptr(), *shapes)
        if rc != 0:
            raise ValueError(f"paged attention: shapes not supported (heads {h}/{kvh}, head_dim {d}, block {bs}) "
                             "or a context length outside its block table")
        return out


def supports(head_dim: int, n_heads: int, n_kv_heads: int, block_size: int) -> str | None:
    """Why the attention kernel cannot serve this model shape, or None when it can."""
    if head_dim % 32 or head_dim > 256:
        return f"head_dim {head_dim} (the kernel needs a multiple of 32, at most 256)"
    if n_heads % n_kv_heads or n_heads // n_kv_heads > 16:
        return f"{n_heads} query heads over {n_kv_heads} KV heads (at most 16 per KV head)"
    if block_size % 16:
        return f"block size {block_size} (the kernel needs a multiple of 16)"
    return None


@functools.cache
def cpu_kernels() -> CpuKernels | str:
    """The kernels, or the reason they are unavailable here (compiled and loaded once per process)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"needs Linux on x86-64 (this is {platform.system()} on {platform.machine()})"
    try:
        cpu = Path("/proc/cpuinfo").read_text().split()
    except OSError as e:
        return f"cannot read /proc/cpuinfo: {e}"
    isa = next((name for name, (_, need) in ISAS.items() if all(f in cpu for f in need)), None)
    if isa is None:
        return f"the CPU lacks {', '.join(f for f in ISAS[AVX512][1] if f not in cpu)} (and AVX2, FMA or F16C)"
    flags = FLAGS + ISAS[isa][0]
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        return f"no C compiler ({os.environ.get('CC', 'cc')!r} not found; install gcc or set CC)"
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        src = SOURCE.read_bytes() + b"".join(h.read_bytes() for h in HEADERS)
    except (OSError, subprocess.SubprocessError) as e:
        return f"cannot run {cc}: {e}"
    key = hashlib.sha256(src + " ".join(flags).encode() + version.encode()).hexdigest()[:16]
    out_dir = Path(os.environ.get("SERVELAB_CACHE") or Path.home() / ".cache" / "servelab") / "native"
    so = out_dir / f"cpu_kernels-{key}.so"
    if not so.exists():
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)  # build aside, then one atomic rename
            os.close(fd)
            res = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=300)
            if res.returncode != 0:
                os.unlink(tmp)
                if "simde/" in res.stderr and "No such file" in res.stderr:
                    return ("the CPU lacks AVX-512 and SIMDe's headers, which stand in for it, are not installed "
                            "(apt-get install libsimde-dev)")
                return f"{cc} failed to build {SOURCE.name}: {res.stderr.strip()[-500:]}"
            os.replace(tmp, so)
        except (OSError, subprocess.SubprocessError) as e:
            return f"cannot build {SOURCE.name} into {out_dir}: {e}"
    try:
        return CpuKernels(ctypes.CDLL(str(so)), "avx512_vnni" in cpu, isa)
    except OSError as e:
        return f"cannot load {so}: {e}"
