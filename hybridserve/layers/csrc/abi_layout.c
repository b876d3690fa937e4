/* The compiled layout of the structs hybridserve_kernels.h shares with Python: their sizes and the
 * offset and size of each field, which hybridserve/layers/kernel_abi.py compares with its ctypes mirrors
 * when the library loads (a mismatch disables the C kernels instead of corrupting memory).
 *
 * Every field of every shared struct has a row in FIELDS; kernel_abi.py checks that against the
 * header, and the compiler rejects a row naming a field the struct does not have.
 */
#include <stddef.h>
#include <string.h>

#include "hybridserve_kernels.h"

typedef struct {
    const char *name;
    int64_t size;
} StructSize;

typedef struct {
    const char *struct_name, *field_name;
    int64_t offset, size;
} FieldLayout;

#define STRUCT(type) {#type, (int64_t)sizeof(type)}
#define FIELD(type, field) {#type, #field, (int64_t)offsetof(type, field), (int64_t)sizeof(((type *)0)->field)}

static const StructSize STRUCTS[] = {STRUCT(Linear), STRUCT(DecodeLayer), STRUCT(DecodeModel)};

static const FieldLayout FIELDS[] = {
    FIELD(Linear, weight), FIELD(Linear, scales), FIELD(Linear, format),

    FIELD(DecodeLayer, is_attention), FIELD(DecodeLayer, mixer_index), FIELD(DecodeLayer, input_norm),
    FIELD(DecodeLayer, post_norm), FIELD(DecodeLayer, mixer_in), FIELD(DecodeLayer, mixer_in_features),
    FIELD(DecodeLayer, mixer_out), FIELD(DecodeLayer, gate_up), FIELD(DecodeLayer, down),
    FIELD(DecodeLayer, conv_weight), FIELD(DecodeLayer, dt_bias), FIELD(DecodeLayer, neg_decay_rate),
    FIELD(DecodeLayer, gdn_norm), FIELD(DecodeLayer, b_offset), FIELD(DecodeLayer, q_norm),
    FIELD(DecodeLayer, k_norm),

    FIELD(DecodeModel, num_layers), FIELD(DecodeModel, hidden), FIELD(DecodeModel, intermediate),
    FIELD(DecodeModel, vocab), FIELD(DecodeModel, bf16_storage), FIELD(DecodeModel, rms_eps),
    FIELD(DecodeModel, gdn_norm_eps), FIELD(DecodeModel, l2_eps), FIELD(DecodeModel, embed),
    FIELD(DecodeModel, final_norm), FIELD(DecodeModel, head), FIELD(DecodeModel, cos_table),
    FIELD(DecodeModel, sin_table), FIELD(DecodeModel, max_positions), FIELD(DecodeModel, rot),
    FIELD(DecodeModel, num_k_heads), FIELD(DecodeModel, num_v_heads), FIELD(DecodeModel, head_k),
    FIELD(DecodeModel, head_v), FIELD(DecodeModel, conv_kernel), FIELD(DecodeModel, num_state_slots),
    FIELD(DecodeModel, conv_live), FIELD(DecodeModel, rec_live), FIELD(DecodeModel, heads),
    FIELD(DecodeModel, kv_heads), FIELD(DecodeModel, head_dim), FIELD(DecodeModel, attn_scale),
    FIELD(DecodeModel, keys), FIELD(DecodeModel, values), FIELD(DecodeModel, num_kv_slots),
    FIELD(DecodeModel, layers),
};

int64_t kernel_abi_struct_size(const char *struct_name) {
    for (size_t i = 0; i < sizeof(STRUCTS) / sizeof(STRUCTS[0]); i++)
        if (strcmp(STRUCTS[i].name, struct_name) == 0) return STRUCTS[i].size;
    return -1;
}

static const FieldLayout *field_layout(const char *struct_name, const char *field_name) {
    for (size_t i = 0; i < sizeof(FIELDS) / sizeof(FIELDS[0]); i++)
        if (strcmp(FIELDS[i].struct_name, struct_name) == 0 && strcmp(FIELDS[i].field_name, field_name) == 0)
            return &FIELDS[i];
    return NULL;
}

int64_t kernel_abi_field_offset(const char *struct_name, const char *field_name) {
    const FieldLayout *field = field_layout(struct_name, field_name);
    return field ? field->offset : -1;
}

int64_t kernel_abi_field_size(const char *struct_name, const char *field_name) {
    const FieldLayout *field = field_layout(struct_name, field_name);
    return field ? field->size : -1;
}
