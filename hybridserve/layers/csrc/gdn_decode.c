/* One fused decode step of a Gated DeltaNet layer for a batch of sequences (float32, CPU).
 *
 * Per sequence b (live state slot slots[b]) it does what the eager PyTorch path in
 * hybridserve/models/qwen3_5.py does with ~25 small ops, but reads the slot's recurrent state from
 * memory once and writes its successor once (delta_rule.h works through it in column blocks that
 * stay in L1 between its two passes):
 *   conv:   y = silu(sum_j w[c][j] * window[c][j]), window = conv state (K-1 inputs) then x;
 *   q, k:   l2-normalised per key head (q also scaled by head_k ** -0.5);
 *   gates:  decay = exp(-exp(A_log) * softplus(a + dt_bias)), beta = sigmoid(b);
 *   state:  S' = decay * S + k^T (beta * (v - k (decay * S))),  out = q S'.
 * With a norm weight, each head's output is then the GDN output norm, w * rms_norm(out) * silu(z),
 * with z read from the projection row at z_offset.
 * A slot outside [0, num_slots) fails the call (returns 2) before any state is touched.
 * With in_place = 0 the new conv windows and states go to out_conv / out_rec [B, ...] and live
 * state is only read (the caller commits them once the forward succeeded). With in_place = 1 the
 * live slots are updated and their previous contents go to out_conv / out_rec, the undo record the
 * caller restores if the forward fails: one pass over the state instead of a second copy.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "delta_rule.h"
#include "hybridserve_kernels.h"
#include "task_pool.h"
#include "vector_math.h"
#if defined(__AVX__)
#include <immintrin.h>
#endif

/* dst = src for an undo record, with non-temporal stores where dst is 64-byte aligned: the record
 * is read back only when a step fails, so writing it around the caches saves reading each of its
 * lines first and keeps the caches for the live state the delta rule reads next. Meanwhile the
 * matching lines of `prefetch` (the state this thread steps next; NULL: none) go into L2, so that
 * the next head does not wait for its state line by line (batch-16 GDN layers 0.94-0.96x the time
 * on the C harness). The caller fences (_mm_sfence) before the record may be read. */
static void copy_to_undo(float *dst, const float *src, int64_t n, const float *prefetch) {
#if defined(__AVX512F__)
    if (((uintptr_t)dst & 63) == 0 && n % 16 == 0) {
        for (int64_t i = 0; i < n; i += 16) {
            if (prefetch) _mm_prefetch((const char *)(prefetch + i), _MM_HINT_T1);
            _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
        }
        return;
    }
#elif defined(__AVX__)
    if (((uintptr_t)dst & 31) == 0 && n % 8 == 0) {
        for (int64_t i = 0; i < n; i += 8) {
            if (prefetch && i % 16 == 0) _mm_prefetch((const char *)(prefetch + i), _MM_HINT_T1);
            _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
        }
        return;
    }
#endif
    (void)prefetch;
    memcpy(dst, src, sizeof(float) * (size_t)n);
}

static inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

static void l2_normalize(float *x, int64_t n, float eps, float scale) {
    float sum = sum_of_squares(x, n);
    float factor = scale / sqrtf(sum + eps);
    for (int64_t i = 0; i < n; i++) x[i] *= factor;
}

#if defined(__AVX512F__)
/* conv_step for a kernel of 4 (a window of 3 inputs), 16 channels a step: the window's
 * [channel][3] and the weight's [channel][4] layouts are split into one vector per tap with
 * permutes; the successor window is the old one shifted by one element, x in every third place.
 * The same sums in the same order as the scalar loop (bit-identical). The scalar loop took ~5 us
 * a row of the built-in model's 1024 channels (a third of a batch-16 GDN layer); with this one
 * the layers took 0.85-0.87x the time (C harness, caches swept between steps). */
static void conv_step4_avx512(const float *x, const float *state, const float *weight, int64_t conv_dim, float *out,
                              float *next) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i x_at[3] = {_mm512_setr_epi32(0, 0, 0, 0, 0, 1, 0, 0, 2, 0, 0, 3, 0, 0, 4, 0),
                             _mm512_setr_epi32(0, 5, 0, 0, 6, 0, 0, 7, 0, 0, 8, 0, 0, 9, 0, 0),
                             _mm512_setr_epi32(10, 0, 0, 11, 0, 0, 12, 0, 0, 13, 0, 0, 14, 0, 0, 15)};
    const __mmask16 x_mask[3] = {0x4924, 0x2492, 0x9249};  /* window positions 3i + 2 in each vector */
    __m512i window_tap[3], weight_tap[4];
    __mmask16 in_third[3];  /* lanes whose window element lies in the third vector */
    for (int j = 0; j < 3; j++) {
        window_tap[j] = _mm512_add_epi32(_mm512_mullo_epi32(lane, _mm512_set1_epi32(3)), _mm512_set1_epi32(j));
        in_third[j] = _mm512_cmpge_epi32_mask(window_tap[j], _mm512_set1_epi32(32));
    }
    for (int j = 0; j < 4; j++) weight_tap[j] = _mm512_add_epi32(_mm512_slli_epi32(lane, 2), _mm512_set1_epi32(j));
    for (int64_t c = 0; c < conv_dim; c += 16) {
        const float *s = state + c * 3, *w = weight + c * 4;
        __m512 s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16), s2 = _mm512_loadu_ps(s + 32);
        __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16), w2 = _mm512_loadu_ps(w + 32);
        __m512 w3 = _mm512_loadu_ps(w + 48), xv = _mm512_loadu_ps(x + c), acc = _mm512_setzero_ps();
        for (int j = 0; j < 4; j++) {
            __m512 input = j < 3 ? _mm512_mask_permutexvar_ps(_mm512_permutex2var_ps(s0, window_tap[j], s1), in_third[j],
                                                              window_tap[j], s2)
                                 : xv;
            __m512 tap = _mm512_mask_mov_ps(_mm512_permutex2var_ps(w0, weight_tap[j], w1), 0xff00,
                                            _mm512_permutex2var_ps(w2, weight_tap[j], w3));
            acc = _mm512_fmadd_ps(input, tap, acc);
        }
        __m512 one = _mm512_set1_ps(1.0f);
        _mm512_storeu_ps(out + c, _mm512_div_ps(acc, _mm512_add_ps(one, exp16_ps(_mm512_sub_ps(_mm512_setzero_ps(), acc)))));
        __m512i i0 = _mm512_castps_si512(s0), i1 = _mm512_castps_si512(s1), i2 = _mm512_castps_si512(s2);
        __m512 shifted[3] = {_mm512_castsi512_ps(_mm512_alignr_epi32(i1, i0, 1)),
                             _mm512_castsi512_ps(_mm512_alignr_epi32(i2, i1, 1)),
                             _mm512_castsi512_ps(_mm512_alignr_epi32(i2, i2, 1))};
        for (int v = 0; v < 3; v++)
            _mm512_storeu_ps(next + c * 3 + 16 * v, _mm512_mask_permutexvar_ps(shifted[v], x_mask[v], x_at[v], xv));
    }
}
#endif

/* The conv of one sequence: SiLU(conv) to `out` [conv_dim]; the window shifted by x to `next`
 * (which may be `state` itself). */
static void conv_step(const float *x, const float *state, const float *weight, int64_t conv_dim, int64_t kernel,
                      float *out, float *next) {
    int64_t hist = kernel - 1;
#if defined(__AVX512F__)
    if (kernel == 4 && conv_dim % 16 == 0) {
        conv_step4_avx512(x, state, weight, conv_dim, out, next);
        return;
    }
#endif
    for (int64_t c = 0; c < conv_dim; c++) {
        const float *s = state + c * hist, *w = weight + c * kernel;
        float acc = 0.0f;
        for (int64_t j = 0; j < hist; j++) acc += s[j] * w[j];
        acc += x[c] * w[hist];
        out[c] = silu_f32(acc);
        float *n = next + c * hist;
        for (int64_t j = 0; j + 1 < hist; j++) n[j] = s[j + 1];
        n[hist - 1] = x[c];
    }
}

/* out *= w * silu(z) / sqrt(mean(out^2) + eps) over one head. */
static void gated_rms_norm(float *out, const float *z, const float *w, int64_t n, float eps) {
    float sum = sum_of_squares(out, n);
    float inv = 1.0f / sqrtf(sum / (float)n + eps);
    for (int64_t j = 0; j < n; j++) out[j] = out[j] * inv * w[j] * silu_f32(z[j]);
}

/* The conv of row b: SiLU(conv) and the l2-normalised q, k to conv_out; the slot's window advanced.
 * in_place: the slot is updated, its old window going first to conv_undo (NULL: not kept, a later
 * row of a run); otherwise the new window goes to conv_undo and the slot is only read. */
static void conv_row(const float *row, void *conv_slot, char *conv_undo, const float *conv_weight, int64_t conv_dim,
                     int64_t kernel, int64_t num_k_heads, int64_t head_k, float l2_eps, int in_place, int conv_bf16,
                     float *conv_out) {
    int64_t conv_size = conv_dim * (kernel - 1), key_dim = num_k_heads * head_k;
    size_t conv_bytes = conv_bf16 ? sizeof(uint16_t) : sizeof(float);
    if (in_place && conv_undo) memcpy(conv_undo, conv_slot, conv_bytes * conv_size);  /* the undo record */
    if (conv_bf16) {  /* widen the window, step it in float32, store the successor rounded */
        float *window = conv_out + conv_dim, *next = window + conv_size;
        for (int64_t i = 0; i < conv_size; i++) window[i] = bf16_to_f32(((const uint16_t *)conv_slot)[i]);
        conv_step(row, window, conv_weight, conv_dim, kernel, conv_out, next);
        for (int64_t i = 0; i < conv_size; i++) ((uint16_t *)conv_slot)[i] = f32_to_bf16(next[i]);
    } else if (!in_place) {
        conv_step(row, (const float *)conv_slot, conv_weight, conv_dim, kernel, conv_out, (float *)conv_undo);
    } else {  /* from the undo copy into the slot, or the slot stepped in place (conv_step allows it) */
        conv_step(row, (const float *)(conv_undo ? (void *)conv_undo : conv_slot), conv_weight, conv_dim, kernel,
                  conv_out, (float *)conv_slot);
    }
    float q_scale = 1.0f / sqrtf((float)head_k);
    for (int64_t h = 0; h < num_k_heads; h++) {
        l2_normalize(conv_out + h * head_k, head_k, l2_eps, q_scale);
        l2_normalize(conv_out + key_dim + h * head_k, head_k, l2_eps, 1.0f);
    }
}

/* One call's operands, shared by its tasks (see gdn_decode_step). */
typedef struct {
    const float *proj;
    int64_t proj_stride, b_offset, a_offset;
    const int64_t *slots;
    void *conv_live;
    float *rec_live;
    const float *conv_weight, *dt_bias, *neg_decay_rate;
    float l2_eps;
    const float *norm_weight;
    float norm_eps;
    int in_place, conv_bf16, heads_in_order;
    float *scratch;
    void *out_conv;
    float *out_rec, *core;
    const int64_t *run_start;
    int64_t num_captures;
    const int64_t *capture_rows;
    char *capture_conv;
    float *capture_rec;
    int64_t num_k_heads, num_v_heads, head_k, head_v, kernel, conv_dim, key_dim, group, conv_size, rec_size,
        head_size, scratch_row;
    size_t conv_bytes;
} GdnDecodeCall;

/* Which capture follows row b, or -1. */
static int64_t capture_after(const GdnDecodeCall *c, int64_t b) {
    for (int64_t i = 0; i < c->num_captures; i++)
        if (c->capture_rows[i] == b) return i;
    return -1;
}

/* The conv of every row of run r (the rows of one sequence, in order): its undo record (or, not in
 * place, its successor) at index r; windows after capture rows copied out. */
static void conv_run_task(void *context, int64_t r) {
    const GdnDecodeCall *c = context;
    size_t window_bytes = (size_t)c->conv_size * c->conv_bytes;
    for (int64_t b = c->run_start[r]; b < c->run_start[r + 1]; b++) {
        char *slot = (char *)c->conv_live + c->slots[b] * window_bytes;
        char *undo = b == c->run_start[r] ? (char *)c->out_conv + r * window_bytes : NULL;
        conv_row(c->proj + b * c->proj_stride, slot, undo, c->conv_weight, c->conv_dim, c->kernel, c->num_k_heads,
                 c->head_k, c->l2_eps, c->in_place, c->conv_bf16, c->scratch + b * c->scratch_row);
        int64_t capture = capture_after(c, b);
        if (capture >= 0) memcpy(c->capture_conv + capture * window_bytes, slot, window_bytes);
    }
}

/* Value head h of run r: its state advanced over the run's rows (the undo record, at index r,
 * first); its state after capture rows copied out. When this thread steps the run's heads in order
 * (heads_in_order), the next head's state is fetched meanwhile. */
static void head_run_task(void *context, int64_t task) {
    const GdnDecodeCall *c = context;
    int64_t r = task / c->num_v_heads, h = task % c->num_v_heads, kh = h / c->group, first = c->run_start[r];
    int64_t head_k = c->head_k, head_v = c->head_v, key_dim = c->key_dim;
    float *state = c->rec_live + c->slots[first] * c->rec_size + h * c->head_size;
    const float *next_head = c->heads_in_order && h + 1 < c->num_v_heads ? state + c->head_size : 0;
    if (c->in_place) copy_to_undo(c->out_rec + r * c->rec_size + h * c->head_size, state, c->head_size, next_head);
    for (int64_t b = first; b < c->run_start[r + 1]; b++) {
        const float *row = c->proj + b * c->proj_stride, *conv_out = c->scratch + b * c->scratch_row;
        float decay = expf(c->neg_decay_rate[h] * softplus(row[c->a_offset + h] + c->dt_bias[h]));
        float beta = sigmoid(row[c->b_offset + h]);
        float *next = c->in_place ? state : c->out_rec + b * c->rec_size + h * c->head_size;
        float *out = c->core + (b * c->num_v_heads + h) * head_v;
        delta_rule_head(state, next, conv_out + kh * head_k, conv_out + key_dim + kh * head_k,
                        conv_out + 2 * key_dim + h * head_v, decay, beta, head_k, head_v, out);
        if (c->norm_weight) gated_rms_norm(out, row + c->conv_dim + h * head_v, c->norm_weight, head_v, c->norm_eps);
        int64_t capture = capture_after(c, b);
        if (capture >= 0)
            memcpy(c->capture_rec + capture * c->rec_size + h * c->head_size, next, sizeof(float) * c->head_size);
    }
#if defined(__SSE__)
    _mm_sfence();  /* the undo record's streaming stores are visible before the caller reads it */
#endif
}

/* Sequence r whole, on one thread: its conv, then its value heads in order. */
static void sequence_task(void *context, int64_t r) {
    const GdnDecodeCall *c = context;
    conv_run_task(context, r);
    for (int64_t h = 0; h < c->num_v_heads; h++) head_run_task(context, r * c->num_v_heads + h);
}

/* proj rows hold [mixed (conv_dim), z (Hv*Dv), b (Hv), a (Hv)] (b and a at the given offsets);
 * norm_weight [Dv] or NULL; conv_live [num_slots, conv_dim, K-1] (float32, or bfloat16 with conv_bf16,
 * in place only), rec_live [num_slots, Hv, Dk, Dv]; core [B, Hv, Dv]; scratch [B, conv_dim] (the conv
 * output of each row), [B, conv_dim + 2 * conv_dim * (K-1)] with conv_bf16 (the window widened to
 * float32 and its successor); out_conv in conv_live's type.
 * Consecutive rows with the same slot are consecutive tokens of one sequence (a prompt chunk taken
 * in a decode step, in place only): they are stepped in order, and out_conv / out_rec [runs, ...]
 * hold each run's undo record (in place) or successor (not in place: one row per run). A slot may
 * not start two runs (returns 4). capture_conv / capture_rec [num_captures, ...] receive the state
 * just after row capture_rows[i], a row followed by one of its own run (else returns 5).
 * With one row per sequence (decode) each task is a sequence, its conv and then its heads: one
 * pass of the pool, and the conv's output still in the thread's cache for the heads (with the
 * vectorised conv, a batch of 16 over the built-in model's 6 GDN layers took 0.71x the time of a
 * conv pass then a head pass, on the C harness with the caches swept between steps). Otherwise
 * runs are stepped in parallel in a conv pass, then (run, value head) pairs in a state pass. */
int gdn_decode_step(int64_t batch, int64_t num_k_heads, int64_t num_v_heads, int64_t head_k, int64_t head_v,
                    int64_t kernel, const float *proj, int64_t proj_stride, int64_t b_offset, int64_t a_offset,
                    const int64_t *slots, int64_t num_slots, void *conv_live, float *rec_live,
                    const float *conv_weight, const float *dt_bias, const float *neg_decay_rate, float l2_eps,
                    const float *norm_weight, float norm_eps, int num_threads, int in_place, int conv_bf16,
                    float *scratch, void *out_conv, float *out_rec, float *core, int64_t num_captures,
                    const int64_t *capture_rows, void *capture_conv, float *capture_rec) {
    int64_t key_dim = num_k_heads * head_k, value_dim = num_v_heads * head_v;
    int64_t conv_dim = 2 * key_dim + value_dim, group = num_v_heads / num_k_heads;
    int64_t conv_size = conv_dim * (kernel - 1), rec_size = num_v_heads * head_k * head_v, head_size = head_k * head_v;
    if (conv_bf16 && !in_place) return 3;
    int64_t run_start[batch + 1], runs = 0;
    for (int64_t b = 0; b < batch; b++) {
        if (slots[b] < 0 || slots[b] >= num_slots) return 2;
        if (b > 0 && slots[b] == slots[b - 1]) continue;
        for (int64_t r = 0; r < runs; r++)
            if (slots[run_start[r]] == slots[b]) return 4;
        run_start[runs++] = b;
    }
    run_start[runs] = batch;
    if (runs < batch && !in_place) return 4;
    for (int64_t i = 0; i < num_captures; i++)
        if (capture_rows[i] < 0 || capture_rows[i] + 1 >= batch || slots[capture_rows[i] + 1] != slots[capture_rows[i]])
            return 5;
    size_t conv_bytes = conv_bf16 ? sizeof(uint16_t) : sizeof(float);
    int64_t scratch_row = conv_bf16 ? conv_dim + 2 * conv_size : conv_dim;
    GdnDecodeCall call = {proj, proj_stride, b_offset, a_offset, slots, conv_live, rec_live, conv_weight, dt_bias,
                          neg_decay_rate, l2_eps, norm_weight, norm_eps, in_place, conv_bf16, 0, scratch, out_conv,
                          out_rec, core, run_start, num_captures, capture_rows, capture_conv, capture_rec, num_k_heads,
                          num_v_heads, head_k, head_v, kernel, conv_dim, key_dim, group, conv_size, rec_size,
                          head_size, scratch_row, conv_bytes};
    int threads = batch > 1 ? num_threads : 1;
    unsigned int saved_csr = denormals_flush_begin();  /* the pool's workers keep it set */
    if (runs == batch && threads > 1) {
        call.heads_in_order = 1;
        task_pool_run(threads, sequence_task, &call, runs);
    } else {
        call.heads_in_order = threads == 1;
        task_pool_run(threads, conv_run_task, &call, runs);  /* every row's conv output is ready after it */
        task_pool_run(threads, head_run_task, &call, runs * num_v_heads);
    }
    denormals_flush_end(saved_csr);
    return 0;
}

/* The float32-state form, as the module path calls it. */
int gdn_decode_f32(int64_t batch, int64_t num_k_heads, int64_t num_v_heads, int64_t head_k, int64_t head_v,
                   int64_t kernel, const float *proj, int64_t proj_stride, int64_t b_offset, int64_t a_offset,
                   const int64_t *slots, int64_t num_slots, float *conv_live, float *rec_live,
                   const float *conv_weight, const float *dt_bias, const float *neg_decay_rate, float l2_eps,
                   const float *norm_weight, float norm_eps, int num_threads, int in_place, float *scratch,
                   float *out_conv, float *out_rec, float *core) {
    return gdn_decode_step(batch, num_k_heads, num_v_heads, head_k, head_v, kernel, proj, proj_stride, b_offset,
                           a_offset, slots, num_slots, conv_live, rec_live, conv_weight, dt_bias, neg_decay_rate,
                           l2_eps, norm_weight, norm_eps, num_threads, in_place, 0, scratch, out_conv, out_rec, core,
                           0, NULL, NULL, NULL);
}
