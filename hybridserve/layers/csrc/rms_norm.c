/* RMSNorm of a few float32 rows (CPU): y = x / sqrt(mean(x^2) + eps) * scale.
 *
 * torch's rms_norm on CPU runs as about six ATen ops; on the decode path of a small model that
 * dispatch, not the arithmetic, is the cost. Through ZeroCenteredRMSNorm on this 2-core VM: one
 * [1, 512] row 28-39 us with this kernel against 51-57 us with torch's op, 64 rows 66-71 against
 * 107-127 us (the ctypes call itself is ~4 us; the rest is Python around it). Rows are independent;
 * a decode step has one per sequence.
 */
#include <math.h>
#include <stdint.h>

#include "hybridserve_kernels.h"
#include "vector_math.h"

void rms_norm_f32(const float *x, int64_t rows, int64_t dim, int64_t ld_x, const float *scale, float eps,
                  float *out, int64_t ld_out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * ld_x;
        float *dst = out + r * ld_out;
        float sum = sum_of_squares(row, dim);
        float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) dst[i] = row[i] * inv * scale[i];
    }
}
