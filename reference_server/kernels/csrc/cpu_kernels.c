/* Paged decode attention over a bf16 or int8 KV cache, for x86-64 CPUs with AVX512-BF16.
 *
 * One query token per sequence attends to its whole context, read in place from the paged cache through
 * its block table: no gathered copy of K/V, one pass with an online softmax (running max and sum), the
 * next tile's K and V prefetched (its address comes from the block table, which the hardware prefetcher
 * cannot follow). Work items are (sequence, KV head) pairs; the G = H / KVH query heads of a KV head share
 * every K/V load (GQA). Scores and the weighted sum are accumulated in float32 (QK^T by VDPBF16PS, exact
 * bf16 products), the output is rounded to bf16 once.
 *
 * Built by reference_server/kernels/native.py with the system C compiler; OpenMP is the same libgomp that
 * PyTorch loaded, so the kernel runs on PyTorch's thread team (torch.set_num_threads applies). */
#ifdef SERVELAB_SIMDE /* a CPU without AVX-512: the same intrinsics from SIMDe's portable code (on AVX2) */
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include "simde_extra.h"
#else
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 16 /* tokens per score vector: one zmm of float32 */
#define MAXG 16
#define MAXD 256

/* lane t of the result = the sum of the 16 lanes of v[t] (a transpose folded into the reduction) */
static inline __m512 sum16(const __m512 v[16]) {
    __m512 r[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        r[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(r[2 * i], r[2 * i + 1], 0x44), _mm512_shuffle_ps(r[2 * i], r[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

/* e^x, x clamped to [-87, 88] (e^-87 ~ 1e-38); relative error ~2e-7. */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n); /* 2^t = 2^n * 2^f, f in [0, 1) */
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

static inline __m512 load_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as PyTorch */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline void prefetch(const void *p, size_t bytes) {
    for (size_t i = 0; i < bytes; i += 64) _mm_prefetch((const char *)p + i, _MM_HINT_T0);
}

/* 32 cache elements from element idx as bf16 (int8 values are exact in bf16), and 16 as float32 */
static inline __m512bh kv_bf16x32(const void *cache, size_t idx, int i8) {
    if (!i8) return (__m512bh)_mm512_loadu_si512((const uint16_t *)cache + idx);
    const int8_t *s = (const int8_t *)cache + idx;
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)s)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(s + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

static inline __m512 kv_f32x16(const void *cache, size_t idx, int i8) {
    if (!i8) return load_bf16x16((const uint16_t *)cache + idx);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)cache + idx))));
}

/* q: [B, H, D] with row stride q_stride (elements) and heads contiguous; out: [B, H, D] contiguous.
 * k_cache, v_cache: [KVH, NB, BS, D] contiguous, bf16 (i8 = 0) or int8 with float32 scales [KVH, NB]
 * (i8 = 1, see kv_write_int8: a tile of TILE tokens lies in one block, so its K scale multiplies its
 * scores and its V scale its softmax weights). tables: [B, max_blocks] block ids; lens: [B] context
 * lengths (the new token included, its K/V already written). q comes scaled by 1/sqrt(D).
 * Returns 0, or -1 when the shapes are outside what this kernel handles (nothing is written then). */
static int attention_check(const int64_t *lens, int B, int H, int KVH, int D, int BS, int max_blocks) {
    if (B < 0 || KVH < 1 || H % KVH || H / KVH > MAXG || D % 32 || D > MAXD || BS % TILE || BS < TILE) return -1;
    for (int b = 0; b < B; b++)
        if (lens[b] < 1 || lens[b] > (int64_t)max_blocks * BS) return -1;
    return 0;
}

/* The work of paged_decode_attention (shapes checked by attention_check), shared out over the calling
 * parallel region's threads (an orphaned omp for: run by one thread outside a parallel region). */
static inline __attribute__((always_inline)) void attention_items(
    const uint16_t *q, int64_t q_stride, const void *k_cache, const void *v_cache, const float *k_scale,
    const float *v_scale, const int64_t *tables, const int64_t *lens, uint16_t *out, int B, int H, int KVH, int D,
    int NB, int BS, int max_blocks, const int i8) {
    const int G = H / KVH, nd = D / 16;
    const size_t esize = i8 ? 1 : 2;
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < B * KVH; item++) {
        const int b = item / KVH, h = item % KVH;
        const uint16_t *qh = q + (size_t)b * q_stride + (size_t)h * G * D;
        const int64_t *table = tables + (size_t)b * max_blocks;
        const int64_t ctx = lens[b];
        __m512 acc[MAXG][MAXD / 16];
        float m[MAXG], l[MAXG], p[MAXG][TILE];
        for (int g = 0; g < G; g++) {
            for (int c = 0; c < nd; c++) acc[g][c] = _mm512_setzero_ps();
            m[g] = -1e30f;
            l[g] = 0.f;
        }
        for (int64_t start = 0; start < ctx; start += TILE) {
            const int n = ctx - start < TILE ? (int)(ctx - start) : TILE;
            const __mmask16 valid = (__mmask16)((1u << n) - 1u);
            const size_t blk = (size_t)h * NB + (size_t)table[start / BS];
            const size_t tile = (blk * BS + (size_t)(start % BS)) * D; /* element index of the tile */
            const float ks = i8 ? k_scale[blk] : 1.f, vs = i8 ? v_scale[blk] : 1.f;
            /* two tiles ahead (both at the first tile): 6 % faster than one ahead, 30 layers cold */
            for (int64_t s2 = start == 0 ? TILE : start + 2 * TILE; s2 < ctx && s2 <= start + 2 * TILE; s2 += TILE) {
                const size_t next = (((size_t)h * NB + (size_t)table[s2 / BS]) * BS + (size_t)(s2 % BS)) * D * esize;
                prefetch((const char *)k_cache + next, TILE * D * esize);
                prefetch((const char *)v_cache + next, TILE * D * esize);
            }
            for (int g = 0; g < G; g++) { /* scores of the tile, then the online-softmax update */
                const uint16_t *qg = qh + (size_t)g * D;
                __m512 part[TILE];
                for (int t = 0; t < TILE; t++) {
                    __m512 a = _mm512_setzero_ps();
                    if (t < n)
                        for (int c = 0; c < D; c += 32)
                            a = _mm512_dpbf16_ps(a, kv_bf16x32(k_cache, tile + (size_t)t * D + c, i8),
                                                 (__m512bh)_mm512_loadu_si512(qg + c));
                    part[t] = a;
                }
                const __m512 s = i8 ? _mm512_mul_ps(sum16(part), _mm512_set1_ps(ks)) : sum16(part);
                const float tile_max = _mm512_mask_reduce_max_ps(valid, s);
                const float m_new = tile_max > m[g] ? tile_max : m[g];
                const float rescale = _mm512_cvtss_f32(exp_ps(_mm512_set1_ps(m[g] - m_new)));
                const __m512 e = _mm512_maskz_mov_ps(valid, exp_ps(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
                l[g] = l[g] * rescale + _mm512_reduce_add_ps(e);
                m[g] = m_new;
                for (int c = 0; c < nd; c++) acc[g][c] = _mm512_mul_ps(acc[g][c], _mm512_set1_ps(rescale));
                _mm512_storeu_ps(p[g], i8 ? _mm512_mul_ps(e, _mm512_set1_ps(vs)) : e);
            }
            for (int t = 0; t < n; t++) { /* acc += p * V, V converted once for all G heads */
                __m512 v[MAXD / 16];
                for (int c = 0; c < nd; c++) v[c] = kv_f32x16(v_cache, tile + (size_t)t * D + 16 * c, i8);
                for (int g = 0; g < G; g++) {
                    const __m512 pg = _mm512_set1_ps(p[g][t]);
                    for (int c = 0; c < nd; c++) acc[g][c] = _mm512_fmadd_ps(pg, v[c], acc[g][c]);
                }
            }
        }
        for (int g = 0; g < G; g++) {
            const __m512 inv = _mm512_set1_ps(1.f / l[g]);
            uint16_t *o = out + ((size_t)b * H + (size_t)h * G + g) * D;
            for (int c = 0; c < nd; c++)
                _mm256_storeu_si256((__m256i *)(o + 16 * c), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][c], inv)));
        }
    }
}

int paged_decode_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                                const uint16_t *v_cache, const int64_t *tables, const int64_t *lens,
                                uint16_t *out, int B, int H, int KVH, int D, int NB, int BS, int max_blocks) {
    if (attention_check(lens, B, H, KVH, D, BS, max_blocks)) return -1;
#pragma omp parallel
    attention_items(q, q_stride, k_cache, v_cache, NULL, NULL, tables, lens, out, B, H, KVH, D, NB, BS, max_blocks, 0);
    return 0;
}

int paged_decode_attention_i8(const uint16_t *q, int64_t q_stride, const int8_t *k_cache, const int8_t *v_cache,
                              const float *k_scale, const float *v_scale, const int64_t *tables, const int64_t *lens,
                              uint16_t *out, int B, int H, int KVH, int D, int NB, int BS, int max_blocks) {
    if (attention_check(lens, B, H, KVH, D, BS, max_blocks)) return -1;
#pragma omp parallel
    attention_items(q, q_stride, k_cache, v_cache, k_scale, v_scale, tables, lens, out, B, H, KVH, D, NB, BS,
                    max_blocks, 1);
    return 0;
}

/* RMSNorm: out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, in float32, rounded to bf16 once (as PyTorch's
 * bf16 LayerNorm/RMSNorm on CPU). x: [T, N] with row stride x_stride; w, out: contiguous. */
static void rms_norm_rows(const uint16_t *x, int64_t x_stride, const uint16_t *w, uint16_t *out, int T, int N,
                          float eps) {
#pragma omp for
    for (int t = 0; t < T; t++) {
        const uint16_t *xr = x + (size_t)t * x_stride;
        uint16_t *o = out + (size_t)t * N;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < N; i++) {
            const float v = bf16_to_f32(xr[i]);
            ss += v * v;
        }
        const float r = 1.f / sqrtf(ss / (float)N + eps);
#pragma omp simd
        for (int i = 0; i < N; i++) o[i] = f32_to_bf16(bf16_to_f32(xr[i]) * r * bf16_to_f32(w[i]));
    }
}

void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, uint16_t *out, int T, int N, float eps) {
#pragma omp parallel if (T >= 64)
    rms_norm_rows(x, x_stride, w, out, T, N, eps);
}

/* RoPE on the Q and K heads of the fused QKV matmul output, and the new K/V into the cache, in one pass.
 * qkv: [T, (H + 2 KVH) * D] contiguous; Q heads are rotated in place, K heads rotated into the cache, V
 * heads copied into it. cos, sin: [T, D] for each row's position (rotate-half form, the sign of the first
 * half folded into sin: x' = x * cos + roll(x, D/2) * sin). Caches: [KVH, cache_tokens, D]; slots: [T].
 * Without caches (NULL: an int8 cache, written by kv_write_int8) the K heads are rotated in place.
 * Returns 0, or -1 (nothing written) when a slot is outside the cache. */
static int slots_check(const int64_t *slots, int T, int64_t cache_tokens) {
    for (int t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= cache_tokens) return -1;
    return 0;
}

static void rope_rows(uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, const int64_t *slots,
                      uint16_t *k_cache, uint16_t *v_cache, int T, int H, int KVH, int D, int64_t cache_tokens) {
    const int half = D / 2;
#pragma omp for
    for (int t = 0; t < T; t++) {
        uint16_t *row = qkv + (size_t)t * (H + 2 * KVH) * D;
        const uint16_t *c = cos + (size_t)t * D, *s = sin + (size_t)t * D;
        for (int head = 0; head < H + KVH; head++) {
            uint16_t *x = row + (size_t)head * D;
            uint16_t *dst = head < H || !k_cache ? x : k_cache + ((size_t)(head - H) * cache_tokens + (size_t)slots[t]) * D;
            float xf[MAXD];
            for (int i = 0; i < D; i++) xf[i] = bf16_to_f32(x[i]);
            for (int i = 0; i < D; i++) {
                const float rolled = xf[i < half ? i + half : i - half];
                dst[i] = f32_to_bf16(xf[i] * bf16_to_f32(c[i]) + rolled * bf16_to_f32(s[i]));
            }
        }
        for (int h = 0; h < KVH && v_cache; h++)
            memcpy(v_cache + ((size_t)h * cache_tokens + (size_t)slots[t]) * D, row + (size_t)(H + KVH + h) * D,
                   (size_t)D * sizeof(uint16_t));
    }
}

int rope_write_kv_bf16(uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, const int64_t *slots,
                       uint16_t *k_cache, uint16_t *v_cache, int T, int H, int KVH, int D, int64_t cache_tokens) {
    if (D % 2 || D > MAXD || (k_cache && slots_check(slots, T, cache_tokens))) return -1;
#pragma omp parallel if (T >= 64)
    rope_rows(qkv, cos, sin, slots, k_cache, v_cache, T, H, KVH, D, cache_tokens);
    return 0;
}

/* The int8 KV cache: [KVH, NB, BS, D] int8 with a float32 scale per (KV head, block), scales [KVH, NB];
 * an element is q * scale, |q| <= 127. kv_write_int8 quantises T new bf16 rows into it: row t of head h
 * at src + t * src_stride + h * D goes to slot slots[t]. The new rows of one block (a run of consecutive
 * t with the same block: a sequence's chunk) share one scale update: a run starting at offset 0 sets the
 * block's scale from the run's own absmax (whatever the block held before is stale), a later run raises
 * the scale to cover its rows when it must and re-rounds the block's earlier rows (offsets below the
 * run's first) to the new scale, so every element stays within half a step of the value written, plus
 * half a step per raise. Returns -1 (nothing written) when a slot is outside the cache. */
static void kv_write_rows(const uint16_t *src, int64_t src_stride, const int64_t *slots, int8_t *cache, float *scales,
                          int T, int KVH, int D, int NB, int BS) {
#pragma omp for
    for (int h = 0; h < KVH; h++) {
        for (int t = 0; t < T;) {
            const int64_t blk = slots[t] / BS;
            const int first = (int)(slots[t] % BS);
            int e = t + 1;
            while (e < T && slots[e] / BS == blk) e++;
            float amax = 0.f;
            for (int r = t; r < e; r++) {
                const uint16_t *x = src + (size_t)r * src_stride + (size_t)h * D;
                for (int i = 0; i < D; i++) {
                    const float a = fabsf(bf16_to_f32(x[i]));
                    amax = a > amax ? a : amax;
                }
            }
            float *sp = scales + (size_t)h * NB + blk;
            int8_t *base = cache + ((size_t)h * NB + (size_t)blk) * BS * D;
            const float old = first == 0 ? 0.f : *sp;
            const float need = amax / 127.f;
            const float s = need > old ? need : old;
            if (s > old && old > 0.f) {
                const float ratio = old / s;
                for (int i = 0; i < first * D; i++) base[i] = (int8_t)lrintf((float)base[i] * ratio);
            }
            *sp = s;
            const float inv = s > 0.f ? 1.f / s : 0.f;
            for (int r = t; r < e; r++) {
                const uint16_t *x = src + (size_t)r * src_stride + (size_t)h * D;
                int8_t *dst = base + (size_t)(slots[r] % BS) * D;
                for (int i = 0; i < D; i++) {
                    float v = rintf(bf16_to_f32(x[i]) * inv);
                    v = v > 127.f ? 127.f : (v < -127.f ? -127.f : v);
                    dst[i] = (int8_t)v;
                }
            }
            t = e;
        }
    }
}

int kv_write_int8(const uint16_t *src, int64_t src_stride, const int64_t *slots, int8_t *cache, float *scales, int T,
                  int KVH, int D, int NB, int BS) {
    if (slots_check(slots, T, (int64_t)NB * BS)) return -1;
#pragma omp parallel if (T * KVH >= 64)
    kv_write_rows(src, src_stride, slots, cache, scales, T, KVH, D, NB, BS);
    return 0;
}

/* SwiGLU activation: out[t] = silu(gate[t]) * up[t] for gate_up [T, 2 I] = [gate | up], in float32.
 * Returns -1 (nothing written) unless I is a multiple of 16. */
static void silu_rows(const uint16_t *gate_up, uint16_t *out, int T, int I) {
#pragma omp for
    for (int t = 0; t < T; t++) {
        const uint16_t *g = gate_up + (size_t)t * 2 * I, *u = g + I;
        uint16_t *o = out + (size_t)t * I;
        for (int i = 0; i < I; i += 16) {
            const __m512 gv = load_bf16x16(g + i);
            const __m512 sig = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(_mm512_set1_ps(1.f),
                                                                              exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
            const __m512 r = _mm512_mul_ps(_mm512_mul_ps(gv, sig), load_bf16x16(u + i));
            _mm256_storeu_si256((__m256i *)(o + i), (__m256i)_mm512_cvtneps_pbh(r));
        }
    }
}

int silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int T, int I) {
    if (I % 16) return -1;
#pragma omp parallel if (T >= 64)
    silu_rows(gate_up, out, T, I);
    return 0;
}

/* Greedy sampling: out[b] = the index of the first maximum of row b of x [B, V] float32 (the first NaN
 * if the row has one, as torch.argmax). */
void argmax_rows_f32(const float *x, int64_t *out, int B, int V) {
#pragma omp parallel for
    for (int b = 0; b < B; b++) {
        const float *row = x + (size_t)b * V;
        float m = row[0];
        int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
        for (int i = 0; i < V; i++) {
            m = row[i] > m ? row[i] : m;
            nan |= row[i] != row[i];
        }
        int64_t idx = 0;
        for (int i = 0; i < V; i++)
            if (nan ? row[i] != row[i] : row[i] == m) {
                idx = i;
                break;
            }
        out[b] = idx;
    }
}

/* Weight-only quantised linear layers: out[m, n] = sum_k x[m, k] * w[n, k] (+ residual[m, n]).
 *
 * w is stored quantised, row n in blocks of 32 along k: bits 4 -> 16 bytes per block (byte j holds element
 * j in its low nibble and element j + 16 in its high nibble, GGUF's Q4_0/Q4_1 layout), unsigned 0..15;
 * bits 8 -> 32 bytes q + 128 (offset binary: the unsigned operand of VPDPBUSD, see vnni_rows). Each group of `group` elements (a multiple of 32) has a scale and a minimum:
 * w = bf16(q * scale + min), the value the bf16 model would hold (q * d + m rounded once more to bf16, as
 * dequantising to float32 and then to bf16 does). The weights are dequantised in registers into a small
 * per-thread bf16 tile (NR rows) that stays in L1, then every MR x NR block of the output is a run of
 * VDPBF16PS (exact bf16 products, float32 sums): each weight byte is read from memory once per call,
 * whatever M. K need not be a multiple of 32: x's tail is loaded masked (zeros), the packed tail is zero. */
#define QNR 4
#define QMR 4

static inline void dequant_block(const uint8_t *src, int bits, __m512 scale, __m512 minv, uint16_t *dst) {
    __m512i lo, hi;
    if (bits == 4) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)src));
        lo = _mm512_and_si512(v, _mm512_set1_epi32(15));
        hi = _mm512_srli_epi32(v, 4);
    } else {
        lo = _mm512_cvtepi8_epi32(_mm_xor_si128(_mm_loadu_si128((const __m128i *)src), _mm_set1_epi8(-128)));
        hi = _mm512_cvtepi8_epi32(_mm_xor_si128(_mm_loadu_si128((const __m128i *)(src + 16)), _mm_set1_epi8(-128)));
    }
    /* mul then add, two roundings: the same float32 as numpy's q * d + m in the GGUF reader */
    const __m512 flo = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(lo), scale), minv);
    const __m512 fhi = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(hi), scale), minv);
    _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(fhi, flo));
}

/* Dequantise rows [n0, n0 + nr) into tile [nr][Kp] bf16. */
static void dequant_rows(const uint8_t *qw, const float *scale, const float *minv, int n0, int nr, int Kp, int bits,
                         int group, uint16_t *tile) {
    const int nblk = Kp / 32, bb = bits * 4, ngroups = (Kp + group - 1) / group;
    for (int r = 0; r < nr; r++) {
        const size_t n = (size_t)(n0 + r);
        const uint8_t *row = qw + n * (size_t)nblk * bb;
        for (int kb = 0; kb < nblk; kb++) {
            const int gi = kb * 32 / group;
            dequant_block(row + (size_t)kb * bb, bits, _mm512_set1_ps(scale[n * ngroups + gi]),
                          _mm512_set1_ps(minv[n * ngroups + gi]), tile + (size_t)r * Kp + (size_t)kb * 32);
        }
    }
}

/* For 1..QDIRECT rows the weights go straight from their bytes into the dot products, unscaled: an int4
 * block becomes the exact bf16 numbers 128 + q (q's nibble in the mantissa of 128.0: four instructions for
 * 32 weights), an int8 block the exact bf16 of q. Each group's float32 dot is then scaled once,
 * acc += d * dot, and the constant part, sum_g (m - 128 d) * sum(x over g), added at the end: the weights
 * enter as q * d + m without any bf16 rounding. */
#define QDIRECT 3

static inline __m512bh raw_block(const uint8_t *src, int bits) {
    if (bits == 4) {
        const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1); /* 0 | 4 */
        const __m512i b = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)src)));
        const __m512i v = _mm512_srlv_epi16(b, shift);
        return (__m512bh)_mm512_ternarylogic_epi32(v, _mm512_set1_epi16(0x000f), _mm512_set1_epi16(0x4300), 0xea);
    }
    const __m128i sign = _mm_set1_epi8(-128);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_xor_si128(_mm_loadu_si128((const __m128i *)src), sign)));
    const __m512 hi = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_xor_si128(_mm_loadu_si128((const __m128i *)(src + 16)), sign)));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* One tile of QNR output channels for M (a constant after inlining: accumulators stay in registers) rows. */
static inline __attribute__((always_inline)) void direct_tile(const uint16_t *x, int64_t x_stride, const uint8_t *qw,
                                                              const float *scale, int n0, int N, int nblk, int bb,
                                                              int ngroups, int per, __mmask32 tail, int bits,
                                                              const int M, float *res) {
    __m512 acc[QDIRECT][QNR], gacc[QDIRECT][QNR];
    size_t rows[QNR];
    for (int j = 0; j < QNR; j++) rows[j] = (size_t)(n0 + j < N ? n0 + j : N - 1); /* a short tile repeats its last row */
    for (int m = 0; m < M; m++)
        for (int j = 0; j < QNR; j++) acc[m][j] = gacc[m][j] = _mm512_setzero_ps();
    for (int kb = 0; kb < nblk; kb++) {
        const __mmask32 mask = kb + 1 == nblk ? tail : (__mmask32)0xffffffffu;
        __m512bh xv[QDIRECT];
        for (int m = 0; m < M; m++) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (size_t)m * x_stride + kb * 32);
        for (int j = 0; j < QNR; j++) {
            const __m512bh w = raw_block(qw + (rows[j] * nblk + kb) * bb, bits);
            for (int m = 0; m < M; m++) gacc[m][j] = _mm512_dpbf16_ps(gacc[m][j], xv[m], w);
        }
        if ((kb + 1) % per == 0 || kb + 1 == nblk) {
            const int g = kb / per;
            for (int j = 0; j < QNR; j++) {
                const __m512 d = _mm512_set1_ps(scale[rows[j] * ngroups + g]);
                for (int m = 0; m < M; m++) {
                    acc[m][j] = _mm512_fmadd_ps(gacc[m][j], d, acc[m][j]);
                    gacc[m][j] = _mm512_setzero_ps();
                }
            }
        }
    }
    for (int m = 0; m < M; m++)
        for (int j = 0; j < QNR; j++) res[m * QNR + j] = _mm512_reduce_add_ps(acc[m][j]);
}

/* One output element: float32 sum v (+ the residual), rounded to bf16 into out, or (out_f32) widened back
 * to float32 (the bf16 logits as float, in one pass). */
static inline void store_out(float v, const uint16_t *residual, int64_t res_stride, uint16_t *out, float *out_f32,
                             int m, int N, int n) {
    if (residual) v += bf16_to_f32(residual[(size_t)m * res_stride + n]);
    const uint16_t r = f32_to_bf16(v);
    if (out_f32)
        out_f32[(size_t)m * N + n] = bf16_to_f32(r);
    else
        out[(size_t)m * N + n] = r;
}

/* With AVX512-VNNI (chosen at run time: vnni = 1), 1..QDIRECT rows take integer dot products instead, as
 * llama.cpp's Q4_1 x Q8_1: each row of x is quantised once per call to int8 per block of 32 (dx = max|x| / 127,
 * q = round(x / dx)), and VPDPBUSD multiplies 64 weight bytes (unsigned: int4 nibbles as they are, int8 as
 * q + 128) with 64 int8 activations into 16 int32 lanes, 4 products each, exactly. No weight is unpacked to
 * float: per 64 weight bytes (128 int4 or 64 int8 weights) one and + one shift, two (int4) or one (int8)
 * VPDPBUSD, and a float epilogue per lane, acc += (dw * dx) * dot, dw * dx of 16 blocks formed once and spread
 * over each chunk's lanes by one permute. int4 enters centred, (q - 8) dw + (m + 8 dw) (half the activations'
 * error of q dw + m): the second part times the bf16 x's own sum per block, 16 blocks per vector, and both
 * offsets (int4: -8, int8: -128 times each lane's activations) as the int32 accumulator's start.
 * The activations' rounding (at most dx / 2 per element) is the only error beyond float32 summation.
 *
 * The quantised x of one row, in the order the weights are consumed: chunks of 64 weight bytes (VBPC blocks),
 * each 128 (int4: the blocks' elements 0..15, then 16..31, matching the low and the high nibbles) or 64 (int8)
 * activation bytes; dx: every block's dx, zero beyond the last (padded to 16 blocks); cor:
 * 16 int32 per chunk, -128 * the sum of the lane's 4 activations; sx: the bf16 sum of every block, zero
 * beyond the last (padded to 16 blocks). A partial last chunk is zero beyond its last block. */
#ifndef SERVELAB_SIMDE /* else SIMDe's VPDPBUSD: never called there (native.py: vnni needs the CPU's) */
#pragma GCC push_options
#pragma GCC target("avx512vnni")
#endif

#ifndef VPREFETCH
#define VPREFETCH 8192 /* bytes of weights prefetched ahead, rounded up to whole tiles */
#endif
#define VBPC(bits) ((bits) == 4 ? 4 : 2) /* blocks per 64 weight bytes */

typedef struct {
    int8_t *q;
    float *dx, *sx;
    int32_t *cor;
} xquant;

/* Bytes of one row's xquant: q and cor take at most U = ceil(nblk / 4) * 128 bytes each, dx and sx one
 * float per block rounded up to 16 (every part 64-byte aligned). */
static size_t xquant_span(int nblk) { return (size_t)(nblk + 3) / 4 * 128; }

static size_t xquant_bytes(int nblk) { return 2 * xquant_span(nblk) + 2 * ((size_t)(nblk + 15) / 16 * 64); }

static xquant xquant_at(uint8_t *base, int nblk) {
    const size_t u = xquant_span(nblk);
    xquant r;
    r.q = (int8_t *)base;
    r.cor = (int32_t *)(base + u);
    r.dx = (float *)(base + 2 * u);
    r.sx = r.dx + (nblk + 15) / 16 * 16;
    return r;
}

static void quantize_x_row(const uint16_t *x, int K, int nblk, int bits, xquant r) {
    const int bpc = VBPC(bits), nch = (nblk + bpc - 1) / bpc, cb = 64 * 8 / bits;
    memset(r.q, 0, (size_t)nch * cb);
    memset(r.dx, 0, (size_t)(nblk + 15) / 16 * 64);
    memset(r.sx, 0, (size_t)(nblk + 15) / 16 * 64);
    for (int b = 0; b < nblk; b++) {
        const int n = K - b * 32 < 32 ? K - b * 32 : 32;
        const __m512i raw = _mm512_maskz_loadu_epi16(n == 32 ? 0xffffffffu : (1u << n) - 1u, x + (size_t)b * 32);
        const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
        const __m512 hi =
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        const __m128i qlo = _mm512_cvtepi32_epi8(
            _mm512_cvt_roundps_epi32(_mm512_mul_ps(lo, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const __m128i qhi = _mm512_cvtepi32_epi8(
            _mm512_cvt_roundps_epi32(_mm512_mul_ps(hi, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const int c = b / bpc, i = b % bpc;
        int8_t *dst = r.q + (size_t)c * cb;
        _mm_storeu_si128((__m128i *)(dst + (bits == 4 ? i * 16 : i * 32)), qlo);
        _mm_storeu_si128((__m128i *)(dst + (bits == 4 ? 64 + i * 16 : i * 32 + 16)), qhi);
        r.dx[b] = amax / 127.f;
        r.sx[b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
    /* the weights' offset (int8: q + 128; int4: q - 8 is the centred value) times each lane's activations */
    const __m512i ones = _mm512_set1_epi8(1);
    for (int c = 0; c < nch; c++) {
        __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_load_si512(r.q + (size_t)c * cb));
        if (bits == 4) sum = _mm512_dpbusd_epi32(sum, ones, _mm512_load_si512(r.q + (size_t)c * cb + 64));
        _mm512_store_si512(r.cor + (size_t)c * 16, _mm512_sub_epi32(_mm512_setzero_si512(),
                                                                    _mm512_slli_epi32(sum, bits == 4 ? 3 : 7)));
    }
}

/* One tile of QNR output channels for M (a constant after inlining) rows, into res[m * QNR + j]. Weights:
 * row n at qw + n * nblk * bb; per-block scales and minimums (group 32: ngroups = nblk) or one per row
 * (ngroups = 1). */
static inline __attribute__((always_inline)) void vnni_tile(const uint8_t *qw, const float *scale, const float *minv,
                                                            int n0, int N, int nblk, int ngroups, int bits,
                                                            const xquant *xs, const int M, float *res) {
    const int bb = bits * 4, bpc = VBPC(bits), nch = (nblk + bpc - 1) / bpc, cb = 64 * 8 / bits;
    const __m512i nib = _mm512_set1_epi8(15);
    /* lane i of chunk c takes the scale of block (c % (16 / bpc)) * bpc + i / (16 / bpc) of its 16 */
    const __m512i lane_blk = _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               bits == 4 ? 2 : 3);
    const size_t tile_bytes = (size_t)QNR * nblk * bb, ahead = (VPREFETCH + tile_bytes - 1) / tile_bytes * tile_bytes;
    __m512 acc[QDIRECT][QNR], dwdx[QDIRECT][QNR]; /* dwdx: the 16 blocks' dw * dx, block order */
    const uint8_t *rows[QNR];
    size_t srow[QNR];
    for (int j = 0; j < QNR; j++) {
        const size_t n = (size_t)(n0 + j < N ? n0 + j : N - 1); /* a short tile repeats its last row */
        rows[j] = qw + n * (size_t)nblk * bb;
        srow[j] = n * (size_t)ngroups;
        for (int m = 0; m < M; m++) acc[m][j] = dwdx[m][j] = _mm512_setzero_ps();
    }
    for (int c = 0; c < nch; c++) {
        const int sc = c * bpc / 16, first = c * bpc, cis = c % (16 / bpc); /* its 16 blocks, its place in them */
        if (cis == 0) { /* 16 blocks' scales times dx (and int4 minimums times the blocks' sums of x) per row */
            const int nb = nblk - sc * 16 < 16 ? nblk - sc * 16 : 16;
            const __mmask16 bm = (__mmask16)((1u << nb) - 1u);
            for (int j = 0; j < QNR; j++) {
                const __m512 dw =
                    ngroups == 1 ? _mm512_set1_ps(scale[srow[j]]) : _mm512_maskz_loadu_ps(bm, scale + srow[j] + sc * 16);
                for (int m = 0; m < M; m++) dwdx[m][j] = _mm512_mul_ps(dw, _mm512_load_ps(xs[m].dx + sc * 16));
                if (bits == 4) { /* w = (q - 8) d + (m + 8 d) */
                    const __m512 mn = _mm512_fmadd_ps(dw, _mm512_set1_ps(8.f),
                                                      ngroups == 1 ? _mm512_set1_ps(minv[srow[j]])
                                                                   : _mm512_maskz_loadu_ps(bm, minv + srow[j] + sc * 16));
                    for (int m = 0; m < M; m++) acc[m][j] = _mm512_fmadd_ps(mn, _mm512_loadu_ps(xs[m].sx + sc * 16), acc[m][j]);
                }
            }
        }
        const int nbc = nblk - first < bpc ? nblk - first : bpc; /* blocks in this chunk */
        const __mmask64 wm = nbc == bpc ? ~(__mmask64)0 : (((__mmask64)1 << (nbc * bb)) - 1);
        const __m512i idx = _mm512_add_epi32(lane_blk, _mm512_set1_epi32(cis * bpc));
        for (int j = 0; j < QNR; j++) {
            /* the same bytes ahead_tiles tiles on (the weights stream from memory: the hardware prefetcher,
             * given QNR interleaved row streams, leaves most of the loads waiting) */
            _mm_prefetch((const char *)rows[j] + (size_t)c * 64 + ahead, _MM_HINT_T0);
            const __m512i w = _mm512_maskz_loadu_epi8(wm, rows[j] + (size_t)c * 64);
            for (int m = 0; m < M; m++) {
                const int8_t *xq = xs[m].q + (size_t)c * cb;
                __m512i dot = _mm512_load_si512(xs[m].cor + (size_t)c * 16);
                if (bits == 4) {
                    dot = _mm512_dpbusd_epi32(dot, _mm512_and_si512(w, nib), _mm512_load_si512(xq));
                    dot = _mm512_dpbusd_epi32(dot, _mm512_and_si512(_mm512_srli_epi16(w, 4), nib),
                                              _mm512_load_si512(xq + 64));
                } else {
                    dot = _mm512_dpbusd_epi32(dot, w, _mm512_load_si512(xq));
                }
                acc[m][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(idx, dwdx[m][j]), acc[m][j]);
            }
        }
    }
    for (int m = 0; m < M; m++)
        for (int j = 0; j < QNR; j++) res[m * QNR + j] = _mm512_reduce_add_ps(acc[m][j]);
}

/* vnni_tile over the calling parallel region's threads; scratch: xquant_bytes(nblk) per row of x, 64-byte
 * aligned, written by each thread for itself (the same bytes: quantising x costs less than a barrier). */
static void vnni_rows(const uint16_t *x, int64_t x_stride, const uint8_t *qw, const float *scale, const float *minv,
                      const uint16_t *residual, int64_t res_stride, uint16_t *out, float *out_f32, int M, int N, int K,
                      int bits, int ngroups) {
    const int nblk = (K + 31) / 32, ntiles = (N + QNR - 1) / QNR;
    uint8_t *scratch = aligned_alloc(64, (size_t)M * xquant_bytes(nblk));
    xquant xs[QDIRECT];
    for (int m = 0; m < M; m++) {
        xs[m] = xquant_at(scratch + (size_t)m * xquant_bytes(nblk), nblk);
        quantize_x_row(x + (size_t)m * x_stride, K, nblk, bits, xs[m]);
    }
#pragma omp for schedule(static)
    for (int t = 0; t < ntiles; t++) {
        const int n0 = t * QNR, nr = N - n0 < QNR ? N - n0 : QNR;
        float res[QDIRECT * QNR];
        if (M == 1)
            vnni_tile(qw, scale, minv, n0, N, nblk, ngroups, bits, xs, 1, res);
        else if (M == 2)
            vnni_tile(qw, scale, minv, n0, N, nblk, ngroups, bits, xs, 2, res);
        else
            vnni_tile(qw, scale, minv, n0, N, nblk, ngroups, bits, xs, 3, res);
        for (int j = 0; j < nr; j++)
            for (int m = 0; m < M; m++) store_out(res[m * QNR + j], residual, res_stride, out, out_f32, m, N, n0 + j);
    }
    free(scratch);
}
#ifndef SERVELAB_SIMDE
#pragma GCC pop_options
#endif

/* The work of qlinear_bf16 (arguments checked), shared out over the calling parallel region's threads. The
 * residual may be the output itself (in place: each element is read, then written, by the same thread). */
static void qlinear_rows(const uint16_t *x, int64_t x_stride, const uint8_t *qw, const float *scale,
                         const float *minv, const uint16_t *residual, int64_t res_stride, uint16_t *out,
                         float *out_f32, int M, int N, int K, int bits, int group, int vnni) {
    const int Kp = (K + 31) / 32 * 32, nblk = Kp / 32, bb = bits * 4, ngroups = (Kp + group - 1) / group;
    const int ntiles = (N + QNR - 1) / QNR;
    const __mmask32 tail = K % 32 ? (__mmask32)((1u << (K % 32)) - 1u) : (__mmask32)0xffffffffu;
    if (M <= QDIRECT && vnni && (group == 32 || ngroups == 1)) {
        vnni_rows(x, x_stride, qw, scale, minv, residual, res_stride, out, out_f32, M, N, K, bits, ngroups);
        return;
    }
    if (M <= QDIRECT) {
        const int per = group / 32;
        float sx[QDIRECT * ngroups]; /* sum of x over each group (every thread its own) */
        for (int m = 0; m < M; m++)
            for (int g = 0; g < ngroups; g++) {
                float t = 0.f;
                for (int k = g * group; k < K && k < (g + 1) * group; k++) t += bf16_to_f32(x[(size_t)m * x_stride + k]);
                sx[m * ngroups + g] = t;
            }
        const float bias = bits == 4 ? 128.f : 0.f;
#pragma omp for schedule(static)
        for (int t = 0; t < ntiles; t++) {
            const int n0 = t * QNR, nr = N - n0 < QNR ? N - n0 : QNR;
            float res[QDIRECT * QNR];
            if (M == 1)
                direct_tile(x, x_stride, qw, scale, n0, N, nblk, bb, ngroups, per, tail, bits, 1, res);
            else if (M == 2)
                direct_tile(x, x_stride, qw, scale, n0, N, nblk, bb, ngroups, per, tail, bits, 2, res);
            else
                direct_tile(x, x_stride, qw, scale, n0, N, nblk, bb, ngroups, per, tail, bits, 3, res);
            for (int j = 0; j < nr; j++) {
                const size_t n = (size_t)(n0 + j);
                for (int m = 0; m < M; m++) {
                    float v = res[m * QNR + j];
                    if (bits == 4) /* int8 weights are symmetric: minimum and bias zero, the term adds nothing */
                        for (int g = 0; g < ngroups; g++)
                            v += (minv[n * ngroups + g] - bias * scale[n * ngroups + g]) * sx[m * ngroups + g];
                    store_out(v, residual, res_stride, out, out_f32, m, N, (int)n);
                }
            }
        }
        return;
    }
    uint16_t *tile = aligned_alloc(64, (size_t)QNR * Kp * sizeof(uint16_t));
#pragma omp for schedule(static)
    for (int t = 0; t < ntiles; t++) {
        const int n0 = t * QNR, nr = N - n0 < QNR ? N - n0 : QNR;
        dequant_rows(qw, scale, minv, n0, nr, Kp, bits, group, tile);
        for (int r = nr; r < QNR; r++) memset(tile + (size_t)r * Kp, 0, (size_t)Kp * sizeof(uint16_t));
        for (int m0 = 0; m0 < M; m0 += QMR) {
            const int mr = M - m0 < QMR ? M - m0 : QMR;
            __m512 acc[QMR * QNR];
            for (int i = 0; i < QMR * QNR; i++) acc[i] = _mm512_setzero_ps();
            for (int k = 0; k < Kp; k += 32) {
                const __mmask32 mask = k + 32 > K ? tail : (__mmask32)0xffffffffu;
                __m512bh w[QNR];
                for (int j = 0; j < QNR; j++) w[j] = (__m512bh)_mm512_loadu_si512(tile + (size_t)j * Kp + k);
                for (int i = 0; i < QMR; i++) {
                    if (i >= mr) break;
                    const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (size_t)(m0 + i) * x_stride + k);
                    for (int j = 0; j < QNR; j++) acc[i * QNR + j] = _mm512_dpbf16_ps(acc[i * QNR + j], xv, w[j]);
                }
            }
            float res[QMR * QNR];
            _mm512_storeu_ps(res, sum16(acc)); /* lane i * QNR + j = out[m0 + i, n0 + j] */
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < nr; j++)
                    store_out(res[i * QNR + j], residual, res_stride, out, out_f32, m0 + i, N, n0 + j);
        }
    }
    free(tile);
}

/* Whether this CPU has AVX512-VNNI: the integer path's own condition (the caller may also turn it off). */
static int cpu_vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni");
}

static int qlinear_check(int M, int N, int K, int bits, int group) {
    return (bits != 4 && bits != 8) || group < 32 || group % 32 || M < 0 || N < 1 || K < 1 ? -1 : 0;
}

/* x: [M, K] bf16, row stride x_stride; residual: NULL or [M, N] bf16 with row stride res_stride; out: [M, N]
 * contiguous. qw: [N, ceil(K / 32) * bits * 4] bytes; scale, minv: [N, ceil(Kp / group)] float32.
 * Returns 0, or -1 for an unsupported layout (nothing written). */
int qlinear_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *qw, const float *scale, const float *minv,
                 const uint16_t *residual, int64_t res_stride, uint16_t *out, int M, int N, int K, int bits, int group,
                 int vnni) {
    if (qlinear_check(M, N, K, bits, group)) return -1;
#pragma omp parallel
    qlinear_rows(x, x_stride, qw, scale, minv, residual, res_stride, out, NULL, M, N, K, bits, group, vnni && cpu_vnni());
    return 0;
}

/* QDIRECT, for the Python side (tests: which rows take the integer path). */
int qlinear_direct_rows(void) { return QDIRECT; }

/* The bf16 weight [N, K] contiguous that qlinear_bf16 computes with (for many rows: a bf16 matmul on it). */
int qdequant_bf16(const uint8_t *qw, const float *scale, const float *minv, uint16_t *out, int N, int K, int bits,
                  int group) {
    if ((bits != 4 && bits != 8) || group < 32 || group % 32 || N < 1 || K < 1) return -1;
    const int Kp = (K + 31) / 32 * 32;
#pragma omp parallel
    {
        uint16_t *row = aligned_alloc(64, (size_t)Kp * sizeof(uint16_t));
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            dequant_rows(qw, scale, minv, n, 1, Kp, bits, group, row);
            memcpy(out + (size_t)n * K, row, (size_t)K * sizeof(uint16_t));
        }
        free(row);
    }
    return 0;
}

/* The whole decode step of a Llama model with quantised linears, in one call and one parallel region: B
 * sequences with one new token each through the first n_layers layers, then the final norm and the head.
 * Each op is the very kernel the per-op entry points above run (same arithmetic, same roundings), shared out
 * over the region's threads with a barrier between ops; what this saves is the Python and dispatch work
 * around ~10 small calls per layer and the start of a parallel region for each. */
typedef struct {
    const uint8_t *qw;
    const float *scale, *minv;
    int32_t n, k, bits, group;
} qmat;

typedef struct {
    const uint16_t *attn_norm, *ffn_norm;
    qmat qkv, o, gate_up, down;
    void *k_cache, *v_cache;  /* [KVH, NB, BS, D] bf16, or int8 with the scales below */
    float *k_scale, *v_scale; /* [KVH, NB] float32 for an int8 cache, else NULL */
} qlayer;

typedef struct {
    int32_t n_layers, hidden, inter, n_heads, n_kv_heads, head_dim, vocab, num_blocks, block_size;
    int32_t vnni; /* 1: the integer dot products for 1..QDIRECT rows where the CPU has them (qlinear_bf16) */
    float eps;
    int64_t rope_len;                               /* positions in the rope tables */
    const uint16_t *embed, *rope_cos, *rope_sin, *norm; /* [vocab, hidden], [rope_len, D] x 2, [hidden] */
    qmat head;
    const qlayer *layers;
} qmodel;

static void qmat_rows(const qmat *w, const uint16_t *x, int64_t x_stride, const uint16_t *residual, int64_t res_stride,
                      uint16_t *out, float *out_f32, int M, int vnni) {
    qlinear_rows(x, x_stride, w->qw, w->scale, w->minv, residual, res_stride, out, out_f32, M, w->n, w->k, w->bits,
                 w->group, vnni);
}

/* ids, pos, slots, lens: [B]; tables: [B, max_blocks] (as paged_decode_attention); logits: [B, vocab] float32,
 * the head's bf16 outputs widened. Returns 0, or -1 (nothing computed) for shapes or indices out of range. */
int decode_forward(const qmodel *m, const int64_t *ids, const int64_t *pos, const int64_t *slots,
                   const int64_t *tables, const int64_t *lens, int B, int max_blocks, int n_layers, float *logits) {
    const int H = m->n_heads, KVH = m->n_kv_heads, D = m->head_dim, hid = m->hidden, I = m->inter;
    const int qkv_w = (H + 2 * KVH) * D, vnni = m->vnni && cpu_vnni();
    const int64_t cache_tokens = (int64_t)m->num_blocks * m->block_size;
    if (B < 1 || n_layers < 0 || n_layers > m->n_layers || I % 16 || D % 2 || D > MAXD
        || attention_check(lens, B, H, KVH, D, m->block_size, max_blocks) || slots_check(slots, B, cache_tokens)
        || qlinear_check(B, m->head.n, m->head.k, m->head.bits, m->head.group))
        return -1;
    for (int b = 0; b < B; b++)
        if (ids[b] < 0 || ids[b] >= m->vocab || pos[b] < 0 || pos[b] >= m->rope_len) return -1;
    for (int l = 0; l < n_layers; l++) {
        const qlayer *L = &m->layers[l];
        const qmat *ws[4] = {&L->qkv, &L->o, &L->gate_up, &L->down};
        for (int i = 0; i < 4; i++)
            if (qlinear_check(B, ws[i]->n, ws[i]->k, ws[i]->bits, ws[i]->group)) return -1;
    }
    /* x, the normed x, qkv, attention out, gate|up, silu(gate) * up; cos, sin */
    const size_t n_act = (size_t)B * (2 * hid + qkv_w + H * D + 3 * I + 2 * D);
    uint16_t *buf = malloc(n_act * sizeof(uint16_t));
    if (!buf) return -1;
    uint16_t *x = buf, *h = x + (size_t)B * hid, *qkv = h + (size_t)B * hid, *att = qkv + (size_t)B * qkv_w;
    uint16_t *gu = att + (size_t)B * H * D, *act = gu + (size_t)B * 2 * I, *cs = act + (size_t)B * I;
    uint16_t *sn = cs + (size_t)B * D;
    for (int b = 0; b < B; b++) {
        memcpy(x + (size_t)b * hid, m->embed + (size_t)ids[b] * hid, (size_t)hid * sizeof(uint16_t));
        memcpy(cs + (size_t)b * D, m->rope_cos + (size_t)pos[b] * D, (size_t)D * sizeof(uint16_t));
        memcpy(sn + (size_t)b * D, m->rope_sin + (size_t)pos[b] * D, (size_t)D * sizeof(uint16_t));
    }
#pragma omp parallel
    {
        for (int l = 0; l < n_layers; l++) {
            const qlayer *L = &m->layers[l];
            rms_norm_rows(x, hid, L->attn_norm, h, B, hid, m->eps);
            qmat_rows(&L->qkv, h, hid, NULL, 0, qkv, NULL, B, vnni);
            if (L->k_scale) { /* int8 cache: Q and K rotated in place, then K and V quantised into it */
                rope_rows(qkv, cs, sn, slots, NULL, NULL, B, H, KVH, D, cache_tokens);
                kv_write_rows(qkv + (size_t)H * D, qkv_w, slots, L->k_cache, L->k_scale, B, KVH, D, m->num_blocks,
                              m->block_size);
                kv_write_rows(qkv + (size_t)(H + KVH) * D, qkv_w, slots, L->v_cache, L->v_scale, B, KVH, D,
                              m->num_blocks, m->block_size);
                attention_items(qkv, qkv_w, L->k_cache, L->v_cache, L->k_scale, L->v_scale, tables, lens, att, B, H,
                                KVH, D, m->num_blocks, m->block_size, max_blocks, 1);
            } else {
                rope_rows(qkv, cs, sn, slots, L->k_cache, L->v_cache, B, H, KVH, D, cache_tokens);
                attention_items(qkv, qkv_w, L->k_cache, L->v_cache, NULL, NULL, tables, lens, att, B, H, KVH, D,
                                m->num_blocks, m->block_size, max_blocks, 0);
            }
            qmat_rows(&L->o, att, (int64_t)H * D, x, hid, x, NULL, B, vnni);
            rms_norm_rows(x, hid, L->ffn_norm, h, B, hid, m->eps);
            qmat_rows(&L->gate_up, h, hid, NULL, 0, gu, NULL, B, vnni);
            silu_rows(gu, act, B, I);
            qmat_rows(&L->down, act, I, x, hid, x, NULL, B, vnni);
        }
        rms_norm_rows(x, hid, m->norm, h, B, hid, m->eps);
        qmat_rows(&m->head, h, hid, NULL, 0, NULL, logits, B, vnni);
    }
    free(buf);
    return 0;
}
