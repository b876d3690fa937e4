/* One token's gated delta-rule update of one value head, shared by the decode and prefill kernels:
 *   S' = decay * S + k^T (beta * (v - k (decay * S))),  out = q S'   (S: [dk, dv], row-major).
 * Each column of S evolves on its own, so the head is done in blocks of 16 and 8 columns whose
 * sums stay in registers: one read of the block for k S, one read and one write for the update
 * and q S'. GCC's vector extension (portable; lowered to the target's vector width) with two
 * chains of 8 lanes per 16-column block hides the FMA latency.
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
