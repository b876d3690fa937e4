/* The whole decode forward of a model on CPU in one call: embeddings, every decoder layer (GDN or
 * gated attention, then the MLP), the final norm and the LM head, for up to 512 rows (decode rows
 * and prompt chunks, see hybridserve/models/fused_decode.py); float32 models (float32 or int8
 * linears) and bfloat16 ones (bfloat16 weights, KV and conv state, widened to float32 as they are
 * read: every activation stays float32).
 *
 * After the GEMV and the fused layer kernels, most of a decode step outside the linears was the
 * module path's own overhead: many small PyTorch ops and module calls, each costing more than its
 * arithmetic (figures in docs/cpu-kernels.md). Here the same work runs as straight C: it calls the kernels the module path calls
 * (gemv_f32 / gemv_i8 / gemm_rows, rms_norm_f32, rms_norm_rope_f32, gdn_decode_f32) in the same
 * order, adds the decode attention over the paged KV (a chunk of 8 or more rows takes
 * prefill_attention.c's chunk attention), and does the small elementwise steps inline. It is the
 * CPU counterpart of replaying a captured CUDA graph: the Python side only passes the step's token
 * ids, positions, slots and buffers.
 *
 * Every index is checked before anything is written, so a bad input fails the call with nothing
 * changed. GDN layers update their live state slots in place, the replaced state going to the
 * undo buffers (as gdn_decode_f32's in-place mode does on the module path).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "hybridserve_kernels.h"
#include "task_pool.h"
#include "vector_math.h"
#if defined(__AVX__)
#include <immintrin.h>
#endif

#define DECODE_STEP_MAX_ROWS 512  /* rows of one step */
#define GEMM_PIECE_ROWS 128  /* the most rows the tile GEMM takes at once (more go in even pieces) */
#define GEMV_MAX_ROWS 32     /* and the GEMV */
#define CHUNK_ATTENTION_MIN_ROWS 8  /* a chunk's rows from this many attend with prefill_attention.c, */
#define CHUNK_PIECE_ROWS 128        /* up to this many at once */

typedef struct {
    float *x, *h, *proj, *core, *mlp, *act, *gdn_scratch, *q, *k, *cos, *sin, *scores, *max_scores, *kv_rows;
    float *chunk_scratch;        /* prefill_attention's scratch for the longest chunk */
    int64_t *attention_rows;     /* the rows the decode attention takes in one layer */
    int64_t *chunk_slots;        /* a chunk's KV slot of each context position */
} Workspace;

/* The step's runs: rows [start[r], start[r + 1]) are one sequence's consecutive tokens. */
typedef struct {
    int64_t count, start[DECODE_STEP_MAX_ROWS + 1];
} Runs;

static void find_runs(const int64_t *state_slots, int64_t batch, Runs *runs) {
    runs->count = 0;
    for (int64_t b = 0; b < batch; b++)
        if (b == 0 || state_slots[b] != state_slots[b - 1]) runs->start[runs->count++] = b;
    runs->start[runs->count] = batch;
}

static int64_t run_length(const Runs *runs, int64_t r) { return runs->start[r + 1] - runs->start[r]; }

static int64_t conv_dim_of(const DecodeModel *m) {
    return 2 * m->num_k_heads * m->head_k + m->num_v_heads * m->head_v;
}

static int64_t widest_projection(const DecodeModel *m) {
    int64_t widest = 0;
    for (int64_t l = 0; l < m->num_layers; l++)
        if (m->layers[l].mixer_in_features > widest) widest = m->layers[l].mixer_in_features;
    return widest;
}

static int64_t widest_core(const DecodeModel *m) {
    int64_t gdn = m->num_v_heads * m->head_v, attention = m->heads * m->head_dim;
    return gdn > attention ? gdn : attention;
}

/* The size of each of the fewest even pieces of at most `bound` rows that `rows` splits into. */
static int64_t piece_rows(int64_t rows, int64_t bound) {
    int64_t pieces = (rows + bound - 1) / bound;
    return (rows + pieces - 1) / pieces;
}

/* prefill_attention_scratch_floats for a chunk of `rows` rows (attended in pieces), or 0 where such
 * a chunk takes the decode attention: too short, or a shape (or build) prefill_attention.c does
 * not take. */
static int64_t chunk_attention_scratch(const DecodeModel *m, int64_t rows, int threads) {
    if (rows < CHUNK_ATTENTION_MIN_ROWS) return 0;
    return prefill_attention_scratch_floats(piece_rows(rows, CHUNK_PIECE_ROWS), m->heads, m->head_dim, m->kv_heads,
                                            threads);
}

/* Carves the workspace; returns the floats it needs (buffer may be NULL to only count). The decode
 * attention's scores are sized for the rows it takes: those of the runs too short for the chunk
 * attention, and one row of each longer run (the last layer attends only the logit rows). */
static int64_t layout(const DecodeModel *m, int64_t batch, const Runs *runs, int64_t max_context, int threads,
                      float *buffer, Workspace *w) {
    int64_t conv_window = conv_dim_of(m) * (m->conv_kernel - 1), attention_rows = 0, chunk_scratch = 0;
    for (int64_t r = 0; r < runs->count; r++) {
        int64_t scratch = chunk_attention_scratch(m, run_length(runs, r), threads);
        attention_rows += scratch > 0 ? 1 : run_length(runs, r);
        chunk_scratch = scratch > chunk_scratch ? scratch : chunk_scratch;
    }
    int64_t sizes[17] = {
        batch * m->hidden, batch * m->hidden, batch * widest_projection(m), batch * widest_core(m),
        batch * 2 * m->intermediate, batch * m->intermediate, batch * (conv_dim_of(m) + 2 * conv_window),
        batch * m->heads * m->head_dim, batch * m->kv_heads * m->head_dim, batch * m->rot, batch * m->rot,
        attention_rows * m->heads * max_context, attention_rows * m->heads,
        attention_rows * m->kv_heads * 16 * m->head_dim, chunk_scratch, 2 * batch, 2 * max_context,
    };
    float **parts[15] = {&w->x, &w->h, &w->proj, &w->core, &w->mlp, &w->act, &w->gdn_scratch, &w->q, &w->k,
                         &w->cos, &w->sin, &w->scores, &w->max_scores, &w->kv_rows, &w->chunk_scratch};
    int64_t total = 0;
    for (int i = 0; i < 17; i++) {
        if (buffer && i < 15) *parts[i] = buffer + total;
        if (buffer && i == 15) w->attention_rows = (int64_t *)(buffer + total);
        if (buffer && i == 16) w->chunk_slots = (int64_t *)(buffer + total);
        total += (sizes[i] + 15) & ~(int64_t)15;  /* 64-byte aligned parts */
    }
    return total;
}

/* Floats of workspace a step of these rows needs (state_slots as decode_step_f32 takes them, with
 * the same threads). */
int64_t decode_step_workspace_floats(const DecodeModel *m, int64_t batch, const int64_t *state_slots,
                                     int64_t max_context, int threads) {
    if (batch < 1 || batch > DECODE_STEP_MAX_ROWS) return 0;
    Workspace unused;
    Runs runs;
    find_runs(state_slots, batch, &runs);
    return layout(m, batch, &runs, max_context, threads, NULL, &unused);
}

static int inputs_valid(const DecodeModel *m, int64_t batch, const int64_t *tokens, const int64_t *positions,
                        const int64_t *state_slots, const int64_t *kv_write_slots, const int64_t *block_tables,
                        int64_t ld_tables, int64_t block_size, int64_t max_context, int64_t num_logit_rows,
                        const int64_t *logit_rows) {
    if (batch < 1 || batch > DECODE_STEP_MAX_ROWS || block_size < 1 || num_logit_rows < 0 || num_logit_rows > batch)
        return 0;
    for (int64_t i = 0; i < num_logit_rows; i++) {  /* ascending rows of the batch, each the end of its run */
        int64_t row = logit_rows[i];
        if (row >= batch || row < (i > 0 ? logit_rows[i - 1] + 1 : 0)) return 0;
        if (row + 1 < batch && state_slots[row + 1] == state_slots[row]) return 0;
    }
    for (int64_t b = 0; b < batch; b++) {
        if (b > 0 && state_slots[b] == state_slots[b - 1] && positions[b] != positions[b - 1] + 1)
            return 0;  /* a run of one sequence's rows is consecutive tokens */
        int64_t length = positions[b] + 1;
        if (tokens[b] < 0 || tokens[b] >= m->vocab || positions[b] < 0 || positions[b] >= m->max_positions
            || length > max_context || (length + block_size - 1) / block_size > ld_tables
            || state_slots[b] < 0 || state_slots[b] >= m->num_state_slots
            || kv_write_slots[b] < 0 || kv_write_slots[b] >= m->num_kv_slots)
            return 0;
        for (int64_t i = 0; i * block_size < length; i++) {
            int64_t block = block_tables[b * ld_tables + i];
            if (block < 0 || (block + 1) * block_size > m->num_kv_slots) return 0;
        }
    }
    Runs runs;
    find_runs(state_slots, batch, &runs);
    for (int64_t r = 1; r < runs.count; r++)  /* a slot's rows form one run */
        for (int64_t q = 0; q < r; q++)
            if (state_slots[runs.start[q]] == state_slots[runs.start[r]]) return 0;
    return 1;
}

/* y [rows, out] = x [rows, in] @ W.T for at most GEMV_MAX_ROWS rows, on the GEMV. */
static void gemv(Linear w, int64_t out, int64_t in, const float *x, int64_t rows, float *y, int threads) {
    if (w.format == WEIGHT_I8)
        gemv_i8((const int8_t *)w.weight, w.scales, out, in, x, rows, in, y, out, threads);
    else if (w.format == WEIGHT_BF16)
        gemv_bf16((const uint16_t *)w.weight, out, in, x, rows, in, y, out, threads);
    else
        gemv_f32((const float *)w.weight, out, in, x, rows, in, y, out, threads);
}

/* The most rows one GEMM call takes for this weight: the tile GEMM's 128 (float32, int8), or the
 * AMX tiles' 32 for bfloat16 (and the GEMV's 32 where there are no tiles). */
static int64_t gemm_piece_bound(Linear w) { return w.format == WEIGHT_BF16 ? GEMV_MAX_ROWS : GEMM_PIECE_ROWS; }

/* y [rows, out] = x [rows, in] @ W.T, both contiguous, in even pieces of at most gemm_piece_bound
 * rows: on the tile GEMM for the rows it takes (gemm_rows.c, as the module path's linears: float32
 * and int8 weights, and int8 and bfloat16 ones on AMX tiles where the CPU has them), else the GEMV,
 * up to GEMV_MAX_ROWS rows a pass. */
static void linear(Linear w, int64_t out, int64_t in, const float *x, int64_t rows, float *y, int threads) {
    int64_t piece = rows > 0 ? piece_rows(rows, gemm_piece_bound(w)) : 1;
    for (int64_t p = 0; p < rows; p += piece) {
        int64_t n = rows - p < piece ? rows - p : piece;
        if (!gemm_rows(w.weight, w.scales, (int)w.format, out, in, x + p * in, n, in, y + p * out, out, threads))
            continue;
        for (int64_t r = p; r < p + n; r += GEMV_MAX_ROWS)
            gemv(w, out, in, x + r * in, p + n - r < GEMV_MAX_ROWS ? p + n - r : GEMV_MAX_ROWS, y + r * out, threads);
    }
}

/* Row `row` ([n] wide) of a float32 or bfloat16 table, as float32. */
static void read_row(const void *table, int64_t row, int64_t n, int bf16, float *dst) {
    if (bf16)
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(((const uint16_t *)table)[row * n + i]);
    else
        memcpy(dst, (const float *)table + row * n, sizeof(float) * n);
}

/* Row `row` of a table as float32: the row itself for a float32 table, else widened into `buffer`. */
static const float *row_as_f32(const void *table, int64_t row, int64_t n, int bf16, float *buffer) {
    if (!bf16) return (const float *)table + row * n;
    read_row(table, row, n, 1, buffer);
    return buffer;
}

static void write_row(void *table, int64_t row, int64_t n, int bf16, const float *src) {
    if (bf16)
        for (int64_t i = 0; i < n; i++) ((uint16_t *)table)[row * n + i] = f32_to_bf16(src[i]);
    else
        memcpy((float *)table + row * n, src, sizeof(float) * n);
}

static void add_rows(float *x, const float *h, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] += h[i];
}

typedef float v8f __attribute__((vector_size(32)));

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float dot(const float *a, const float *b, int64_t n) {
    v8f acc = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc += load8(a + i) * load8(b + i);
    float s = 0.0f;
    for (int k = 0; k < 8; k++) s += acc[k];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* v[t] = the sum of the lanes of acc[t], for 8 vectors at once (a transpose by horizontal adds). */
static inline v8f sum_lanes8(const v8f acc[8]) {
#if defined(__AVX__)
    __m256 a[8];
    memcpy(a, acc, sizeof a);
    __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
    v8f v;
    memcpy(&v, &sums, sizeof v);
    return v;
#else
    v8f v;
    for (int t = 0; t < 8; t++) {
        float sum = 0.0f;
        for (int k = 0; k < 8; k++) sum += acc[t][k];
        v[t] = sum;
    }
    return v;
#endif
}

/* rows[t]: the cached key or value row (`storage`) of context position j + t for one KV head, read
 * through the block table (bf16 rows widened into buffer + t * head_dim). */
static void context_rows8(const DecodeModel *m, const void *storage, int64_t layer_rows, int64_t kv_head,
                          const int64_t *table, int64_t block_size, int64_t j, float *buffer, const float *rows[8]) {
    for (int64_t t = 0; t < 8; t++) {
        int64_t position = j + t, slot = table[position / block_size] * block_size + position % block_size;
        rows[t] = row_as_f32(storage, layer_rows + slot * m->kv_heads + kv_head, m->head_dim, (int)m->bf16_storage,
                             buffer + t * m->head_dim);
    }
}

/* Scores of 8 consecutive context positions [j, j + 8) against the group's query heads (dim a
 * multiple of 8): the 8 key rows are read once for all heads, and each head's 8 dot products are
 * summed together (a prompt chunk's rows attend over long contexts, where per-key dot products,
 * each with its own lane sum, were the step's largest cost: docs/cpu-kernels.md). */
static void scores_block8(const DecodeModel *m, int64_t layer_rows, int64_t kv_head, const int64_t *table,
                          int64_t block_size, int64_t j, int64_t group, int64_t first_head, int64_t first_score,
                          float *key_buffer, Workspace *w, int64_t max_context) {
    int64_t dim = m->head_dim;
    const float *keys[8];
    context_rows8(m, m->keys, layer_rows, kv_head, table, block_size, j, key_buffer, keys);
    for (int64_t g = 0; g < group; g++) {
        const float *q = w->q + (first_head + g) * dim;
        v8f acc[8] = {{0}};
        for (int64_t d = 0; d < dim; d += 8) {
            v8f qv = load8(q + d);
            for (int t = 0; t < 8; t++) acc[t] += qv * load8(keys[t] + d);
        }
        v8f scores = sum_lanes8(acc) * m->attn_scale;
        float *row = w->scores + (first_score + g) * max_context + j, top = w->max_scores[first_score + g];
        memcpy(row, &scores, sizeof scores);
        for (int t = 0; t < 8; t++) top = scores[t] > top ? scores[t] : top;
        w->max_scores[first_score + g] = top;
    }
}

/* core += p V over 8 consecutive context positions [j, j + 8) for the group's heads (dim a multiple
 * of 8): each head's output is held in registers 64 columns at a time across the 8 value rows. */
static void values_block8(const DecodeModel *m, int64_t layer_rows, int64_t kv_head, const int64_t *table,
                          int64_t block_size, int64_t j, int64_t group, int64_t first_head, int64_t first_score,
                          float *value_buffer, Workspace *w, int64_t max_context) {
    int64_t dim = m->head_dim;
    const float *values[8];
    context_rows8(m, m->values, layer_rows, kv_head, table, block_size, j, value_buffer, values);
    for (int64_t g = 0; g < group; g++) {
        const float *p = w->scores + (first_score + g) * max_context + j;
        float *out = w->core + (first_head + g) * dim;
        int64_t c = 0;
        for (; c + 64 <= dim; c += 64) {
            v8f acc[8];
            for (int k = 0; k < 8; k++) acc[k] = load8(out + c + 8 * k);
            for (int t = 0; t < 8; t++)
                for (int k = 0; k < 8; k++) acc[k] += p[t] * load8(values[t] + c + 8 * k);
            memcpy(out + c, acc, sizeof acc);
        }
        for (; c < dim; c += 8) {
            v8f acc = load8(out + c);
            for (int t = 0; t < 8; t++) acc += p[t] * load8(values[t] + c);
            memcpy(out + c, &acc, sizeof acc);
        }
    }
}

/* One attention call's operands, shared by its tasks (a task is a row and a KV head). */
typedef struct {
    const DecodeModel *m;
    const int64_t *positions, *block_tables, *rows;
    int64_t ld_tables, block_size, max_context, layer_rows, heads, kv_heads, dim, group;
    int bf16;
    Workspace *w;
} AttentionCall;

/* softmax(q K^T * scale) V for each query head of one (row, KV head): each cached key and value
 * row is read once for all the query heads of its group. Task i * kv_heads + g is KV head g of
 * row rows[i]; its scores are the i-th row of the scores. */
static void attention_task(void *context, int64_t task) {
    const AttentionCall *c = context;
    const DecodeModel *m = c->m;
    const int64_t *positions = c->positions, *block_tables = c->block_tables;
    int64_t ld_tables = c->ld_tables, block_size = c->block_size, max_context = c->max_context;
    int64_t layer_rows = c->layer_rows, heads = c->heads, kv_heads = c->kv_heads, dim = c->dim, group = c->group;
    int bf16 = c->bf16;
    Workspace *w = c->w;
    int64_t i = task / kv_heads, b = c->rows[i], kv_head = task % kv_heads, length = positions[b] + 1;
    int64_t first_head = b * heads + kv_head * group;    /* this group's rows of q and core */
    int64_t first_score = i * heads + kv_head * group;   /* and of the scores */
    float *key_buffer = w->kv_rows + task * 16 * dim, *value_buffer = key_buffer + 8 * dim;  /* bf16 rows widened */
    const int64_t *table = block_tables + b * ld_tables;
    for (int64_t g = 0; g < group; g++) w->max_scores[first_score + g] = -INFINITY;
    int64_t j = 0;
    if (dim % 8 == 0)
        for (; j + 8 <= length; j += 8)
            scores_block8(m, layer_rows, kv_head, table, block_size, j, group, first_head, first_score, key_buffer, w,
                          max_context);
    for (; j < length; j++) {
        int64_t slot = table[j / block_size] * block_size + j % block_size;
        const float *key = row_as_f32(m->keys, layer_rows + slot * kv_heads + kv_head, dim, bf16, key_buffer);
        for (int64_t g = 0; g < group; g++) {
            float score = dot(w->q + (first_head + g) * dim, key, dim) * m->attn_scale;
            w->scores[(first_score + g) * max_context + j] = score;
            if (score > w->max_scores[first_score + g]) w->max_scores[first_score + g] = score;
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *scores = w->scores + (first_score + g) * max_context, top = w->max_scores[first_score + g];
        for (int64_t t = 0; t < length; t++) scores[t] = exp_f32(scores[t] - top);
        v8f partial = {0};  /* eight running sums: a single one is a chain of `length` dependent adds */
        int64_t k = 0;
        for (; k + 8 <= length; k += 8) partial += load8(scores + k);
        float total = 0.0f;
        for (int t = 0; t < 8; t++) total += partial[t];
        for (; k < length; k++) total += scores[k];
        float inv = 1.0f / total;
        for (k = 0; k < length; k++) scores[k] *= inv;
        memset(w->core + (first_head + g) * dim, 0, sizeof(float) * dim);
    }
    j = 0;
    if (dim % 8 == 0)
        for (; j + 8 <= length; j += 8)
            values_block8(m, layer_rows, kv_head, table, block_size, j, group, first_head, first_score, value_buffer,
                          w, max_context);
    for (; j < length; j++) {
        int64_t slot = table[j / block_size] * block_size + j % block_size;
        const float *value = row_as_f32(m->values, layer_rows + slot * kv_heads + kv_head, dim, bf16,
                                        value_buffer);
        for (int64_t g = 0; g < group; g++) {
            float p = w->scores[(first_score + g) * max_context + j], *out = w->core + (first_head + g) * dim;
            for (int64_t d = 0; d < dim; d++) out[d] += p * value[d];
        }
    }
}

/* softmax(q K^T * scale) V for each query head of rows[0 .. count), by (row, KV head) tasks on the
 * task pool. */
static void decode_attention(const DecodeModel *m, int64_t kv_layer, int64_t count, const int64_t *rows,
                             const int64_t *positions, const int64_t *block_tables, int64_t ld_tables,
                             int64_t block_size, int64_t max_context, Workspace *w, int threads) {
    int64_t heads = m->heads, kv_heads = m->kv_heads;
    int64_t work = 0;
    for (int64_t i = 0; i < count; i++) work += positions[rows[i]] + 1;
    AttentionCall call = {m, positions, block_tables, rows, ld_tables, block_size, max_context,
                          kv_layer * m->num_kv_slots * kv_heads, heads, kv_heads, m->head_dim, heads / kv_heads,
                          (int)m->bf16_storage, w};
    /* the caller holds the denormal flush (decode_step_f32); the pool's workers keep it set */
    task_pool_run(work * heads > 4096 ? threads : 1, attention_task, &call, count * kv_heads);
}

/* Causal attention of run r's rows (a prompt chunk) over its sequence's context, with
 * prefill_attention.c, in even pieces of at most CHUNK_PIECE_ROWS rows (every row's KV is written
 * already): each key block is shared by a piece's rows while it is in L1 (the decode attention
 * reads the whole context once per row: 64 rows over 4160 tokens took ~2.5 times as long). The
 * run's last row's block table covers every position of the run. */
static void chunk_attention(const DecodeModel *m, int64_t kv_layer, const Runs *runs, int64_t r,
                            const int64_t *positions, const int64_t *block_tables, int64_t ld_tables,
                            int64_t block_size, Workspace *w, int threads) {
    int64_t first = runs->start[r], last = runs->start[r + 1] - 1, dim = m->head_dim, heads = m->heads;
    const int64_t *table = block_tables + last * ld_tables;
    for (int64_t j = 0; j <= positions[last]; j++)
        w->chunk_slots[j] = table[j / block_size] * block_size + j % block_size;
    size_t layer_bytes = (size_t)(kv_layer * m->num_kv_slots * m->kv_heads * dim) * (m->bf16_storage ? 2 : 4);
    const void *keys = (const char *)m->keys + layer_bytes, *values = (const char *)m->values + layer_bytes;
    int64_t piece = piece_rows(last - first + 1, CHUNK_PIECE_ROWS);
    for (int64_t b = first; b <= last; b += piece) {
        int64_t n = last + 1 - b < piece ? last + 1 - b : piece;
        prefill_attention_f32_scratch(w->q + b * heads * dim, n, heads, dim, heads * dim, keys, values,
                                      (int)m->bf16_storage, m->kv_heads, w->chunk_slots, positions[b], m->attn_scale,
                                      w->core + b * heads * dim, threads, w->chunk_scratch);
    }
}

/* Attention mixer: q/k norm + rotary, every row's K/V into its slot, attention, sigmoid gate. The
 * fused projection row holds [q_h | gate_h for each head h] then k then v. Rows out_rows[0 ..
 * num_out) get outputs (the last layer's logit rows: no later layer reads the others), or every
 * row when out_rows is NULL: long runs by chunk_attention, the rest by decode_attention. */
static void attention_mixer(const DecodeModel *m, const DecodeLayer *layer, int64_t batch, const Runs *runs,
                            const int64_t *positions, const int64_t *kv_write_slots, const int64_t *block_tables,
                            int64_t ld_tables, int64_t block_size, int64_t max_context, int64_t num_out,
                            const int64_t *out_rows, Workspace *w, int threads) {
    int64_t heads = m->heads, kv_heads = m->kv_heads, dim = m->head_dim, width = layer->mixer_in_features;
    int64_t kv_width = kv_heads * dim, layer_slots = layer->mixer_index * m->num_kv_slots;
    int bf16 = (int)m->bf16_storage;
    for (int64_t b = 0; b < batch; b++) {
        const float *row = w->proj + b * width, *cos = w->cos + b * m->rot, *sin = w->sin + b * m->rot;
        float *k = w->k + b * kv_width;
        rms_norm_rope_f32(row, 1, heads, dim, 0, 2 * dim, layer->q_norm, m->rms_eps, cos, sin, m->rot,
                          w->q + b * heads * dim);
        rms_norm_rope_f32(row + 2 * heads * dim, 1, kv_heads, dim, 0, dim, layer->k_norm, m->rms_eps, cos, sin, m->rot, k);
        write_row(m->keys, layer_slots + kv_write_slots[b], kv_width, bf16, k);
        write_row(m->values, layer_slots + kv_write_slots[b], kv_width, bf16, row + 2 * heads * dim + kv_width);
    }
    int64_t count = 0;
    if (out_rows) {
        memcpy(w->attention_rows, out_rows, sizeof(int64_t) * num_out);
        count = num_out;
    } else {
        for (int64_t r = 0; r < runs->count; r++) {
            if (chunk_attention_scratch(m, run_length(runs, r), threads) > 0) {
                chunk_attention(m, layer->mixer_index, runs, r, positions, block_tables, ld_tables, block_size, w,
                                threads);
                continue;
            }
            for (int64_t b = runs->start[r]; b < runs->start[r + 1]; b++) w->attention_rows[count++] = b;
        }
    }
    if (count > 0)
        decode_attention(m, layer->mixer_index, count, w->attention_rows, positions, block_tables, ld_tables,
                         block_size, max_context, w, threads);
    for (int64_t i = 0; i < (out_rows ? num_out : batch); i++) {
        int64_t b = out_rows ? out_rows[i] : i;
        for (int64_t h = 0; h < heads; h++) {
            float *out = w->core + (b * heads + h) * dim;
            const float *gate = w->proj + b * width + h * 2 * dim + dim;
            for (int64_t d = 0; d < dim; d++) out[d] *= 1.0f / (1.0f + exp_f32(-gate[d]));
        }
    }
}

/* The MLP of `rows` rows of w->h into w->h, in even pieces of at most gemm_piece_bound rows for the
 * gate/up product (the tile GEMM writes silu(gate) * up itself where it runs). */
static void mlp(const DecodeModel *m, const DecodeLayer *layer, int64_t rows, Workspace *w, int threads) {
    int64_t hidden = m->hidden, inter = m->intermediate;
    Linear gate_up = layer->gate_up;
    int64_t piece = rows > 0 ? piece_rows(rows, gemm_piece_bound(gate_up)) : 1;
    for (int64_t p = 0; p < rows; p += piece) {
        int64_t n = rows - p < piece ? rows - p : piece;
        const float *h = w->h + p * hidden;
        float *act = w->act + p * inter;
        if (!gemm_rows_silu_mul(gate_up.weight, gate_up.scales, (int)gate_up.format, inter, hidden, h, n, hidden, act,
                                inter, threads))
            continue;
        linear(gate_up, 2 * inter, hidden, h, n, w->mlp + p * 2 * inter, threads);
        for (int64_t b = p; b < p + n; b++) {
            const float *gate = w->mlp + b * 2 * inter, *up = gate + inter;
            for (int64_t i = 0; i < inter; i++) w->act[b * inter + i] = silu_f32(gate[i]) * up[i];
        }
    }
    linear(layer->down, hidden, inter, w->act, rows, w->h, threads);
}

/* Moves rows rows[0 .. count) (ascending) of x [.., width] to its first rows, in order. */
static void gather_rows(float *x, int64_t width, const int64_t *rows, int64_t count) {
    for (int64_t i = 0; i < count; i++)  /* rows ascend, so i <= rows[i]: nothing is overwritten before it moves */
        if (rows[i] != i) memmove(x + i * width, x + rows[i] * width, sizeof(float) * width);
}

/* Returns 0, or 1 (nothing written) when an input is out of range. Row b is the token at position
 * positions[b] of the sequence in state slot state_slots[b]; its context is positions
 * [0, positions[b]], at KV slot block_tables[b * ld_tables + p / block_size] * block_size + p % block_size.
 * A sequence may have several rows (a prompt chunk): consecutive rows, consecutive positions, the
 * same table; each row attends to the rows before it, as in a prefill. max_context >= every
 * positions[b] + 1 sizes the scores; workspace of decode_step_workspace_floats() for the same rows
 * and threads. undo_conv[i] / undo_rec[i] [sequences, ...] for GDN layer i receive the state each
 * sequence (run of rows, in order) had before the step. logits [num_logit_rows, vocab] of rows
 * logit_rows (ascending, each the last row of its sequence); the last layer runs its mixer for
 * every row (its KV and GDN state advance) and the rest of it for those rows only. Captures:
 * capture_conv[i] / capture_rec[i] [num_captures, ...] receive GDN layer i's state just after row
 * capture_rows[c] (a row inside a run: the state at a run's end is the live slot's). */
int decode_step_f32(const DecodeModel *m, int64_t batch, const int64_t *tokens, const int64_t *positions,
                    const int64_t *state_slots, const int64_t *kv_write_slots, const int64_t *block_tables,
                    int64_t ld_tables, int64_t block_size, int64_t max_context, float *workspace, void **undo_conv,
                    float **undo_rec, int64_t num_logit_rows, const int64_t *logit_rows, float *logits,
                    int64_t num_captures, const int64_t *capture_rows, void **capture_conv, float **capture_rec,
                    int threads) {
    if (!inputs_valid(m, batch, tokens, positions, state_slots, kv_write_slots, block_tables, ld_tables, block_size,
                      max_context, num_logit_rows, logit_rows))
        return 1;
    for (int64_t c = 0; c < num_captures; c++)  /* a row followed by a row of its own sequence */
        if (capture_rows[c] < 0 || capture_rows[c] + 1 >= batch
            || state_slots[capture_rows[c] + 1] != state_slots[capture_rows[c]])
            return 1;
    unsigned int saved_csr = denormals_flush_begin();  /* this thread's part; the pool's workers keep it set */
    Runs runs;
    find_runs(state_slots, batch, &runs);
    Workspace w;
    layout(m, batch, &runs, max_context, threads, workspace, &w);
    int64_t hidden = m->hidden, conv_size = conv_dim_of(m) * (m->conv_kernel - 1);
    int64_t rec_size = m->num_v_heads * m->head_k * m->head_v;
    for (int64_t b = 0; b < batch; b++) {
        read_row(m->embed, tokens[b], hidden, (int)m->bf16_storage, w.x + b * hidden);
        read_row(m->cos_table, positions[b], m->rot, (int)m->bf16_storage, w.cos + b * m->rot);
        read_row(m->sin_table, positions[b], m->rot, (int)m->bf16_storage, w.sin + b * m->rot);
    }
    int64_t rows = batch;  /* rows past the last layer's mixer: the logit rows */
    for (int64_t l = 0; l < m->num_layers; l++) {
        const DecodeLayer *layer = &m->layers[l];
        int last = l == m->num_layers - 1;
        int64_t width = layer->mixer_in_features, core_width;
        rms_norm_f32(w.x, batch, hidden, hidden, layer->input_norm, m->rms_eps, w.h, hidden);
        linear(layer->mixer_in, width, hidden, w.h, batch, w.proj, threads);
        if (layer->is_attention) {
            attention_mixer(m, layer, batch, &runs, positions, kv_write_slots, block_tables, ld_tables, block_size,
                            max_context, num_logit_rows, last ? logit_rows : NULL, &w, threads);
            core_width = m->heads * m->head_dim;
        } else {
            int64_t index = layer->mixer_index;
            size_t conv_bytes = m->bf16_storage ? sizeof(uint16_t) : sizeof(float);
            char *conv_layer = (char *)m->conv_live + index * m->num_state_slots * conv_size * conv_bytes;
            gdn_decode_step(batch, m->num_k_heads, m->num_v_heads, m->head_k, m->head_v, m->conv_kernel, w.proj,
                            width, layer->b_offset, layer->b_offset + m->num_v_heads, state_slots,
                            m->num_state_slots, conv_layer, m->rec_live + index * m->num_state_slots * rec_size,
                            layer->conv_weight, layer->dt_bias, layer->neg_decay_rate, m->l2_eps, layer->gdn_norm,
                            m->gdn_norm_eps, threads, 1, (int)m->bf16_storage, w.gdn_scratch, undo_conv[index],
                            undo_rec[index], w.core, num_captures, capture_rows,
                            num_captures ? capture_conv[index] : NULL, num_captures ? capture_rec[index] : NULL);
            core_width = m->num_v_heads * m->head_v;
        }
        if (last) {  /* the rest of the last layer feeds only the logits */
            gather_rows(w.core, core_width, logit_rows, num_logit_rows);
            gather_rows(w.x, hidden, logit_rows, num_logit_rows);
            rows = num_logit_rows;
        }
        linear(layer->mixer_out, hidden, core_width, w.core, rows, w.h, threads);
        add_rows(w.x, w.h, rows * hidden);
        rms_norm_f32(w.x, rows, hidden, hidden, layer->post_norm, m->rms_eps, w.h, hidden);
        mlp(m, layer, rows, &w, threads);
        add_rows(w.x, w.h, rows * hidden);
    }
    if (rows > 0) {
        rms_norm_f32(w.x, rows, hidden, hidden, m->final_norm, m->rms_eps, w.h, hidden);
        linear(m->head, m->vocab, hidden, w.h, rows, logits, threads);
    }
    denormals_flush_end(saved_csr);
    return 0;
}
