/* A prefill chunk of one sequence through a Gated DeltaNet layer, token by token (float32, CPU).
 *
 * The chunked form in gated_delta.py turns each 64-token chunk of delta-rule updates into matrix
 * products, which suits a GPU. On CPU its ~40 small ATen ops per chunk and the depthwise conv's
 * oneDNN call cost more than the arithmetic: the recurrence the decode kernel uses
 * (delta_rule.h), run one token after another with each value head's state held in cache, took
 * 0.07-0.22x the chunked form's time from 8 to 4160 tokens for the built-in model's layer (4 key /
 * 8 value heads of 64), and 0.15-0.34x for a 4B-sized layer (16 / 32 heads of 128) from 64 to
 * 2048 tokens (2-core AVX2 host, two threads, the same inputs alternated).
 *   conv:   y[t] = silu(sum_j w[c][j] * window[c][t + j]) over the window [conv state | inputs],
 *           read time-major (the projection rows themselves) so every loop runs along channels;
 *   q, k:   l2-normalised per key head (q also scaled by head_k ** -0.5);
 *   state:  S' = exp(g) * S + k^T (beta * (v - k (exp(g) * S))),  out = q S'.
 * Live state is only read: the final state goes to `final_state` and the state after
 * capture_tokens[i] tokens (1-based, any order) to captured[i], for the caller to commit once the
 * forward succeeded. A task is one key head: the conv of its q and k channels and of its value
 * heads' v channels over every token, then those value heads' recurrences, so a thread reads only
 * what it wrote and tasks never wait for each other. With the conv of all channels first, split by
 * token, and the recurrences after a barrier, two threads took as long as one (a 64-token chunk of
 * the built-in model: 282 against 244 us): each recurrence read conv rows from the other core's
 * cache, and the barrier waited for a worker that had gone to sleep.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "delta_rule.h"
#include "hybridserve_kernels.h"
#include "task_pool.h"
#include "vector_math.h"

static void normalize(float *x, int64_t n, float eps, float scale) {
    float sum = sum_of_squares(x, n);
    float factor = scale / sqrtf(sum + eps);
    for (int64_t i = 0; i < n; i++) x[i] *= factor;
}

/* The conv input at window position p (time-major): the conv state's column p (transposed into
 * history [K-1, conv_dim]) for p < K - 1, else the projection row of token p - (K - 1). */
static inline const float *conv_input(const float *history, const float *x, int64_t x_stride, int64_t conv_dim,
                                      int64_t hist, int64_t p) {
    return p < hist ? history + p * conv_dim : x + (p - hist) * x_stride;
}

/* out[c] = silu of token t's conv for channels c in [first, first + count), summed over the kernel
 * taps in order (as the decode kernel does); weight_t [K, conv_dim] is the weight transposed, so
 * every loop runs along channels. */
static void conv_channels(const float *history, const float *x, int64_t x_stride, const float *weight_t,
                          int64_t conv_dim, int64_t kernel, int64_t t, int64_t first, int64_t count, float *out) {
    for (int64_t c = 0; c < count; c++) out[c] = 0.0f;
    for (int64_t j = 0; j < kernel; j++) {
        const float *in = conv_input(history, x, x_stride, conv_dim, kernel - 1, t + j) + first;
        const float *w = weight_t + j * conv_dim + first;
        for (int64_t c = 0; c < count; c++) out[c] += in[c] * w[c];
    }
    for (int64_t c = 0; c < count; c++) out[c] = silu_f32(out[c]);
}

/* One value head over all tokens: state [dk, dv] advanced in place. */
static void head_recurrence(float *state, const float *conv_out, int64_t conv_dim, int64_t q_offset,
                            int64_t k_offset, int64_t v_offset, const float *g, const float *beta, int64_t gate_stride,
                            int64_t tokens, int64_t dk, int64_t dv, float *out, int64_t out_stride,
                            int64_t num_captures, const int64_t *capture_tokens, float *captured, int64_t capture_stride) {
    for (int64_t t = 0; t < tokens; t++) {
        const float *row = conv_out + t * conv_dim;
        delta_rule_head(state, state, row + q_offset, row + k_offset, row + v_offset, expf(g[t * gate_stride]),
                        beta[t * gate_stride], dk, dv, out + t * out_stride);
        for (int64_t c = 0; c < num_captures; c++)  /* a few per chunk at most */
            if (capture_tokens[c] == t + 1) memcpy(captured + c * capture_stride, state, sizeof(float) * dk * dv);
    }
}

/* One call's operands, shared by its tasks (a task is a key head). */
typedef struct {
    const float *x, *history, *weight_t, *g, *beta, *rec_state;
    const int64_t *capture_tokens;
    float *conv_out, *captured, *final_state, *core;
    int64_t x_stride, conv_dim, kernel, tokens, num_v_heads, head_k, head_v, group, num_captures;
    float l2_eps, q_scale;
} GdnPrefillCall;

/* Key head kh: the conv of its q and k channels and of its value heads' v channels over every
 * token, then those value heads' recurrences. */
static void key_head_task(void *context, int64_t kh) {
    const GdnPrefillCall *c = context;
    int64_t key_dim = (c->conv_dim - c->num_v_heads * c->head_v) / 2;
    int64_t head_k = c->head_k, head_v = c->head_v, group = c->group, head_size = head_k * head_v;
    int64_t q_first = kh * head_k, k_first = key_dim + kh * head_k, v_first = 2 * key_dim + kh * group * head_v;
    for (int64_t t = 0; t < c->tokens; t++) {
        float *row = c->conv_out + t * c->conv_dim;
        conv_channels(c->history, c->x, c->x_stride, c->weight_t, c->conv_dim, c->kernel, t, q_first, head_k,
                      row + q_first);
        conv_channels(c->history, c->x, c->x_stride, c->weight_t, c->conv_dim, c->kernel, t, k_first, head_k,
                      row + k_first);
        conv_channels(c->history, c->x, c->x_stride, c->weight_t, c->conv_dim, c->kernel, t, v_first, group * head_v,
                      row + v_first);
        normalize(row + q_first, head_k, c->l2_eps, c->q_scale);
        normalize(row + k_first, head_k, c->l2_eps, 1.0f);
    }
    for (int64_t h = kh * group; h < (kh + 1) * group; h++) {
        float *state = c->final_state + h * head_size;
        memcpy(state, c->rec_state + h * head_size, sizeof(float) * head_size);
        head_recurrence(state, c->conv_out, c->conv_dim, q_first, k_first, 2 * key_dim + h * head_v, c->g + h,
                        c->beta + h, c->num_v_heads, c->tokens, head_k, head_v, c->core + h * head_v,
                        c->num_v_heads * head_v, c->num_captures, c->capture_tokens, c->captured + h * head_size,
                        c->num_v_heads * head_size);
    }
}

/* x: the chunk's conv inputs, one row of conv_dim per token, rows x_stride apart (the in_proj
 * output); conv_state [conv_dim, K-1]; conv_weight [conv_dim, K]; g, beta [tokens, Hv] (log-decay and
 * beta); rec_state, final_state [Hv, Dk, Dv]; captured [num_captures, Hv, Dk, Dv]; scratch
 * [(2K - 1) * conv_dim + tokens * conv_dim] (transposed weight and conv state, the conv output);
 * core [tokens, Hv, Dv]. Returns 2 for a capture outside 1..tokens,
 * before anything is written. */
int gdn_prefill_f32(int64_t tokens, int64_t num_k_heads, int64_t num_v_heads, int64_t head_k, int64_t head_v,
                    int64_t kernel, const float *x, int64_t x_stride, const float *conv_state,
                    const float *conv_weight, const float *g, const float *beta, const float *rec_state, float l2_eps,
                    int64_t num_captures, const int64_t *capture_tokens, int num_threads, float *scratch,
                    float *captured, float *final_state, float *core) {
    int64_t key_dim = num_k_heads * head_k, value_dim = num_v_heads * head_v;
    int64_t conv_dim = 2 * key_dim + value_dim, hist = kernel - 1, group = num_v_heads / num_k_heads;
    float q_scale = 1.0f / sqrtf((float)head_k);
    for (int64_t i = 0; i < num_captures; i++)
        if (capture_tokens[i] < 1 || capture_tokens[i] > tokens) return 2;
    float *weight_t = scratch, *history = weight_t + kernel * conv_dim, *conv_out = history + hist * conv_dim;
    for (int64_t c = 0; c < conv_dim; c++) {
        for (int64_t j = 0; j < kernel; j++) weight_t[j * conv_dim + c] = conv_weight[c * kernel + j];
        for (int64_t j = 0; j < hist; j++) history[j * conv_dim + c] = conv_state[c * hist + j];
    }
    GdnPrefillCall call = {x, history, weight_t, g, beta, rec_state, capture_tokens, conv_out, captured, final_state,
                           core, x_stride, conv_dim, kernel, tokens, num_v_heads, head_k, head_v, group,
                           num_captures, l2_eps, q_scale};
    unsigned int saved_csr = denormals_flush_begin();  /* the pool's workers keep it set */
    task_pool_run(num_threads, key_head_task, &call, num_k_heads);
    denormals_flush_end(saved_csr);
    return 0;
}
