/* The AVX-512 intrinsics cpu_kernels.c uses that SIMDe 0.7.4 (Debian 12's libsimde-dev) leaves out or gets
 * wrong (its _mm512_roundscale_ps rounded -1.5 down to -1.5 and 2.7 to 2.5), for the
 * build on a CPU without AVX-512 (-DSERVELAB_SIMDE). Each follows Intel's definition lane by lane, with GCC
 * vector extensions (SIMDe's __m512 types are GCC vectors here), so that the kernels compute what they
 * compute on AVX-512 hardware: bf16 conversion rounds to nearest even, flushes denormal inputs to zero and
 * keeps NaNs quiet (VCVTNEPS2BF16); masked loads read only the lanes their mask selects. */
#include <math.h>
#include <stdint.h>

typedef float sx_f32x16 __attribute__((vector_size(64)));
typedef int32_t sx_i32x16 __attribute__((vector_size(64)));
typedef int8_t sx_i8x16 __attribute__((vector_size(16)));
typedef uint8_t sx_u8x16 __attribute__((vector_size(16)));
typedef uint8_t sx_u8x32 __attribute__((vector_size(32)));
typedef uint16_t sx_u16x16 __attribute__((vector_size(32)));
typedef uint16_t sx_u16x32 __attribute__((vector_size(64)));

#define _mm512_shuffle_f32x4 simde_mm512_shuffle_f32x4 /* in SIMDe, without its alias */
#define _mm512_cvtepi32_ps(a) ((__m512)__builtin_convertvector((sx_i32x16)(a), sx_f32x16))
#define _mm512_cvtepi8_epi32(a) ((__m512i)__builtin_convertvector((sx_i8x16)(a), sx_i32x16))
#define _mm512_cvtepu8_epi32(a) ((__m512i)__builtin_convertvector((sx_u8x16)(a), sx_i32x16))
#define _mm512_cvtepu8_epi16(a) ((__m512i)__builtin_convertvector((sx_u8x32)(a), sx_u16x32))
#define _mm512_cvtepu16_epi32(a) ((__m512i)__builtin_convertvector((sx_u16x16)(a), sx_i32x16))
#define _mm512_cvtepi32_epi8(a) ((__m128i)__builtin_convertvector((sx_i32x16)(a), sx_i8x16)) /* truncates */
#define _mm512_cvtss_f32(a) (((sx_f32x16)(a))[0])
#define _mm512_cvt_roundps_epi32(a, rounding) _mm512_cvtps_epi32(a) /* called with round-to-nearest only */

#undef _mm512_roundscale_ps
#define _mm512_roundscale_ps(a, imm) sx_roundscale_ps(a, imm)
static inline __m512 sx_roundscale_ps(__m512 a, int imm) { /* scale 0 (imm's high nibble) only, as used */
    sx_f32x16 v = (sx_f32x16)a;
    for (int i = 0; i < 16; i++)
        v[i] = (imm & 4) ? nearbyintf(v[i]) : (imm & 3) == 1 ? floorf(v[i]) : (imm & 3) == 2 ? ceilf(v[i])
             : (imm & 3) == 3 ? truncf(v[i]) : nearbyintf(v[i]);
    return (__m512)v;
}

static inline __m512i _mm512_cvtps_epi32(__m512 a) { /* round to nearest even; out of range -> INT32_MIN */
    const sx_f32x16 v = (sx_f32x16)a;
    sx_i32x16 r;
    for (int i = 0; i < 16; i++) r[i] = (v[i] >= -2147483648.0f && v[i] < 2147483648.0f) ? (int32_t)nearbyintf(v[i]) : INT32_MIN;
    return (__m512i)r;
}

static inline uint16_t sx_bf16(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return (uint16_t)((u >> 16) | 0x40); /* NaN */
    if ((u & 0x7f800000u) == 0) return (uint16_t)((u >> 16) & 0x8000); /* denormal (or zero): signed zero */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline __m256bh _mm512_cvtneps_pbh(__m512 a) {
    const sx_f32x16 v = (sx_f32x16)a;
    sx_u16x16 r;
    for (int i = 0; i < 16; i++) r[i] = sx_bf16(v[i]);
    return (__m256bh)r;
}

static inline __m512bh _mm512_cvtne2ps_pbh(__m512 a, __m512 b) { /* lanes 0-15 from b, 16-31 from a */
    const sx_f32x16 va = (sx_f32x16)a, vb = (sx_f32x16)b;
    sx_u16x32 r;
    for (int i = 0; i < 16; i++) r[i] = sx_bf16(vb[i]), r[i + 16] = sx_bf16(va[i]);
    return (__m512bh)r;
}

static inline float _mm512_reduce_add_ps(__m512 a) { /* halves added pairwise, as GCC's own definition */
    float v[16];
    __builtin_memcpy(v, &a, 64);
    for (int w = 8; w > 0; w /= 2)
        for (int i = 0; i < w; i++) v[i] += v[i + w];
    return v[0];
}

static inline float _mm512_mask_reduce_max_ps(__mmask16 k, __m512 a) {
    const sx_f32x16 v = (sx_f32x16)a;
    float m = -INFINITY;
    for (int i = 0; i < 16; i++)
        if (((k >> i) & 1) && v[i] > m) m = v[i];
    return m;
}
#define _mm512_reduce_max_ps(a) _mm512_mask_reduce_max_ps(0xffff, a)

#define SX_MASKZ_LOAD(name, mask_t, elem_t, n)                                                                  \
    static inline __m512i name(mask_t k, const void *p) {                                                    \
        elem_t r[n];                                                                                          \
        for (int i = 0; i < n; i++) r[i] = ((k >> i) & 1) ? ((const elem_t *)p)[i] : 0;                     \
        __m512i out;                                                                                          \
        __builtin_memcpy(&out, r, 64);                                                                        \
        return out;                                                                                           \
    }
SX_MASKZ_LOAD(_mm512_maskz_loadu_epi8, __mmask64, uint8_t, 64)
SX_MASKZ_LOAD(_mm512_maskz_loadu_epi16, __mmask32, uint16_t, 32)
SX_MASKZ_LOAD(sx_maskz_loadu_epi32, __mmask16, uint32_t, 16)
#define _mm512_maskz_loadu_ps(k, p) ((__m512)sx_maskz_loadu_epi32(k, p))
