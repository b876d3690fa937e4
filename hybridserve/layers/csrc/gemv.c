/* y = x @ W.T for up to 32 float32 rows of x (CPU decode), W float32, int8 or bfloat16.
 *
 * A batch-1 decode step is a stream of every weight, so the GEMV must read memory as fast as a plain
 * sum does, and interleaved streams (the usual register blocking over weight rows) read slower. So
 * each thread reads one weight row after the other, a single sequential stream, and gets its
 * instruction parallelism along the row (four accumulators for one input row, one per input row
 * otherwise). Each weight row is read from memory once and, while it sits in L1, dotted with every
 * input row in groups of GEMV_GROUP, so 8 rows cost well under 8x one row. Blocks of GEMV_BLOCK_ROWS
 * output features run on the task pool (task_pool.h), so a worker that wakes late takes fewer blocks.
 * With AVX-512's 32 registers, weight rows are paired for whole groups of 8 input rows
 * (dot_rows_pair; with AVX2's 16 registers its accumulators would spill), and a pair's 16 sums are
 * reduced in one shuffle tree (lane_sums16, bit-identical to summing one by one).
 */
#include <stdint.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "hybridserve_kernels.h"
#include "task_pool.h"

#define GEMV_MAX_INPUT_ROWS 32
#define GEMV_GROUP 8
#define GEMV_PREFETCH_BYTES 4096  /* how far ahead in the weight row stream to prefetch */
#define GEMV_BLOCK_ROWS 64  /* output features handed to a thread at a time */

/* The widest float vector the target has: 16 lanes with AVX-512, else 8. */
#if defined(__AVX512F__)
#define GEMV_LANES 16
#else
#define GEMV_LANES 8
#endif
typedef float vecf __attribute__((vector_size(GEMV_LANES * 4)));
typedef int8_t vec_i8 __attribute__((vector_size(GEMV_LANES)));

static inline vecf load_f32(const float *p) {
    vecf v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

/* GEMV_LANES int8 weights widened to float32 (GCC scalarises __builtin_convertvector here, hence
 * the intrinsics where available). */
static inline vecf load_i8(const int8_t *p) {
    vecf v;
#if defined(__AVX512F__)
    __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    __builtin_memcpy(&v, &f, sizeof v);
#elif defined(__AVX2__)
    __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    __builtin_memcpy(&v, &f, sizeof v);
#else
    vec_i8 q;
    __builtin_memcpy(&q, p, sizeof q);
    v = __builtin_convertvector(q, vecf);
#endif
    return v;
}

/* GEMV_LANES bfloat16 weights widened to float32 (exact: the bits move to the high half). */
static inline vecf load_bf16(const uint16_t *p) {
    vecf v;
#if defined(__AVX512F__)
    __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
    __builtin_memcpy(&v, &wide, sizeof v);
#elif defined(__AVX2__)
    __m256i wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    __builtin_memcpy(&v, &wide, sizeof v);
#else
    for (int k = 0; k < GEMV_LANES; k++) {
        uint32_t bits = (uint32_t)p[k] << 16;
        __builtin_memcpy(&v[k], &bits, sizeof bits);
    }
#endif
    return v;
}

static inline __attribute__((always_inline)) int64_t weight_bytes(int format) {
    return format == WEIGHT_F32 ? 4 : format == WEIGHT_I8 ? 1 : 2;
}

/* Weights i..i+GEMV_LANES-1 of a row in `format`, a constant at every call site, so the branches
 * fold away. */
static inline __attribute__((always_inline)) vecf load_weights(const void *w, int64_t i, int format) {
    if (format == WEIGHT_I8) return load_i8((const int8_t *)w + i);
    if (format == WEIGHT_BF16) return load_bf16((const uint16_t *)w + i);
    return load_f32((const float *)w + i);
}

static inline __attribute__((always_inline)) float weight_at(const void *w, int64_t i, int format) {
    if (format == WEIGHT_I8) return (float)((const int8_t *)w)[i];
    if (format == WEIGHT_BF16) {
        uint32_t bits = (uint32_t)((const uint16_t *)w)[i] << 16;
        float f;
        __builtin_memcpy(&f, &bits, sizeof f);
        return f;
    }
    return ((const float *)w)[i];
}

typedef float vec8f __attribute__((vector_size(32)));
typedef float vec4f __attribute__((vector_size(16)));

/* The lanes of v summed as a tree of halves: a few shuffles and adds, where a lane-by-lane sum is
 * a chain of GEMV_LANES dependent adds per output (as long as the dot product itself at 16 rows). */
static inline float lane_sum(vecf v) {
#if GEMV_LANES == 16
    vec8f eight = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    vec8f eight = v;
#endif
    vec4f four = __builtin_shufflevector(eight, eight, 0, 1, 2, 3) + __builtin_shufflevector(eight, eight, 4, 5, 6, 7);
    return (four[0] + four[2]) + (four[1] + four[3]);
}

/* out[r * ld_out] = dot(w, x + r * ld_x) (times `scale` for int8) for r < rows (<= GEMV_GROUP);
 * `rows` and `format` are constants at each call site, so the loops over r unroll and the
 * accumulators live in registers. The weight stream gets a plain software prefetch (into L1) once
 * per cache line: each of the model's many matrices is a fresh stream for the hardware prefetcher. */
static inline __attribute__((always_inline)) void dot_rows(const void *w, int format, float scale, int64_t in,
                                                           const float *x, int64_t ld_x, int rows, float *out,
                                                           int64_t ld_out) {
    const int64_t lanes = GEMV_LANES;
    vecf acc[GEMV_GROUP] = {{0}};
    int64_t i = 0;
    int64_t prefetch = GEMV_PREFETCH_BYTES / weight_bytes(format);
    if (rows == 1) {  /* four accumulators keep the FMA latency off the stream */
        vecf a = {0}, b = {0}, c = {0}, d = {0};
        for (; i + 4 * lanes <= in; i += 4 * lanes) {
            for (int64_t line = 0; line < 4 * lanes * weight_bytes(format); line += 64)
                __builtin_prefetch((const char *)w + (i + prefetch) * weight_bytes(format) + line, 0, 3);
            a += load_weights(w, i, format) * load_f32(x + i);
            b += load_weights(w, i + lanes, format) * load_f32(x + i + lanes);
            c += load_weights(w, i + 2 * lanes, format) * load_f32(x + i + 2 * lanes);
            d += load_weights(w, i + 3 * lanes, format) * load_f32(x + i + 3 * lanes);
        }
        acc[0] = (a + b) + (c + d);
    }
    for (; i + lanes <= in; i += lanes) {
        if (rows > 1 && ((i * weight_bytes(format)) & 63) == 0)
            __builtin_prefetch((const char *)w + (i + prefetch) * weight_bytes(format), 0, 3);
        vecf wv = load_weights(w, i, format);
        for (int r = 0; r < rows; r++) acc[r] += wv * load_f32(x + r * ld_x + i);
    }
    for (int r = 0; r < rows; r++) {
        float s = lane_sum(acc[r]);
        for (int64_t j = i; j < in; j++) s += weight_at(w, j, format) * x[r * ld_x + j];
        out[r * ld_out] = format == WEIGHT_I8 ? s * scale : s;
    }
}

#if GEMV_LANES == 16
/* Lane j of the result is the sum of v[j]'s lanes, for 16 vectors: four levels of pairwise shuffles
 * and adds (45 operations, where 16 lane_sums take ~130, mostly scalar). Each level adds the same
 * lanes as lane_sum's tree, so every sum is rounded exactly as lane_sum rounds it. */
static inline vecf lane_sums16(const vecf v[16]) {
    vecf halves[8], quarters[4], pairs[2];
    for (int m = 0; m < 8; m++)  /* lanes 0-7: v[2m]'s k + k+8; lanes 8-15: v[2m+1]'s */
        halves[m] = __builtin_shufflevector(v[2 * m], v[2 * m + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                                            22, 23) +
                    __builtin_shufflevector(v[2 * m], v[2 * m + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                                            29, 30, 31);
    for (int n = 0; n < 4; n++)  /* lanes 4q..4q+3: v[4n+q]'s k + k+4 */
        quarters[n] = __builtin_shufflevector(halves[2 * n], halves[2 * n + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                              19, 24, 25, 26, 27) +
                      __builtin_shufflevector(halves[2 * n], halves[2 * n + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                              22, 23, 28, 29, 30, 31);
    for (int p = 0; p < 2; p++)  /* lanes 2q, 2q+1: v[8p+q]'s (0 + 2, 1 + 3) */
        pairs[p] = __builtin_shufflevector(quarters[2 * p], quarters[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17,
                                           20, 21, 24, 25, 28, 29) +
                   __builtin_shufflevector(quarters[2 * p], quarters[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                           22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(pairs[0], pairs[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(pairs[0], pairs[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* dot_rows for two weight rows and exactly GEMV_GROUP input rows: with AVX-512's 32 registers the
 * 16 accumulators stay in registers and each input vector loaded feeds two FMAs. Here the weights
 * are prefetched into L2 only (with 8 input rows per weight line there is time to bring it from L2). The sums of input row r land at out[r * ld_out] and
 * out[r * ld_out + 1]. */
static inline __attribute__((always_inline)) void dot_rows_pair(const void *w0, const void *w1, int format,
                                                                float scale0, float scale1, int64_t in,
                                                                const float *x, int64_t ld_x, float *out,
                                                                int64_t ld_out) {
    const int64_t lanes = GEMV_LANES;
    vecf acc[2 * GEMV_GROUP] = {{0}};  /* [2r]: row r with w0, [2r + 1]: with w1 */
    int64_t i = 0;
    int64_t prefetch = GEMV_PREFETCH_BYTES / weight_bytes(format);
    for (; i + lanes <= in; i += lanes) {
        if (((i * weight_bytes(format)) & 63) == 0) {
            __builtin_prefetch((const char *)w0 + (i + prefetch) * weight_bytes(format), 0, 2);
            __builtin_prefetch((const char *)w1 + (i + prefetch) * weight_bytes(format), 0, 2);
        }
        vecf a = load_weights(w0, i, format), b = load_weights(w1, i, format);
        for (int r = 0; r < GEMV_GROUP; r++) {
            vecf xv = load_f32(x + r * ld_x + i);
            acc[2 * r] += a * xv;
            acc[2 * r + 1] += b * xv;
        }
    }
    float sums[2 * GEMV_GROUP];
    vecf total = lane_sums16(acc);
    __builtin_memcpy(sums, &total, sizeof sums);
    for (int r = 0; r < GEMV_GROUP; r++) {
        for (int64_t j = i; j < in; j++) {
            sums[2 * r] += weight_at(w0, j, format) * x[r * ld_x + j];
            sums[2 * r + 1] += weight_at(w1, j, format) * x[r * ld_x + j];
        }
        if (format == WEIGHT_I8) {
            sums[2 * r] *= scale0;
            sums[2 * r + 1] *= scale1;
        }
        __builtin_memcpy(out + r * ld_out, sums + 2 * r, 2 * sizeof(float));
    }
}
#endif

/* Input rows [r, rows) of output feature o (weight row w), in groups of up to GEMV_GROUP. */
static inline __attribute__((always_inline)) void gemv_rows(const void *w, int format, float scale, int64_t in,
                                                            const float *x, int64_t rows, int64_t ld_x, float *y,
                                                            int64_t ld_y, int64_t o, int64_t r) {
    for (; r < rows; r += GEMV_GROUP) {
        const float *xr = x + r * ld_x;
        float *yr = y + r * ld_y + o;
        switch (rows - r < GEMV_GROUP ? rows - r : GEMV_GROUP) {  /* constant counts: loops unroll */
            case 1: dot_rows(w, format, scale, in, xr, ld_x, 1, yr, ld_y); break;
            case 2: dot_rows(w, format, scale, in, xr, ld_x, 2, yr, ld_y); break;
            case 3: dot_rows(w, format, scale, in, xr, ld_x, 3, yr, ld_y); break;
            case 4: dot_rows(w, format, scale, in, xr, ld_x, 4, yr, ld_y); break;
            case 5: dot_rows(w, format, scale, in, xr, ld_x, 5, yr, ld_y); break;
            case 6: dot_rows(w, format, scale, in, xr, ld_x, 6, yr, ld_y); break;
            case 7: dot_rows(w, format, scale, in, xr, ld_x, 7, yr, ld_y); break;
            default: dot_rows(w, format, scale, in, xr, ld_x, 8, yr, ld_y); break;
        }
    }
}

/* Output features [first, last): each weight row is streamed from memory once, then (still in L1)
 * dotted with the input rows in groups of up to GEMV_GROUP; with AVX-512, two weight rows at a
 * time for whole groups (see dot_rows_pair). */
static inline __attribute__((always_inline)) void gemv_range(const void *weight, const float *scales, int format,
                                                             int64_t in, const float *x, int64_t rows, int64_t ld_x,
                                                             float *y, int64_t ld_y, int64_t first, int64_t last) {
    int64_t row_bytes = in * weight_bytes(format);
    for (int64_t o = first; o < last; o++) {
        const void *w = (const char *)weight + o * row_bytes;
        float scale = format == WEIGHT_I8 ? scales[o] : 1.0f;
#if GEMV_LANES == 16
        if (rows >= GEMV_GROUP && o + 1 < last) {
            const void *w1 = (const char *)w + row_bytes;
            float scale1 = format == WEIGHT_I8 ? scales[o + 1] : 1.0f;
            int64_t r = 0;
            for (; r + GEMV_GROUP <= rows; r += GEMV_GROUP)
                dot_rows_pair(w, w1, format, scale, scale1, in, x + r * ld_x, ld_x, y + r * ld_y + o, ld_y);
            gemv_rows(w, format, scale, in, x, rows, ld_x, y, ld_y, o, r);
            gemv_rows(w1, format, scale1, in, x, rows, ld_x, y, ld_y, o + 1, r);
            o++;
            continue;
        }
#endif
        gemv_rows(w, format, scale, in, x, rows, ld_x, y, ld_y, o, 0);
    }
}

static void gemv_range_f32(const void *weight, int64_t in, const float *x, int64_t rows, int64_t ld_x, float *y,
                           int64_t ld_y, int64_t first, int64_t last) {
    gemv_range(weight, 0, WEIGHT_F32, in, x, rows, ld_x, y, ld_y, first, last);
}

static void gemv_range_i8(const void *weight, const float *scales, int64_t in, const float *x, int64_t rows,
                          int64_t ld_x, float *y, int64_t ld_y, int64_t first, int64_t last) {
    gemv_range(weight, scales, WEIGHT_I8, in, x, rows, ld_x, y, ld_y, first, last);
}

static void gemv_range_bf16(const void *weight, int64_t in, const float *x, int64_t rows, int64_t ld_x, float *y,
                            int64_t ld_y, int64_t first, int64_t last) {
    gemv_range(weight, 0, WEIGHT_BF16, in, x, rows, ld_x, y, ld_y, first, last);
}

/* The most rows for which this build's GEMV beats PyTorch's GEMMs on the same plain weight: 32 where
 * it pairs weight rows (AVX-512), else 16. */
int gemv_preferred_rows(void) {
    return GEMV_LANES == 16 ? GEMV_MAX_INPUT_ROWS : 16;
}

/* One call's operands, shared by its tasks (a task is a block of GEMV_BLOCK_ROWS output features). */
typedef struct {
    const void *weight;
    const float *scales, *x;
    float *y;
    int64_t out, in, rows, ld_x, ld_y;
    int format;
} GemvCall;

static void gemv_task(void *context, int64_t b) {
    const GemvCall *c = context;
    int64_t first = b * GEMV_BLOCK_ROWS, last = first + GEMV_BLOCK_ROWS < c->out ? first + GEMV_BLOCK_ROWS : c->out;
    if (c->format == WEIGHT_I8)
        gemv_range_i8(c->weight, c->scales, c->in, c->x, c->rows, c->ld_x, c->y, c->ld_y, first, last);
    else if (c->format == WEIGHT_BF16)
        gemv_range_bf16(c->weight, c->in, c->x, c->rows, c->ld_x, c->y, c->ld_y, first, last);
    else
        gemv_range_f32(c->weight, c->in, c->x, c->rows, c->ld_x, c->y, c->ld_y, first, last);
}

static int gemv(const void *weight, const float *scales, int format, int64_t out, int64_t in, const float *x,
                int64_t rows, int64_t ld_x, float *y, int64_t ld_y, int threads) {
    if (rows < 1 || rows > GEMV_MAX_INPUT_ROWS) return 1;
    GemvCall call = {weight, scales, x, y, out, in, rows, ld_x, ld_y, format};
    task_pool_run(threads, gemv_task, &call, (out + GEMV_BLOCK_ROWS - 1) / GEMV_BLOCK_ROWS);
    return 0;
}

/* weight [out, in] row-major; x [rows, in] with row stride ld_x; y [rows, out] with row stride
 * ld_y. Returns 1 (nothing written) when rows is outside 1..GEMV_MAX_INPUT_ROWS. */
int gemv_f32(const float *weight, int64_t out, int64_t in, const float *x, int64_t rows, int64_t ld_x, float *y,
             int64_t ld_y, int threads) {
    return gemv(weight, 0, WEIGHT_F32, out, in, x, rows, ld_x, y, ld_y, threads);
}

/* The same with int8 weights [out, in] and one float32 scale per output feature: y = (x @ W.T) * scale,
 * the weights widened to float32 in registers (the activations stay float32). */
int gemv_i8(const int8_t *weight, const float *scales, int64_t out, int64_t in, const float *x, int64_t rows,
            int64_t ld_x, float *y, int64_t ld_y, int threads) {
    return gemv(weight, scales, WEIGHT_I8, out, in, x, rows, ld_x, y, ld_y, threads);
}

/* The same with bfloat16 weights [out, in] widened to float32 in registers. */
int gemv_bf16(const uint16_t *weight, int64_t out, int64_t in, const float *x, int64_t rows, int64_t ld_x, float *y,
              int64_t ld_y, int threads) {
    return gemv(weight, 0, WEIGHT_BF16, out, in, x, rows, ld_x, y, ld_y, threads);
}
