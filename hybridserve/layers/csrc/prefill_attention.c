/* Causal attention of a prompt chunk over its sequence's paged KV (float32 activations over
 * float32 KV, or bfloat16 KV widened a key block at a time for the fused step; AVX-512 only).
 *
 * A warm request prefills a suffix behind thousands of cached tokens. The eager path gathers every
 * key and value of the sequence from the paged cache into new tensors, builds a [T, prefix + T]
 * mask and runs torch's CPU flash attention, which applies the mask to every key block instead of
 * skipping the blocks it hides (docs/decisions.md has the figures). Here the keys and values are
 * read in place through the slot table, the mask is a bound per query, a query row skips every
 * key block past its bound, and each KV head's queries (its G query heads times a block of tokens)
 * share every key block while it is in L1.
 *
 * Per task (a KV head and a lane of token blocks, split_of; docs/cpu-kernels.md has the timings
 * behind these choices): the queries are scaled into a local copy; keys come in blocks of
 * ATT_KEYS, transposed in registers once per block; for each group of ATT_ROWS query rows the
 * scores of all ATT_KEYS keys are then broadcast FMAs into registers (dot-product tiles, as in
 * csrc/gemm_rows.c, spent a third of their instructions summing lanes at a head size of 64), then
 * an online softmax (running max and sum per row, the output rescaled when the max grows) and the
 * weighted values, ATT_VCHUNK floats of the head at a time, accumulated in registers over the key
 * block.
 */
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "hybridserve_kernels.h"
#include "task_pool.h"
#include "vector_math.h"

#define ATT_KEYS 64          /* keys per block */
#define ATT_ROWS 6           /* query rows per score tile */
#define ATT_VCHUNK 64        /* floats of the value head accumulated in registers at once */
#define ATT_MAX_TOKENS (1 << 20)  /* longest chunk taken */
#define ATT_SHORT_TOKENS 128 /* up to this many tokens a KV head's rows are split only to feed every thread */
#define ATT_LONG_BLOCK 64    /* tokens per block of a longer chunk (split_of) */
#define ATT_MAX_HEAD_DIM 256
#define ATT_MASKED -1e30f    /* a score that no real score reaches: its weight is set to 0 */

#if defined(__AVX512F__)
/* keys_t[d * ATT_KEYS + j] = key[j][d] for d < dim, j < ATT_KEYS: each 16 x 16 block of the key
 * block transposed in registers (unpack, shuffle, then 128-bit lane shuffles). */
static void transpose_keys(const float *const *key, int64_t dim, float *keys_t) {
    for (int j0 = 0; j0 < ATT_KEYS; j0 += 16)
        for (int64_t d0 = 0; d0 < dim; d0 += 16) {
            __m512 r[16], t[16], u[16], v[8], out[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(key[j0 + i] + d0);
            for (int i = 0; i < 8; i++) {
                t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
                t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
            }
            for (int i = 0; i < 4; i++) {  /* rows 4i..4i+3: u[4i + c] holds their column c (+4, +8, +12) */
                u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
                u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
                u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
                u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
            }
            for (int c = 0; c < 4; c++) {
                v[0] = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);
                v[1] = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
                v[2] = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
                v[3] = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
                out[c] = _mm512_shuffle_f32x4(v[0], v[2], 0x88);
                out[c + 8] = _mm512_shuffle_f32x4(v[0], v[2], 0xDD);
                out[c + 4] = _mm512_shuffle_f32x4(v[1], v[3], 0x88);
                out[c + 12] = _mm512_shuffle_f32x4(v[1], v[3], 0xDD);
            }
            for (int d = 0; d < 16; d++) _mm512_storeu_ps(keys_t + (d0 + d) * ATT_KEYS + j0, out[d]);
        }
}

/* scores[r * ATT_KEYS + j] = dot(q + r * dim, key j) for r < rows and all ATT_KEYS keys of the
 * block, from the transposed block: each q element broadcast against 64 keys, no reductions. */
static inline __attribute__((always_inline)) void score_rows(const float *q, int64_t dim, const float *keys_t,
                                                              int rows, float *scores) {
    __m512 acc[ATT_ROWS][ATT_KEYS / 16];
    for (int r = 0; r < ATT_ROWS; r++)
        for (int c = 0; c < ATT_KEYS / 16; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d++) {
        __m512 k[ATT_KEYS / 16];
        for (int c = 0; c < ATT_KEYS / 16; c++) k[c] = _mm512_loadu_ps(keys_t + d * ATT_KEYS + 16 * c);
        for (int r = 0; r < rows; r++) {
            __m512 qv = _mm512_set1_ps(q[r * dim + d]);
            for (int c = 0; c < ATT_KEYS / 16; c++) acc[r][c] = _mm512_fmadd_ps(qv, k[c], acc[r][c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < ATT_KEYS / 16; c++) _mm512_storeu_ps(scores + r * ATT_KEYS + 16 * c, acc[r][c]);
}

/* out[r] = out[r] * rescale[r] + sum_j weights[r][j] * value[j] over ATT_VCHUNK floats from
 * `offset`, for r < rows (a constant at each call site) and j < keys. */
static inline __attribute__((always_inline)) void value_chunk(float *out, int64_t dim, const float *const *value,
                                                               int keys, const float *weights, const float *rescale,
                                                               int rows, int64_t offset) {
    __m512 acc[ATT_ROWS][ATT_VCHUNK / 16];
    for (int r = 0; r < rows; r++) {
        __m512 s = _mm512_set1_ps(rescale[r]);
        for (int c = 0; c < ATT_VCHUNK / 16; c++)
            acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(out + r * dim + offset + 16 * c), s);
    }
    for (int j = 0; j < keys; j++) {
        __m512 v[ATT_VCHUNK / 16];
        for (int c = 0; c < ATT_VCHUNK / 16; c++) v[c] = _mm512_loadu_ps(value[j] + offset + 16 * c);
        for (int r = 0; r < rows; r++) {
            __m512 w = _mm512_set1_ps(weights[r * ATT_KEYS + j]);
            for (int c = 0; c < ATT_VCHUNK / 16; c++) acc[r][c] = _mm512_fmadd_ps(w, v[c], acc[r][c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < ATT_VCHUNK / 16; c++) _mm512_storeu_ps(out + r * dim + offset + 16 * c, acc[r][c]);
}

/* One key block for `rows` query rows: scores, the online softmax update of each row's running
 * max `m` and sum `l`, and the weighted values into `out`. Key j (< ATT_KEYS; pointers padded past
 * `keys`) is the sequence's key j0 + j; row r sees keys up to limit[r]. */
static inline __attribute__((always_inline)) void key_block_rows(const float *q, float *out, float *m, float *l,
                                                                  const int64_t *limit, int64_t dim, int64_t j0,
                                                                  int keys, const float *keys_t,
                                                                  const float *const *value, int rows) {
    float scores[ATT_ROWS * ATT_KEYS], rescale[ATT_ROWS];
    score_rows(q, dim, keys_t, rows, scores);  /* padded keys: masked below */
    for (int r = 0; r < rows; r++) {
        float *s = scores + r * ATT_KEYS;
        int64_t visible = limit[r] - j0 + 1 < keys ? limit[r] - j0 + 1 : keys;
        __m512 block_max = _mm512_set1_ps(ATT_MASKED);
        __mmask16 lanes[ATT_KEYS / 16];
        for (int c = 0; c < ATT_KEYS / 16; c++) {
            int64_t n = visible - 16 * c;
            lanes[c] = n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
            block_max = _mm512_mask_max_ps(block_max, lanes[c], block_max, _mm512_loadu_ps(s + 16 * c));
        }
        float top = _mm512_reduce_max_ps(block_max);
        float new_max = top > m[r] ? top : m[r];
        __m512 sum = _mm512_setzero_ps(), shift = _mm512_set1_ps(new_max);
        for (int c = 0; c < ATT_KEYS / 16; c++) {
            __m512 p = _mm512_maskz_mov_ps(lanes[c], exp16_ps(_mm512_sub_ps(_mm512_loadu_ps(s + 16 * c), shift)));
            _mm512_storeu_ps(s + 16 * c, p);
            sum = _mm512_add_ps(sum, p);
        }
        rescale[r] = exp_f32(m[r] - new_max);
        l[r] = l[r] * rescale[r] + _mm512_reduce_add_ps(sum);
        m[r] = new_max;
    }
    for (int64_t offset = 0; offset < dim; offset += ATT_VCHUNK)
        value_chunk(out, dim, value, keys, scores, rescale, rows, offset);
}

static void task_rows(const float *q, float *out, float *m, float *l, const int64_t *limit, int64_t dim, int64_t j0,
                      int keys, const float *keys_t, const float *const *value, int rows) {
    switch (rows) {  /* constant counts: the tiles unroll */
        case 1: key_block_rows(q, out, m, l, limit, dim, j0, keys, keys_t, value, 1); break;
        case 2: key_block_rows(q, out, m, l, limit, dim, j0, keys, keys_t, value, 2); break;
        case 3: key_block_rows(q, out, m, l, limit, dim, j0, keys, keys_t, value, 3); break;
        case 4: key_block_rows(q, out, m, l, limit, dim, j0, keys, keys_t, value, 4); break;
        case 5: key_block_rows(q, out, m, l, limit, dim, j0, keys, keys_t, value, 5); break;
        default: key_block_rows(q, out, m, l, limit, dim, j0, keys, keys_t, value, ATT_ROWS); break;
    }
}

/* Floats of scratch a task of `rows` query rows uses: its scaled queries, its output sums, the
 * running max and sum of each row, the bound of each row (int64), a transposed key block, and a
 * block of keys and one of values widened from bfloat16. */
static int64_t task_scratch_floats(int64_t rows, int64_t dim) {
    return 2 * rows * dim + 4 * rows + 3 * dim * ATT_KEYS;
}

/* rows[j] = widened[j] = the bfloat16 row rows[j] (dim elements) as float32, for j < ATT_KEYS. */
static void widen_rows(const float **rows, int64_t dim, float *widened) {
    for (int j = 0; j < ATT_KEYS; j++) {
        const uint16_t *row = (const uint16_t *)(const void *)rows[j];
        for (int64_t d = 0; d < dim; d++) widened[j * dim + d] = bf16_to_f32(row[d]);
        rows[j] = widened + j * dim;
    }
}

/* Tokens [t0, t1) of KV head g: its G query heads per token as rows, every visible key; `scratch`
 * holds task_scratch_floats(rows, dim). Keys and values are float32, or bfloat16 (kv_bf16: each
 * block of them widened once, for all the task's rows). */
static void attention_task(const float *q, int64_t heads, int64_t dim, int64_t ld_q, const void *keys,
                           const void *values, int kv_bf16, int64_t kv_heads, const int64_t *slots,
                           int64_t num_prefix, float scale, float *out, int64_t g, int64_t t0, int64_t t1,
                           float *scratch) {
    int64_t group = heads / kv_heads, rows = (t1 - t0) * group;
    int64_t *limit = (int64_t *)scratch;
    float *qs = scratch + 2 * rows, *acc = qs + rows * dim, *m = acc + rows * dim, *l = m + rows, *keys_t = l + rows;
    float *wide_keys = keys_t + dim * ATT_KEYS, *wide_values = wide_keys + dim * ATT_KEYS;
    size_t element = kv_bf16 ? sizeof(uint16_t) : sizeof(float);
    for (int64_t i = 0; i < rows; i++) {
        int64_t t = t0 + i / group, h = g * group + i % group;
        for (int64_t d = 0; d < dim; d++) {
            qs[i * dim + d] = q[t * ld_q + h * dim + d] * scale;
            acc[i * dim + d] = 0.0f;
        }
        m[i] = ATT_MASKED;
        l[i] = 0.0f;
        limit[i] = num_prefix + t;
    }
    const float *key[ATT_KEYS], *value[ATT_KEYS];
    for (int64_t j0 = 0; j0 < num_prefix + t1; j0 += ATT_KEYS) {
        int count = (int)(num_prefix + t1 - j0 < ATT_KEYS ? num_prefix + t1 - j0 : ATT_KEYS);
        for (int j = 0; j < ATT_KEYS; j++) {  /* past the end: a valid key, its weight is 0 */
            int64_t slot = slots[j0 + (j < count ? j : 0)];
            key[j] = (const float *)(const void *)((const char *)keys + (slot * kv_heads + g) * dim * element);
            value[j] = (const float *)(const void *)((const char *)values + (slot * kv_heads + g) * dim * element);
        }
        if (kv_bf16) {
            widen_rows(key, dim, wide_keys);
            widen_rows(value, dim, wide_values);
        }
        transpose_keys(key, dim, keys_t);
        /* rows are in token order, so their bounds rise: rows whose bound is before this block
         * see none of it and are skipped (the causal triangle of the chunk's own keys) */
        int64_t first_row = (j0 - num_prefix - t0) * group;
        for (int64_t r = first_row > 0 ? first_row : 0; r < rows; r += ATT_ROWS) {
            int n = (int)(rows - r < ATT_ROWS ? rows - r : ATT_ROWS);
            task_rows(qs + r * dim, acc + r * dim, m + r, l + r, limit + r, dim, j0, count, keys_t, value, n);
        }
    }
    for (int64_t i = 0; i < rows; i++) {
        int64_t t = t0 + i / group, h = g * group + i % group;
        float inverse = 1.0f / l[i];
        for (int64_t d = 0; d < dim; d++) out[(t * heads + h) * dim + d] = acc[i * dim + d] * inverse;
    }
}

/* How a call splits its work: each task is a KV head and a lane, and lane k of a head attends
 * its token blocks k, k + lanes, ... one after another in the task's scratch. */
typedef struct {
    int64_t token_block, lanes;
} AttentionSplit;

/* A short chunk: as few tasks as give every thread one, a token block each (each task transposes
 * every key block once, so fewer, larger token blocks do less of it and share each key and value
 * block among more rows). A longer one: blocks of ATT_LONG_BLOCK tokens, dealt round-robin to
 * as many lanes per head, so each lane gets early (short) and late (long) blocks alike and the
 * scratch stays that of a few blocks however long the chunk is. */
static AttentionSplit split_of(int64_t tokens, int64_t kv_heads, int threads) {
    int64_t per_head = threads > kv_heads ? (threads + kv_heads - 1) / kv_heads : 1;
    int64_t block = tokens > ATT_SHORT_TOKENS ? ATT_LONG_BLOCK : (tokens + per_head - 1) / per_head;
    int64_t blocks = (tokens + block - 1) / block;
    return (AttentionSplit){block, blocks < per_head ? blocks : per_head};
}

/* One call's operands, shared by its tasks. */
typedef struct {
    const float *q;
    const void *keys, *values;
    int kv_bf16;
    const int64_t *slots;
    float *out, *scratch;
    int64_t tokens, heads, dim, ld_q, kv_heads, num_prefix, task_scratch;
    AttentionSplit split;
    float scale;
} AttentionCall;

static void attention_pool_task(void *context, int64_t task) {
    const AttentionCall *c = context;
    int64_t g = task % c->kv_heads, lane = task / c->kv_heads, block = c->split.token_block;
    for (int64_t t0 = lane * block; t0 < c->tokens; t0 += c->split.lanes * block) {
        int64_t t1 = t0 + block < c->tokens ? t0 + block : c->tokens;
        attention_task(c->q, c->heads, c->dim, c->ld_q, c->keys, c->values, c->kv_bf16, c->kv_heads, c->slots,
                       c->num_prefix, c->scale, c->out, g, t0, t1, c->scratch + task * c->task_scratch);
    }
}

static int shape_taken(int64_t tokens, int64_t heads, int64_t dim, int64_t kv_heads) {
    return tokens >= 1 && tokens <= ATT_MAX_TOKENS && dim >= 16 && dim % ATT_VCHUNK == 0 && dim <= ATT_MAX_HEAD_DIM
           && kv_heads >= 1 && heads % kv_heads == 0;
}
#endif

/* The longest chunk (query tokens) this build takes: ATT_MAX_TOKENS with AVX-512, 0 otherwise. */
int prefill_attention_max_tokens(void) {
#if defined(__AVX512F__)
    return ATT_MAX_TOKENS;
#else
    return 0;
#endif
}

/* Floats of scratch prefill_attention_f32_scratch needs for this shape and thread count; 0 when
 * this build does not take the shape. */
int64_t prefill_attention_scratch_floats(int64_t tokens, int64_t heads, int64_t dim, int64_t kv_heads, int threads) {
#if defined(__AVX512F__)
    if (!shape_taken(tokens, heads, dim, kv_heads)) return 0;
    AttentionSplit split = split_of(tokens, kv_heads, threads);
    return kv_heads * split.lanes * task_scratch_floats(split.token_block * (heads / kv_heads), dim);
#else
    (void)tokens; (void)heads; (void)dim; (void)kv_heads; (void)threads;
    return 0;
#endif
}

/* prefill_attention_f32 with the caller's scratch (prefill_attention_scratch_floats of it, for the
 * same `threads`), over float32 or (kv_bf16) bfloat16 keys and values: the fused decode step
 * (decode_step.c) attends a chunk's rows with it, its scratch carved from the step's workspace
 * before anything is written. Returns 1 (nothing written) for shapes this build does not take. */
int prefill_attention_f32_scratch(const float *q, int64_t tokens, int64_t heads, int64_t dim, int64_t ld_q,
                                  const void *keys, const void *values, int kv_bf16, int64_t kv_heads,
                                  const int64_t *slots, int64_t num_prefix, float scale, float *out, int threads,
                                  float *scratch) {
#if defined(__AVX512F__)
    if (!shape_taken(tokens, heads, dim, kv_heads) || num_prefix < 0) return 1;
    AttentionSplit split = split_of(tokens, kv_heads, threads);
    AttentionCall call = {q, keys, values, kv_bf16, slots, out, scratch, tokens, heads, dim, ld_q, kv_heads,
                          num_prefix, task_scratch_floats(split.token_block * (heads / kv_heads), dim), split, scale};
    unsigned int saved_csr = denormals_flush_begin();  /* the pool's workers keep it set */
    task_pool_run(threads, attention_pool_task, &call, kv_heads * split.lanes);
    denormals_flush_end(saved_csr);
    return 0;
#else
    (void)q; (void)tokens; (void)heads; (void)dim; (void)ld_q; (void)keys; (void)values; (void)kv_bf16;
    (void)kv_heads; (void)slots; (void)num_prefix; (void)scale; (void)out; (void)threads; (void)scratch;
    return 1;
#endif
}

/* Causal attention of `tokens` queries at positions num_prefix .. num_prefix + tokens - 1 over keys
 * 0 .. num_prefix + tokens - 1 of one sequence. q [tokens, heads, dim] with token stride ld_q (heads
 * contiguous); keys / values: one layer of the paged cache, [slots, kv_heads, dim] contiguous;
 * slots [num_prefix + tokens] the flat slot of each key; out [tokens, heads, dim] contiguous.
 * Returns 1 (nothing written) for shapes this build does not take, 2 if scratch memory ran out. */
int prefill_attention_f32(const float *q, int64_t tokens, int64_t heads, int64_t dim, int64_t ld_q,
                          const float *keys, const float *values, int64_t kv_heads, const int64_t *slots,
                          int64_t num_prefix, float scale, float *out, int threads) {
    int64_t floats = prefill_attention_scratch_floats(tokens, heads, dim, kv_heads, threads);
    if (floats == 0 || num_prefix < 0) return 1;
    float *scratch = malloc((size_t)floats * sizeof(float));
    if (scratch == NULL) return 2;
    int status = prefill_attention_f32_scratch(q, tokens, heads, dim, ld_q, keys, values, 0, kv_heads, slots,
                                               num_prefix, scale, out, threads, scratch);
    free(scratch);
    return status;
}
