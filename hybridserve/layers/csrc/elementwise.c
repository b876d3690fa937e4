/* Elementwise work on a few float32 rows (CPU), one call where eager PyTorch dispatches several
 * ops: the attention's q/k RMSNorm followed by partial rotary embedding (decode), and for short
 * chunks (a warm request's suffix) the GDN output norm with its SiLU gate and the MLP's
 * silu(gate) * up. On a short chunk each of torch's ops is a parallel region whose sleeping worker
 * takes ~55 us to wake: in a warm 4096+64-token request torch's rms_norm took ~200 us a call and
 * SiLU ~80. These loops run on the calling thread, with denormals flushed (see vector_math.h).
 */
#include <math.h>
#include <stdint.h>

#include "hybridserve_kernels.h"
#include "vector_math.h"

/* For each token t and head h: y = rms_norm(x[t, h]) * scale, then its first rot dims rotated in
 * the rotate-half layout with cos[t], sin[t] ([T, rot]); the other dims pass through.
 * x[t, h] starts at x + t * ld_token + h * ld_head (the k heads of a chunk sit in a wider fused
 * projection row); out is contiguous [T, heads, dim]. */
void rms_norm_rope_f32(const float *x, int64_t tokens, int64_t heads, int64_t dim, int64_t ld_token, int64_t ld_head,
                       const float *scale, float eps, const float *cos, const float *sin, int64_t rot, float *out) {
    int64_t half = rot / 2;
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t h = 0; h < heads; h++) {
            const float *row = x + t * ld_token + h * ld_head;
            float *dst = out + (t * heads + h) * dim;
            float sum = sum_of_squares(row, dim);
            float inv = 1.0f / sqrtf(sum / (float)dim + eps);
            for (int64_t i = 0; i < dim; i++) dst[i] = row[i] * inv * scale[i];
            const float *c = cos + t * rot, *s = sin + t * rot;
            for (int64_t i = 0; i < half; i++) {
                float a = dst[i], b = dst[i + half];
                dst[i] = a * c[i] - b * s[i];
                dst[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* y = scale * rms_norm(x) * silu(gate) per row (Qwen3.5's gated GDN output norm), in torch's
 * order: the normalised row times scale, then times the gate's SiLU. x and gate rows are `ld_x`
 * and `ld_gate` apart; out is contiguous [rows, dim]. */
void gated_rms_norm_f32(const float *x, const float *gate, int64_t rows, int64_t dim, int64_t ld_x,
                        int64_t ld_gate, const float *scale, float eps, float *out) {
    unsigned int saved_csr = denormals_flush_begin();
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * ld_x, *g = gate + r * ld_gate;
        float *dst = out + r * dim;
        float sum = sum_of_squares(row, dim);
        float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) dst[i] = (row[i] * inv * scale[i]) * silu_f32(g[i]);
    }
    denormals_flush_end(saved_csr);
}

/* y = silu(x[:, :half]) * x[:, half:] per row (the MLP over a fused [gate | up] output); x rows
 * are `ld_x` apart, out is contiguous [rows, half]. */
void silu_mul_f32(const float *x, int64_t rows, int64_t half, int64_t ld_x, float *out) {
    unsigned int saved_csr = denormals_flush_begin();
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * ld_x, *up = gate + half;
        float *dst = out + r * half;
        for (int64_t i = 0; i < half; i++) dst[i] = silu_f32(gate[i]) * up[i];
    }
    denormals_flush_end(saved_csr);
}
