/* One token's gated delta-rule update of one value head, shared by the decode and prefill kernels:
 *   S' = decay * S + k^T (beta * (v - k (decay * S))),  out = q S'   (S: [dk, dv], row-major).
 * Each column of S evolves on its own, so the head is done in blocks of 32, 16 and 8 columns whose
 * sums stay in registers: one read of the block for k S, one read and one write for the update
 * and q S'. GCC's vector extension (portable; lowered to the target's vector width).
 */
#ifndef HYBRIDSERVE_DELTA_RULE_H
#define HYBRIDSERVE_DELTA_RULE_H

#include <stdint.h>
#include <string.h>

typedef float lanes8 __attribute__((vector_size(32)));
/* the same, at a float's alignment and allowed to alias floats: loads and stores at any column */
typedef float lanes8_unaligned __attribute__((vector_size(32), aligned(4), may_alias));

static inline lanes8 lanes8_load(const float *p) { return *(const lanes8_unaligned *)p; }
static inline void lanes8_store(float *p, lanes8 v) { *(lanes8_unaligned *)p = v; }

/* `next` may be `s` itself (an in-place update). */
static void delta_rule_head(const float *s, float *next, const float *q, const float *k, const float *v, float decay,
                            float beta, int64_t dk, int64_t dv, float *out) {
    int64_t j = 0;
    /* 32 columns at a time, even and odd rows of S summed apart: 8 independent chains of FMAs per
     * sum, where 16 columns had 2 chains as long as dk, which the FMA latency bounded (~4 cycles a
     * step): a 64-token chunk of the built-in model's 8 heads took 300 us with either 1 or 2 threads. */
    for (; j + 32 <= dv && dk % 2 == 0; j += 32) {
        lanes8 ks[8] = {{0}}, qs[8] = {{0}};
        for (int64_t i = 0; i < dk; i += 2)
            for (int c = 0; c < 4; c++) {
                ks[c] += k[i] * lanes8_load(s + i * dv + j + 8 * c);
                ks[4 + c] += k[i + 1] * lanes8_load(s + (i + 1) * dv + j + 8 * c);
            }
        lanes8 delta[4];
        for (int c = 0; c < 4; c++) delta[c] = (lanes8_load(v + j + 8 * c) - (ks[c] + ks[4 + c]) * decay) * beta;
        for (int64_t i = 0; i < dk; i += 2)
            for (int c = 0; c < 4; c++) {
                lanes8 even = lanes8_load(s + i * dv + j + 8 * c) * decay + k[i] * delta[c];
                lanes8 odd = lanes8_load(s + (i + 1) * dv + j + 8 * c) * decay + k[i + 1] * delta[c];
                lanes8_store(next + i * dv + j + 8 * c, even);
                lanes8_store(next + (i + 1) * dv + j + 8 * c, odd);
                qs[c] += q[i] * even;
                qs[4 + c] += q[i + 1] * odd;
            }
        for (int c = 0; c < 4; c++) lanes8_store(out + j + 8 * c, qs[c] + qs[4 + c]);
    }
    for (; j + 16 <= dv; j += 16) {
        lanes8 ks0 = {0}, ks1 = {0}, qs0 = {0}, qs1 = {0};
        for (int64_t i = 0; i < dk; i++) {
            ks0 += k[i] * lanes8_load(s + i * dv + j);
            ks1 += k[i] * lanes8_load(s + i * dv + j + 8);
        }
        lanes8 delta0 = (lanes8_load(v + j) - ks0 * decay) * beta, delta1 = (lanes8_load(v + j + 8) - ks1 * decay) * beta;
        for (int64_t i = 0; i < dk; i++) {
            lanes8 s0 = lanes8_load(s + i * dv + j) * decay + k[i] * delta0;
            lanes8 s1 = lanes8_load(s + i * dv + j + 8) * decay + k[i] * delta1;
            lanes8_store(next + i * dv + j, s0);
            lanes8_store(next + i * dv + j + 8, s1);
            qs0 += q[i] * s0;
            qs1 += q[i] * s1;
        }
        lanes8_store(out + j, qs0);
        lanes8_store(out + j + 8, qs1);
    }
    for (; j + 8 <= dv; j += 8) {
        lanes8 ks = {0}, qs = {0};
        for (int64_t i = 0; i < dk; i++) ks += k[i] * lanes8_load(s + i * dv + j);
        lanes8 delta = (lanes8_load(v + j) - ks * decay) * beta;
        for (int64_t i = 0; i < dk; i++) {
            lanes8 si = lanes8_load(s + i * dv + j) * decay + k[i] * delta;
            lanes8_store(next + i * dv + j, si);
            qs += q[i] * si;
        }
        lanes8_store(out + j, qs);
    }
    for (; j < dv; j++) {  /* a head size that is not a multiple of 8 */
        float ks = 0.0f, qs = 0.0f;
        for (int64_t i = 0; i < dk; i++) ks += k[i] * s[i * dv + j];
        float delta = (v[j] - ks * decay) * beta;
        for (int64_t i = 0; i < dk; i++) {
            float si = s[i * dv + j] * decay + k[i] * delta;
            next[i * dv + j] = si;
            qs += q[i] * si;
        }
        out[j] = qs;
    }
}

#endif
