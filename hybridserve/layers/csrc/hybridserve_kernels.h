/* The C kernels' interface: every function the kernels library exports and every struct it shares
 * with Python, declared once.
 *
 * Every .c file of csrc/ includes this header, and the build runs with -Wmissing-prototypes
 * -Werror (hybridserve/layers/native.py), so a function defined differently from its declaration
 * here, or exported without one, does not compile. hybridserve/layers/kernel_abi.py reads this
 * file to build the ctypes signatures (argument and return types, exact arity) and to check its
 * ctypes struct mirrors against the compiled sizes and field offsets (abi_layout.c), so a changed
 * signature or struct is an error at load, not memory corruption at the call.
 *
 * kernel_abi.py parses a plain subset of C, so keep to it: `#` lines, comments, one `enum { ... };`
 * of named integer constants per statement, `typedef struct { ... } Name;` with fields of the
 * scalar types below, pointers, or structs declared above, and prototypes `type name(params);`
 * with named parameters. Scalars: void, char, int, float, double, int8_t, uint8_t, uint16_t,
 * int32_t, uint32_t, int64_t, uint64_t, size_t.
 */
#ifndef HYBRIDSERVE_KERNELS_H
#define HYBRIDSERVE_KERNELS_H

#include <stdint.h>

/* ---- Shared structs and constants ---------------------------------------------------------- */

/* A linear's weight format (Linear.format, the `format` argument of the GEMMs). */
enum { WEIGHT_F32 = 0, WEIGHT_I8 = 1, WEIGHT_BF16 = 2 };

/* A linear's weight [out, in]: float32, bfloat16, or int8 with one float32 scale per output. */
typedef struct {
    const void *weight;
    const float *scales;
    int64_t format;
} Linear;

/* One decoder layer's weights (the fused decode step's model, see decode_step.c). */
typedef struct {
    int64_t is_attention;
    int64_t mixer_index;                 /* GDN state layer, or KV layer */
    const float *input_norm, *post_norm; /* RMSNorm scales [hidden] */
    Linear mixer_in;                     /* GDN in_proj or attention q|gate,k,v: [mixer_in_features, hidden] */
    int64_t mixer_in_features;
    Linear mixer_out;                    /* out_proj / o_proj [hidden, value_dim or heads * head_dim] */
    Linear gate_up, down;                /* MLP: [2 * intermediate, hidden], [hidden, intermediate] */
    const float *conv_weight, *dt_bias, *neg_decay_rate, *gdn_norm; /* GDN only; float32 copies in a bf16 model */
    int64_t b_offset;                    /* GDN: column of the beta gate in the in_proj output */
    const float *q_norm, *k_norm;        /* attention only */
} DecodeLayer;

/* The model's shape, weights and state storage. */
typedef struct {
    int64_t num_layers, hidden, intermediate, vocab;
    int64_t bf16_storage;                /* embeddings, rotary tables, KV and conv state in bfloat16, else float32 */
    float rms_eps, gdn_norm_eps, l2_eps;
    const void *embed;
    const float *final_norm;
    Linear head;
    const void *cos_table, *sin_table;   /* [max_positions, rot] */
    int64_t max_positions, rot;
    int64_t num_k_heads, num_v_heads, head_k, head_v, conv_kernel, num_state_slots;
    void *conv_live;                     /* [gdn layers, slots, conv_dim, K-1] */
    float *rec_live;                     /* [gdn layers, slots, Hv, Dk, Dv] */
    int64_t heads, kv_heads, head_dim;
    float attn_scale;
    void *keys, *values;                 /* [attention layers, kv slots, kv_heads, head_dim] */
    int64_t num_kv_slots;
    const DecodeLayer *layers;
} DecodeModel;

/* ---- The layout of the shared structs, as compiled (abi_layout.c) --------------------------- */

/* sizeof the named struct of this header; -1 for a name it does not know. */
int64_t kernel_abi_struct_size(const char *struct_name);
/* offsetof and sizeof the named field of the named struct; -1 for a pair it does not know. */
int64_t kernel_abi_field_offset(const char *struct_name, const char *field_name);
int64_t kernel_abi_field_size(const char *struct_name, const char *field_name);

/* ---- GDN layers (gdn_decode.c, gdn_prefill.c) ------------------------------------------------ */

/* One decode step of a GDN layer for a batch, conv state float32 or (conv_bf16) bfloat16, with
 * captures of the state inside runs of one sequence's rows (see gdn_decode.c). */
int gdn_decode_step(int64_t batch, int64_t num_k_heads, int64_t num_v_heads, int64_t head_k, int64_t head_v,
                    int64_t kernel, const float *proj, int64_t proj_stride, int64_t b_offset, int64_t a_offset,
                    const int64_t *slots, int64_t num_slots, void *conv_live, float *rec_live,
                    const float *conv_weight, const float *dt_bias, const float *neg_decay_rate, float l2_eps,
                    const float *norm_weight, float norm_eps, int num_threads, int in_place, int conv_bf16,
                    float *scratch, void *out_conv, float *out_rec, float *core, int64_t num_captures,
                    const int64_t *capture_rows, void *capture_conv, float *capture_rec);
/* The float32-state form, as the module path calls it. */
int gdn_decode_f32(int64_t batch, int64_t num_k_heads, int64_t num_v_heads, int64_t head_k, int64_t head_v,
                   int64_t kernel, const float *proj, int64_t proj_stride, int64_t b_offset, int64_t a_offset,
                   const int64_t *slots, int64_t num_slots, float *conv_live, float *rec_live,
                   const float *conv_weight, const float *dt_bias, const float *neg_decay_rate, float l2_eps,
                   const float *norm_weight, float norm_eps, int num_threads, int in_place, float *scratch,
                   float *out_conv, float *out_rec, float *core);
/* One sequence's prefill chunk through a GDN layer, token by token. */
int gdn_prefill_f32(int64_t tokens, int64_t num_k_heads, int64_t num_v_heads, int64_t head_k, int64_t head_v,
                    int64_t kernel, const float *x, int64_t x_stride, const float *conv_state,
                    const float *conv_weight, const float *g, const float *beta, const float *rec_state, float l2_eps,
                    int64_t num_captures, const int64_t *capture_tokens, int num_threads, float *scratch,
                    float *captured, float *final_state, float *core);

/* ---- Norms and gates (rms_norm.c, elementwise.c) ---------------------------------------------- */

void rms_norm_f32(const float *x, int64_t rows, int64_t dim, int64_t ld_x, const float *scale, float eps,
                  float *out, int64_t ld_out);
void rms_norm_rope_f32(const float *x, int64_t tokens, int64_t heads, int64_t dim, int64_t ld_token, int64_t ld_head,
                       const float *scale, float eps, const float *cos, const float *sin, int64_t rot, float *out);
void gated_rms_norm_f32(const float *x, const float *gate, int64_t rows, int64_t dim, int64_t ld_x,
                        int64_t ld_gate, const float *scale, float eps, float *out);
void silu_mul_f32(const float *x, int64_t rows, int64_t half, int64_t ld_x, float *out);

/* ---- Linears (gemv.c, gemm_rows.c, gemm_amx.c) ------------------------------------------------ */

/* y [rows, out] (row stride ld_y) = x [rows, in] (row stride ld_x) @ W.T; 1 when rows is outside
 * what the kernel takes (nothing written), else 0. */
int gemv_f32(const float *weight, int64_t out, int64_t in, const float *x, int64_t rows, int64_t ld_x, float *y,
             int64_t ld_y, int threads);
int gemv_i8(const int8_t *weight, const float *scales, int64_t out, int64_t in, const float *x, int64_t rows,
            int64_t ld_x, float *y, int64_t ld_y, int threads);
int gemv_bf16(const uint16_t *weight, int64_t out, int64_t in, const float *x, int64_t rows, int64_t ld_x, float *y,
              int64_t ld_y, int threads);
int gemv_preferred_rows(void);
int gemm_rows(const void *weight, const float *scales, int format, int64_t out, int64_t in, const float *x,
              int64_t rows, int64_t ld_x, float *y, int64_t ld_y, int threads);
int gemm_rows_silu_mul(const void *weight, const float *scales, int format, int64_t half, int64_t in,
                       const float *x, int64_t rows, int64_t ld_x, float *y, int64_t ld_y, int threads);
void gemm_rows_bounds(int *min_rows, int *max_rows);
int gemm_amx(const void *weight, const float *scales, int format, int64_t out, int64_t in, const float *x,
             int64_t rows, int64_t ld_x, float *y, int64_t ld_y, int threads);
int gemm_amx_silu_mul(const void *weight, const float *scales, int format, int64_t half, int64_t in, const float *x,
                      int64_t rows, int64_t ld_x, float *y, int64_t ld_y, int threads);
int gemm_amx_available(void);
int gemm_amx_set_enabled(int enabled);

/* ---- Attention (prefill_attention.c) ----------------------------------------------------------- */

int prefill_attention_max_tokens(void);
int64_t prefill_attention_scratch_floats(int64_t tokens, int64_t heads, int64_t dim, int64_t kv_heads, int threads);
int prefill_attention_f32_scratch(const float *q, int64_t tokens, int64_t heads, int64_t dim, int64_t ld_q,
                                  const void *keys, const void *values, int kv_bf16, int64_t kv_heads,
                                  const int64_t *slots, int64_t num_prefix, float scale, float *out, int threads,
                                  float *scratch);
int prefill_attention_f32(const float *q, int64_t tokens, int64_t heads, int64_t dim, int64_t ld_q,
                          const float *keys, const float *values, int64_t kv_heads, const int64_t *slots,
                          int64_t num_prefix, float scale, float *out, int threads);

/* ---- Sampling (logits.c) ------------------------------------------------------------------------ */

void logits_argmax_finite(const float *x, int64_t rows, int64_t n, int64_t ld_x, int64_t *argmax, uint8_t *finite,
                          int threads);

/* ---- The whole decode step (decode_step.c) ------------------------------------------------------ */

int64_t decode_step_workspace_floats(const DecodeModel *m, int64_t batch, const int64_t *state_slots,
                                     int64_t max_context, int threads);
int decode_step_f32(const DecodeModel *m, int64_t batch, const int64_t *tokens, const int64_t *positions,
                    const int64_t *state_slots, const int64_t *kv_write_slots, const int64_t *block_tables,
                    int64_t ld_tables, int64_t block_size, int64_t max_context, float *workspace, void **undo_conv,
                    float **undo_rec, int64_t num_logit_rows, const int64_t *logit_rows, float *logits,
                    int64_t num_captures, const int64_t *capture_rows, void **capture_conv, float **capture_rec,
                    int threads);

/* ---- Tensor-parallel all-reduce through shared memory (shm_allreduce.c) -------------------------- */

int64_t shm_allreduce_region_bytes(int64_t world, int64_t slot_bytes);
void shm_allreduce_abort(void *base);
int shm_allreduce(void *base, int64_t world, int64_t rank, int64_t slot_bytes, void *data, int64_t numel,
                  int dtype, int op, int tag, int64_t timeout_ns);

#endif /* HYBRIDSERVE_KERNELS_H */
