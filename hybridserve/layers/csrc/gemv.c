/* y = x @ W.T for up to 16 float32 rows of x (CPU decode and short prefills).
 *
 * A batch-1 decode step is a stream of every weight, so the GEMV must read memory as fast as the
 * machine allows. Measured on the 2-core AVX2 host over a 105 MB matrix with 2 threads: a plain sum
 * reads it in 6.5-6.9 ms; a loop reading one weight row at a time in 6.9-7.0 ms; the same loop
 * reading four rows at once (four interleaved streams, the usual register blocking) in 8.4-8.5 ms.
 * So each thread reads one weight row after the other, a single sequential stream, and gets its
 * instruction parallelism along the row (four accumulators for one input row, one per input row
 * otherwise). Each weight row is read from memory once and, while it sits in L1, dotted with every
 * input row in groups of GEMV_GROUP, so 8 rows cost well under 8x one row. Threads take blocks of
 * GEMV_BLOCK_ROWS output features as they come free, so a worker that wakes late from OpenMP's
 * passive wait takes fewer blocks instead of holding up the call.
 * On the built-in model's linears against torch's split `bmm` (linear.py), same process, 2 threads:
 * 0.83-0.88x the time at 1 row, 0.56-0.67x at 8, 0.70-0.88x at 16, 1.16x at 32 (so 16 is the bound).
 */
#include <omp.h>
#include <stdint.h>

#define GEMV_MAX_INPUT_ROWS 16
#define GEMV_GROUP 8
#define GEMV_PREFETCH 1024  /* floats ahead in the weight row stream (4 KB) */
#define GEMV_BLOCK_ROWS 64  /* output features handed to a thread at a time */

typedef float v8f __attribute__((vector_size(32)));

static inline v8f load8(const float *p) {
    v8f v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline float lane_sum(v8f v) {
    float s = 0.0f;
    for (int i = 0; i < 8; i++) s += v[i];
    return s;
}

/* out[r * ld_out] = dot(w, x + r * ld_x) for r < rows (<= GEMV_GROUP); `rows` is a constant at each
 * call site, so the loops over r unroll and the accumulators live in registers. */
static inline void dot_rows(const float *w, int64_t in, const float *x, int64_t ld_x, int rows, float *out,
                            int64_t ld_out) {
    v8f acc[GEMV_GROUP] = {{0}};
    int64_t i = 0;
    if (rows == 1) {  /* four accumulators keep the FMA latency off the stream */
        v8f a = {0}, b = {0}, c = {0}, d = {0};
        for (; i + 32 <= in; i += 32) {
            a += load8(w + i) * load8(x + i);
            b += load8(w + i + 8) * load8(x + i + 8);
            c += load8(w + i + 16) * load8(x + i + 16);
            d += load8(w + i + 24) * load8(x + i + 24);
        }
        acc[0] = (a + b) + (c + d);
    }
    for (; i + 8 <= in; i += 8) {
        __builtin_prefetch(w + i + GEMV_PREFETCH, 0, 0);
        v8f wv = load8(w + i);
        for (int r = 0; r < rows; r++) acc[r] += wv * load8(x + r * ld_x + i);
    }
    for (int r = 0; r < rows; r++) {
        float s = lane_sum(acc[r]);
        for (int64_t j = i; j < in; j++) s += w[j] * x[r * ld_x + j];
        out[r * ld_out] = s;
    }
}

/* Output features [first, last): each weight row is streamed from memory once, then (still in L1)
 * dotted with the input rows in groups of up to GEMV_GROUP. */
static void gemv_range(const float *weight, int64_t in, const float *x, int64_t rows, int64_t ld_x, float *y,
                       int64_t ld_y, int64_t first, int64_t last) {
    for (int64_t o = first; o < last; o++) {
        const float *w = weight + o * in;
        for (int64_t r = 0; r < rows; r += GEMV_GROUP) {
            const float *xr = x + r * ld_x;
            float *yr = y + r * ld_y + o;
            switch (rows - r < GEMV_GROUP ? rows - r : GEMV_GROUP) {  /* constant counts: loops unroll */
                case 1: dot_rows(w, in, xr, ld_x, 1, yr, ld_y); break;
                case 2: dot_rows(w, in, xr, ld_x, 2, yr, ld_y); break;
                case 3: dot_rows(w, in, xr, ld_x, 3, yr, ld_y); break;
                case 4: dot_rows(w, in, xr, ld_x, 4, yr, ld_y); break;
                case 5: dot_rows(w, in, xr, ld_x, 5, yr, ld_y); break;
                case 6: dot_rows(w, in, xr, ld_x, 6, yr, ld_y); break;
                case 7: dot_rows(w, in, xr, ld_x, 7, yr, ld_y); break;
                default: dot_rows(w, in, xr, ld_x, 8, yr, ld_y); break;
            }
        }
    }
}

/* weight [out, in] row-major; x [rows, in] with row stride ld_x; y [rows, out] with row stride
 * ld_y. Returns 1 (nothing written) when rows is outside 1..GEMV_MAX_INPUT_ROWS. */
int gemv_f32(const float *weight, int64_t out, int64_t in, const float *x, int64_t rows, int64_t ld_x, float *y,
             int64_t ld_y, int threads) {
    if (rows < 1 || rows > GEMV_MAX_INPUT_ROWS) return 1;
    int64_t block = GEMV_BLOCK_ROWS;
    int64_t blocks = (out + block - 1) / block;
    if (blocks == 0) return 0;
    if (threads > blocks) threads = (int)blocks;
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t first = b * block, last = first + block < out ? first + block : out;
        gemv_range(weight, in, x, rows, ld_x, y, ld_y, first, last);
    }
    return 0;
}
