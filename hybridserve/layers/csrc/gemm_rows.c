/* y = x @ W.T for 6 to 128 float32 rows of x on the plain row-major weight, float32 or int8 with a
 * float32 scale per output row (AVX-512 only).
 *
 * These rows (a warm request's suffix, a chunk beside decode rows, a large decode batch) are too many
 * for the GEMV (csrc/gemv.c) and too few for a GEMM library, which spends them packing the weight,
 * synchronising its K split and waking sleeping workers.
 *
 * Each task is a block of TILE_BLOCK output features. Inside it, TILE_W weight rows at a time are
 * dotted with TILE_X input rows at a time: 24 accumulators stay in registers and each k-step loads
 * TILE_W + TILE_X vectors for TILE_W * TILE_X FMAs. The TILE_W rows stay in L1 while every group of
 * input rows passes over them. The blocks run on the task pool (task_pool.h): the caller starts at
 * once and a worker that wakes late takes fewer blocks. No packing: the weight is the matrix the GEMV
 * streams. int8 weights are widened as they are loaded and each sum is scaled once; bfloat16 ones
 * keep the GEMV, which was as fast for them.
 *
 * The next weight rows are prefetched as one line of each next row per k-step of the group's first
 * tile; from 4 tiles of input rows (19 rows) every tile instead fetches its share of the next rows'
 * bytes in address order, which the hardware prefetcher runs ahead of. With this the tile beats the
 * GEMV from TILE_MIN_ROWS rows. docs/decisions.md lists the variants measured and not kept.
 */
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "hybridserve_kernels.h"
#include "task_pool.h"
#include "vector_math.h"

#define TILE_MIN_ROWS 6
#define TILE_MAX_ROWS 128
#define TILE_W 4        /* weight rows per tile */
#define TILE_X 6        /* input rows per tile */
#define PREFETCH_SPREAD_GROUPS 4  /* input-row groups from which the prefetch is spread (see weight_rows) */
#define TILE_BLOCK 128  /* output features per task (see the header) */
#define SILU_SUB_BLOCK 32  /* gate and up features the MLP variant computes before writing their product */

#if defined(__AVX512F__)

/* How a tile prefetches the next TILE_W weight rows (see weight_rows). */
enum { PREFETCH_NONE, PREFETCH_ROWS_TOGETHER, PREFETCH_SPREAD };

static inline __attribute__((always_inline)) int64_t weight_bytes(int format) {
    return format == WEIGHT_I8 ? 1 : 4;
}

/* Weights i..i+15 of a row as float32 (int8 widened, not yet scaled). */
static inline __attribute__((always_inline)) __m512 load_weights(const char *row, int64_t i, int format) {
    if (format == WEIGHT_I8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + i))));
    return _mm512_loadu_ps((const float *)row + i);
}

/* The last count (< 16) weights from i, zero-padded to 16 lanes. */
static inline __attribute__((always_inline)) __m512 load_weights_tail(const char *row, int64_t i, int64_t count,
                                                                       int format) {
    char padded[64] = {0};
    __builtin_memcpy(padded, row + i * weight_bytes(format), (size_t)(count * weight_bytes(format)));
    return load_weights(padded, 0, format);
}

/* y[r * ld_y + a] = dot(w + a * in, x + r * ld_x) for a < wr (<= TILE_W), r < xr (<= TILE_X); wr,
 * xr and mode are constants at each call site, so the loops unroll and the accumulators stay in
 * registers. A ragged end of the row (in not a multiple of 16) takes one masked step. Meanwhile
 * the TILE_W weight rows at `next` go into L2: PREFETCH_ROWS_TOGETHER, a line of each per k-step;
 * PREFETCH_SPREAD, lines [line, line_end) of their contiguous bytes, per_step a k-step. */
static inline __attribute__((always_inline)) void tile(const char *w, int format, const float *scales, int64_t in,
                                                        const float *x, int64_t ld_x, float *y, int64_t ld_y, int wr,
                                                        int xr, int mode, const char *next, int64_t line,
                                                        int64_t line_end, int64_t per_step) {
    int64_t row_bytes = in * weight_bytes(format);
    __m512 acc[TILE_X][TILE_W];
    for (int r = 0; r < TILE_X; r++)
        for (int a = 0; a < TILE_W; a++) acc[r][a] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= in; k += 16) {
        __m512 wv[TILE_W];
        for (int a = 0; a < wr; a++) wv[a] = load_weights(w + a * row_bytes, k, format);
        if (mode == PREFETCH_ROWS_TOGETHER && ((k * weight_bytes(format)) & 63) == 0)
            for (int a = 0; a < TILE_W; a++) _mm_prefetch(next + a * row_bytes + k * weight_bytes(format), _MM_HINT_T1);
        if (mode == PREFETCH_SPREAD)
            for (int64_t p = 0; p < per_step && line < line_end; p++, line++)
                _mm_prefetch(next + 64 * line, _MM_HINT_T1);
        for (int r = 0; r < xr; r++) {
            __m512 xv = _mm512_loadu_ps(x + r * ld_x + k);
            for (int a = 0; a < wr; a++) acc[r][a] = _mm512_fmadd_ps(wv[a], xv, acc[r][a]);
        }
    }
    if (k < in) {
        __mmask16 mask = (__mmask16)((1u << (in - k)) - 1);
        __m512 wv[TILE_W];
        for (int a = 0; a < wr; a++) wv[a] = load_weights_tail(w + a * row_bytes, k, in - k, format);
        for (int r = 0; r < xr; r++) {
            __m512 xv = _mm512_maskz_loadu_ps(mask, x + r * ld_x + k);
            for (int a = 0; a < wr; a++) acc[r][a] = _mm512_fmadd_ps(wv[a], xv, acc[r][a]);
        }
    }
    for (int r = 0; r < xr; r++) {
        if (wr == TILE_W) {
            __m128 sums = sums4_ps(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
            _mm_storeu_ps(y + r * ld_y, format == WEIGHT_I8 ? _mm_mul_ps(sums, _mm_loadu_ps(scales)) : sums);
        } else {
            for (int a = 0; a < wr; a++) {
                float sum = _mm512_reduce_add_ps(acc[r][a]);
                y[r * ld_y + a] = format == WEIGHT_I8 ? sum * scales[a] : sum;
            }
        }
    }
}

/* Every input row against weight rows [o, o + wr) (scales: theirs, for int8): groups of TILE_X
 * input rows, the last one ragged. Meanwhile the TILE_W weight rows at `next` (NULL: none; they
 * follow these in memory) go into L2. With few groups the first one fetches them, a line of each
 * row per k-step, in the order the next group reads them; from PREFETCH_SPREAD_GROUPS groups up
 * every group fetches its share of their bytes in address order, which the hardware prefetcher
 * then runs ahead of. */
static inline __attribute__((always_inline)) void weight_rows(const char *w, int format, const float *scales,
                                                               int64_t in, const float *x, int64_t rows, int64_t ld_x,
                                                               float *y, int64_t ld_y, int wr, const char *next) {
    int64_t groups = (rows + TILE_X - 1) / TILE_X, steps = (in + 15) / 16, r = 0;
#define TILE(xr, ...) tile(w, format, scales, in, x + r * ld_x, ld_x, y + r * ld_y, ld_y, wr, xr, __VA_ARGS__)
    if (next == 0 || groups < PREFETCH_SPREAD_GROUPS) {
        int first = next ? PREFETCH_ROWS_TOGETHER : PREFETCH_NONE;
        for (; r + TILE_X <= rows; r += TILE_X) TILE(TILE_X, r == 0 ? first : PREFETCH_NONE, next, 0, 0, 0);
        switch (rows - r) {  /* constant counts: the tile unrolls */
            case 1: TILE(1, PREFETCH_NONE, 0, 0, 0, 0); break;
            case 2: TILE(2, PREFETCH_NONE, 0, 0, 0, 0); break;
            case 3: TILE(3, PREFETCH_NONE, 0, 0, 0, 0); break;
            case 4: TILE(4, PREFETCH_NONE, 0, 0, 0, 0); break;
            case 5: TILE(5, PREFETCH_NONE, 0, 0, 0, 0); break;
            default: break;
        }
        return;
    }
    int64_t lines = (TILE_W * in * weight_bytes(format) + 63) / 64, share = (lines + groups - 1) / groups;
    int64_t per_step = (share + steps - 1) / steps, line = 0;
#define SPREAD PREFETCH_SPREAD, next, line, line + share < lines ? line + share : lines, per_step
    for (; r + TILE_X <= rows; r += TILE_X, line += share) TILE(TILE_X, SPREAD);
    switch (rows - r) {
        case 1: TILE(1, SPREAD); break;
        case 2: TILE(2, SPREAD); break;
        case 3: TILE(3, SPREAD); break;
        case 4: TILE(4, SPREAD); break;
        case 5: TILE(5, SPREAD); break;
        default: break;
    }
#undef SPREAD
#undef TILE
}

/* Weight rows [0, count) of `w` (which has `after` more rows past them, for the prefetch) against
 * every input row; column c of the result lands at y[r * ld_y + c]. */
static inline __attribute__((always_inline)) void block_rows(const char *w, int format, const float *scales,
                                                              int64_t count, int64_t after, int64_t in,
                                                              const float *x, int64_t rows, int64_t ld_x, float *y,
                                                              int64_t ld_y) {
    int64_t row_bytes = in * weight_bytes(format), o = 0;
#define ROWS(wr, next) \
    weight_rows(w + o * row_bytes, format, format == WEIGHT_I8 ? scales + o : 0, in, x, rows, ld_x, y + o, ld_y, wr, \
                next)
    for (; o + TILE_W <= count; o += TILE_W)  /* the next weight rows into L2 while these are used */
        ROWS(TILE_W, o + 2 * TILE_W <= count + after ? w + (o + TILE_W) * row_bytes : 0);
    switch (count - o) {
        case 1: ROWS(1, 0); break;
        case 2: ROWS(2, 0); break;
        case 3: ROWS(3, 0); break;
        default: break;
    }
#undef ROWS
}

/* block_rows with the format a constant, so that each format's loops are compiled apart. */
static void block_rows_any(const void *w, int format, const float *scales, int64_t count, int64_t after, int64_t in,
                           const float *x, int64_t rows, int64_t ld_x, float *y, int64_t ld_y) {
    if (format == WEIGHT_I8)
        block_rows(w, WEIGHT_I8, scales, count, after, in, x, rows, ld_x, y, ld_y);
    else
        block_rows(w, WEIGHT_F32, 0, count, after, in, x, rows, ld_x, y, ld_y);
}
#endif

/* The rows this build takes: [TILE_MIN_ROWS, TILE_MAX_ROWS] with AVX-512, none otherwise (0, 0). */
void gemm_rows_bounds(int *min_rows, int *max_rows) {
#if defined(__AVX512F__)
    *min_rows = TILE_MIN_ROWS;
    *max_rows = TILE_MAX_ROWS;
#else
    *min_rows = 0;
    *max_rows = 0;
#endif
}

/* One call's operands, shared by its tasks (a task is a block of TILE_BLOCK output features). */
typedef struct {
    const char *weight;
    const float *scales, *x;
    float *y;
    int64_t out, in, rows, ld_x, ld_y;
    int format;
} GemmCall;

#if defined(__AVX512F__)
static void gemm_task(void *context, int64_t block) {
    const GemmCall *c = context;
    int64_t first = block * TILE_BLOCK, count = first + TILE_BLOCK < c->out ? TILE_BLOCK : c->out - first;
    const float *scales = c->scales ? c->scales + first : 0;
    block_rows_any(c->weight + first * c->in * weight_bytes(c->format), c->format, scales, count,
                   c->out - first - count, c->in, c->x, c->rows, c->ld_x, c->y + first, c->ld_y);
}

/* The fused MLP variant: `out` is the half width; for each SILU_SUB_BLOCK of the task's features,
 * gate rows [first, first + count) and up rows half + [first, first + count) into scratch, then
 * silu(gate) * up into y. */
static void silu_mul_task(void *context, int64_t block) {
    const GemmCall *c = context;
    int64_t half = c->out, task_first = block * TILE_BLOCK;
    int64_t task_end = task_first + TILE_BLOCK < half ? task_first + TILE_BLOCK : half;
    int64_t row_bytes = c->in * weight_bytes(c->format);
    float gate[TILE_MAX_ROWS * SILU_SUB_BLOCK], up[TILE_MAX_ROWS * SILU_SUB_BLOCK];
    const float *scales = c->scales;
    for (int64_t first = task_first; first < task_end; first += SILU_SUB_BLOCK) {
        int64_t count = first + SILU_SUB_BLOCK < task_end ? SILU_SUB_BLOCK : task_end - first;
        block_rows_any(c->weight + first * row_bytes, c->format, scales ? scales + first : 0, count,
                       2 * half - first - count, c->in, c->x, c->rows, c->ld_x, gate, SILU_SUB_BLOCK);
        block_rows_any(c->weight + (half + first) * row_bytes, c->format, scales ? scales + half + first : 0, count,
                       half - first - count, c->in, c->x, c->rows, c->ld_x, up, SILU_SUB_BLOCK);
        for (int64_t r = 0; r < c->rows; r++)
            for (int64_t j = 0; j < count; j++)
                c->y[r * c->ld_y + first + j] = silu_f32(gate[r * SILU_SUB_BLOCK + j]) * up[r * SILU_SUB_BLOCK + j];
    }
}
#endif

/* y = x @ W.T for weight [out, in] row-major in `format`: 0 float32, or 1 int8 with float32
 * `scales` [out], y = (x @ W.T) * scales, the weights widened to float32 in registers (or 2
 * bfloat16, taken only on AMX tiles); x [rows, in]
 * float32 with row stride ld_x; y [rows, out] with row stride ld_y. Returns 1 (nothing written)
 * when this build, `rows` (outside gemm_rows_bounds) or `format` is not taken. int8 and bfloat16
 * weights go first to AMX tiles where the CPU has them (gemm_amx.c: 8 to 32 int8 rows, 6 to 32
 * bf16 ones). The blocks run on the task pool (task_pool.h). */
int gemm_rows(const void *weight, const float *scales, int format, int64_t out, int64_t in, const float *x,
              int64_t rows, int64_t ld_x, float *y, int64_t ld_y, int threads) {
    if (format != WEIGHT_F32 && !gemm_amx(weight, scales, format, out, in, x, rows, ld_x, y, ld_y, threads))
        return 0;
#if defined(__AVX512F__)
    if (rows < TILE_MIN_ROWS || rows > TILE_MAX_ROWS || (format != WEIGHT_F32 && format != WEIGHT_I8)) return 1;
    GemmCall call = {weight, scales, x, y, out, in, rows, ld_x, ld_y, format};
    task_pool_run(threads, gemm_task, &call, (out + TILE_BLOCK - 1) / TILE_BLOCK);
    return 0;
#else
    (void)weight; (void)scales; (void)format; (void)out; (void)in; (void)x; (void)rows; (void)ld_x; (void)y;
    (void)ld_y; (void)threads;
    return 1;
#endif
}

/* The MLP's first half: y = silu(x @ G.T) * (x @ U.T) for the fused [G; U] weight [2 * half, in]
 * (row-major, in `format` as gemm_rows; int8 scales [2 * half]), y [rows, half] with row stride
 * ld_y. Each task computes a block of gate columns and the same block of up columns into scratch
 * and writes only the product, so the [rows, 2 * half] projection is never stored, nor read back
 * by a second pass from the other core's cache (silu_mul_f32 over a 64 x 3072 output took ~85-300
 * us a call in a forward against 40 in isolation). Returns 1 (nothing written) as gemm_rows. */
int gemm_rows_silu_mul(const void *weight, const float *scales, int format, int64_t half, int64_t in,
                       const float *x, int64_t rows, int64_t ld_x, float *y, int64_t ld_y, int threads) {
    if (format != WEIGHT_F32 &&
        !gemm_amx_silu_mul(weight, scales, format, half, in, x, rows, ld_x, y, ld_y, threads))
        return 0;
#if defined(__AVX512F__)
    if (rows < TILE_MIN_ROWS || rows > TILE_MAX_ROWS || (format != WEIGHT_F32 && format != WEIGHT_I8)) return 1;
    GemmCall call = {weight, scales, x, y, half, in, rows, ld_x, ld_y, format};
    unsigned int saved_csr = denormals_flush_begin();  /* the pool's workers keep it set */
    task_pool_run(threads, silu_mul_task, &call, (half + TILE_BLOCK - 1) / TILE_BLOCK);
    denormals_flush_end(saved_csr);
    return 0;
#else
    (void)weight; (void)scales; (void)format; (void)half; (void)in; (void)x; (void)rows; (void)ld_x; (void)y;
    (void)ld_y; (void)threads;
    return 1;
#endif
}
