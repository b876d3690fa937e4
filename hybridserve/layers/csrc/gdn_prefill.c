/* A prefill chunk of one sequence through a Gated DeltaNet layer, token by token (float32, CPU).
 *
 * The chunked form in gated_delta.py turns each 64-token chunk of delta-rule updates into matrix
 * products, which suits a GPU. On CPU its ~40 small ATen ops per chunk and the depthwise conv's
 * oneDNN call cost more than the arithmetic: the recurrence the decode kernel uses, run one token
 * after another with each value head's state held in cache, took 0.19-0.37x the chunked form's
 * time from 8 to 128 tokens and 0.54x at 4160 for the built-in model's layer, and 0.58-0.82x for
 * a 4B-sized layer (16/32 heads of 128) from 64 to 2048 tokens (2-core AVX2 host).
 *   conv:   y[t] = silu(sum_j w[c][j] * window[c][t + j]) over the window [conv state | inputs];
 *   q, k:   l2-normalised per key head (q also scaled by head_k ** -0.5);
 *   state:  S' = exp(g) * S + k^T (beta * (v - k (exp(g) * S))),  out = q S'.
 * Live state is only read: the final state goes to `final_state` and the state after
 * capture_tokens[i] tokens (1-based, any order) to captured[i], for the caller to commit once the
 * forward succeeded. Threads share out tokens for the conv, value heads for the recurrence.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vector_math.h"

static void normalize(float *x, int64_t n, float eps, float scale) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    float factor = scale / sqrtf(sum + eps);
    for (int64_t i = 0; i < n; i++) x[i] *= factor;
}

/* window [conv_dim, tokens + kernel - 1]; weight [conv_dim, kernel]; conv_out [tokens, conv_dim]. */
static void conv_token(const float *window, const float *weight, int64_t conv_dim, int64_t kernel, int64_t width,
                       int64_t t, float *out) {
    for (int64_t c = 0; c < conv_dim; c++) {
        const float *x = window + c * width + t, *w = weight + c * kernel;
        float acc = 0.0f;
        for (int64_t j = 0; j < kernel; j++) acc += x[j] * w[j];
        out[c] = silu_f32(acc);
    }
}

/* One value head over all tokens: state [dk, dv] advanced in place. */
static void head_recurrence(float *state, const float *conv_out, int64_t conv_dim, int64_t q_offset,
                            int64_t k_offset, int64_t v_offset, const float *g, const float *beta, int64_t gate_stride,
                            int64_t tokens, int64_t dk, int64_t dv, float *out, int64_t out_stride,
                            int64_t num_captures, const int64_t *capture_tokens, float *captured, int64_t capture_stride,
                            float *delta) {
    for (int64_t t = 0; t < tokens; t++) {
        const float *row = conv_out + t * conv_dim;
        const float *q = row + q_offset, *k = row + k_offset, *v = row + v_offset;
        float decay = expf(g[t * gate_stride]), b = beta[t * gate_stride];
        for (int64_t j = 0; j < dv; j++) delta[j] = 0.0f;
        for (int64_t i = 0; i < dk; i++) {
            float *s = state + i * dv, ki = k[i];
            for (int64_t j = 0; j < dv; j++) {
                s[j] *= decay;
                delta[j] += ki * s[j];
            }
        }
        float *o = out + t * out_stride;
        for (int64_t j = 0; j < dv; j++) { delta[j] = (v[j] - delta[j]) * b; o[j] = 0.0f; }
        for (int64_t i = 0; i < dk; i++) {
            float *s = state + i * dv, ki = k[i], qi = q[i];
            for (int64_t j = 0; j < dv; j++) {
                s[j] += ki * delta[j];
                o[j] += qi * s[j];
            }
        }
        for (int64_t c = 0; c < num_captures; c++)  /* a few per chunk at most */
            if (capture_tokens[c] == t + 1) memcpy(captured + c * capture_stride, state, sizeof(float) * dk * dv);
    }
}

/* window [conv_dim, tokens + kernel - 1]; g, beta [tokens, Hv] (log-decay and beta); rec_state,
 * final_state [Hv, Dk, Dv]; captured [num_captures, Hv, Dk, Dv]; conv_out [tokens, conv_dim] and
 * delta [Hv, Dv] scratch; core [tokens, Hv, Dv]. Returns 2 for a capture outside 1..tokens,
 * before anything is written. */
int gdn_prefill_f32(int64_t tokens, int64_t num_k_heads, int64_t num_v_heads, int64_t head_k, int64_t head_v,
                    int64_t kernel, const float *window, const float *conv_weight, const float *g, const float *beta,
                    const float *rec_state, float l2_eps, int64_t num_captures, const int64_t *capture_tokens,
                    int num_threads, float *conv_out, float *delta, float *captured, float *final_state,
                    float *core) {
    int64_t key_dim = num_k_heads * head_k, value_dim = num_v_heads * head_v;
    int64_t conv_dim = 2 * key_dim + value_dim, width = tokens + kernel - 1, group = num_v_heads / num_k_heads;
    int64_t head_size = head_k * head_v;
    float q_scale = 1.0f / sqrtf((float)head_k);
    for (int64_t i = 0; i < num_captures; i++)
        if (capture_tokens[i] < 1 || capture_tokens[i] > tokens) return 2;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; t++) {
            float *row = conv_out + t * conv_dim;
            conv_token(window, conv_weight, conv_dim, kernel, width, t, row);
            for (int64_t h = 0; h < num_k_heads; h++) {
                normalize(row + h * head_k, head_k, l2_eps, q_scale);
                normalize(row + key_dim + h * head_k, head_k, l2_eps, 1.0f);
            }
        }
#pragma omp for schedule(static)
        for (int64_t h = 0; h < num_v_heads; h++) {
            int64_t kh = h / group;
            float *state = final_state + h * head_size;
            memcpy(state, rec_state + h * head_size, sizeof(float) * head_size);
            float *scratch = delta + h * head_v;
            head_recurrence(state, conv_out, conv_dim, kh * head_k, key_dim + kh * head_k, 2 * key_dim + h * head_v,
                            g + h, beta + h, num_v_heads, tokens, head_k, head_v, core + h * head_v, value_dim,
                            num_captures, capture_tokens, captured + h * head_size, num_v_heads * head_size,
                            scratch);
        }
    }
    return 0;
}
