/* What greedy sampling needs from a step's logits, in one pass per row (CPU, float32): the index of
 * the row's first maximum (torch.argmax's choice) and whether every value is finite.
 *
 * The sampler asked torch for these with isfinite().all() and argmax(): as the first parallel ops
 * after the step's C call they paid the thread pool's wake-ups, several times their own scan
 * (figures in docs/cpu-kernels.md).
 */
#include <stdint.h>

#include "hybridserve_kernels.h"

#define LOGIT_LANES 16
typedef float vec_logits __attribute__((vector_size(LOGIT_LANES * 4)));
typedef int32_t vec_mask __attribute__((vector_size(LOGIT_LANES * 4)));

static int64_t row_argmax_finite(const float *x, int64_t n, uint8_t *finite) {
    int64_t i = 0;
    float best = x[0], poison = 0.0f; /* poison: x * 0 summed, NaN iff some x is NaN or infinite */
    if (n >= LOGIT_LANES) {
        vec_logits top, bad = {0};
        __builtin_memcpy(&top, x, sizeof top);
        for (; i + LOGIT_LANES <= n; i += LOGIT_LANES) {
            vec_logits v;
            __builtin_memcpy(&v, x + i, sizeof v);
            vec_mask higher = v > top;
            top = (vec_logits)(((vec_mask)v & higher) | ((vec_mask)top & ~higher));
            bad += v * 0.0f;
        }
        for (int lane = 0; lane < LOGIT_LANES; lane++) {
            best = top[lane] > best ? top[lane] : best;
            poison += bad[lane];
        }
    }
    for (; i < n; i++) {
        best = x[i] > best ? x[i] : best;
        poison += x[i] * 0.0f;
    }
    *finite = poison == 0.0f;
    for (int64_t j = 0; j < n; j++)
        if (x[j] == best) return j;
    return 0; /* no value equals the maximum: the row holds NaN (and is reported non-finite) */
}

/* For each row r of x [rows, n] (rows ld_x apart, n >= 1): argmax[r] and finite[r] (1 or 0). Rows
 * are shared among threads only when there are a million values or more. */
void logits_argmax_finite(const float *x, int64_t rows, int64_t n, int64_t ld_x, int64_t *argmax, uint8_t *finite,
                          int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows > 1 && rows * n >= (1 << 20))
    for (int64_t r = 0; r < rows; r++) argmax[r] = row_argmax_finite(x + r * ld_x, n, finite + r);
}
