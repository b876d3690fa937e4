/* exp and SiLU in plain arithmetic, so that GCC vectorises the loops that call them: glibc's expf
 * is a scalar call that the compiler vectorises only under -ffast-math, which would also reorder
 * every sum in the kernels. Cephes' single-precision exp (Cody-Waite reduction, degree-6
 * polynomial): within 2 ulp of expf over [-87, 88], to which the argument is clamped.
 */
#ifndef HYBRIDSERVE_VECTOR_MATH_H
#define HYBRIDSERVE_VECTOR_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float exp_f32(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    /* round(x / ln 2) by the 1.5 * 2^23 trick (floorf and fminf vectorise only under fast-math) */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline float silu_f32(float x) { return x / (1.0f + exp_f32(-x)); }

typedef float lanes16_unaligned __attribute__((vector_size(64), aligned(4), may_alias));

/* The sum of x[i]^2 (the norms' reduction): 16 lanes, halved pairwise, then the tail in order.
 * The plain loop is one chain of n dependent adds that GCC keeps in order without -ffast-math,
 * each waiting for the one before; 16 independent lanes break the chain (docs/cpu-kernels.md). */
static inline float sum_of_squares(const float *x, int64_t n) {
    typedef float lanes16 __attribute__((vector_size(64)));
    lanes16 acc = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        lanes16 v = *(const lanes16_unaligned *)(x + i);
        acc += v * v;
    }
    float lanes[16];
    memcpy(lanes, &acc, sizeof lanes);
    for (int width = 8; width > 0; width /= 2)
        for (int k = 0; k < width; k++) lanes[k] += lanes[k + width];
    float sum = lanes[0];
    for (; i < n; i++) sum += x[i] * x[i];
    return sum;
}

/* Flush-to-zero and denormals-are-zero for the calling thread while a kernel runs. GCC
 * if-converts the clamps of exp_f32, so a vectorised SiLU also computes the clamped branch
 * (x / (1 + e^88)) in every lane, and those tiny quotients are denormals: each vector of them took
 * a microcode assist, 5.0 instead of 0.32 ns per element on the Intel host. Only results below
 * 1.2e-38 change (to zero). Each thread of a parallel region sets its own, and restores it. */
#if defined(__SSE__)
#include <xmmintrin.h>
#define DENORMALS_FLUSH_BITS 0x8040u /* FTZ | DAZ */
static inline unsigned int denormals_flush_begin(void) {
    unsigned int saved = _mm_getcsr();
    _mm_setcsr(saved | DENORMALS_FLUSH_BITS);
    return saved;
}
static inline void denormals_flush_end(unsigned int saved) { _mm_setcsr(saved); }
#else
static inline unsigned int denormals_flush_begin(void) { return 0; }
static inline void denormals_flush_end(unsigned int saved) { (void)saved; }
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
/* exp_f32 on 16 lanes: the same clamps, reduction and polynomial. */
static inline __m512 exp16_ps(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(12582912.0f)),
                             _mm512_set1_ps(12582912.0f));
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* [sum(a), sum(b), sum(c), sum(d)]: pairwise shuffles, a few operations for the four sums of a
 * register tile of dot products. */
static inline __m128 sums4_ps(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
    __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
    return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}
#endif

/* bfloat16 <-> float32 as torch converts: widening is exact; narrowing rounds to nearest even and
 * keeps NaN a NaN. */
static inline float bf16_to_f32(uint16_t value) {
    uint32_t bits = (uint32_t)value << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

#endif
