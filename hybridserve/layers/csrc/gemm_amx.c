/* y = x @ W.T for 6 to 32 float32 rows of x on a bfloat16 weight [out, in], or 8 to 32 on an int8
 * one with a float32 scale per output (y = (x @ W.T) * scales), on AMX tiles (Intel Sapphire Rapids
 * and later; elsewhere every call returns 1 and the caller keeps its other kernel). Called through
 * gemm_rows / gemm_rows_silu_mul (csrc/gemm_rows.c) and, for bf16, native.gemv.
 *
 * The GEMV (csrc/gemv.c) and the float32 tile (csrc/gemm_rows.c) widen each weight to float32 and
 * spend one FMA per weight per row: at 16 rows of a decode step that is compute, not the weight
 * stream (docs/cpu-kernels.md has the figures). A tile multiply (TDPBF16PS) does 16 x 16 x 32 multiply-adds at once, so the rows cost little.
 *
 * Numerics: a bf16 weight is bf16 already and an int8 one is a bf16 value exactly (integers to 256
 * are); each float32 input x is split exactly into three bf16 parts (x = hi + mid + lo: hi is x with
 * the low 16 bits cleared, mid the same of x - hi, lo what is left, which has at most 8 significant
 * bits) and the three products are accumulated in float32, so every product w * x is exact, as in
 * the GEMV; only the summation order differs. (One part, what oneDNN's bf16 GEMM does with a
 * float32 input, would round x to 8 bits.)
 *
 * Layout: the weight is the plain row-major matrix the GEMV and the prefill GEMMs read. A tile
 * register holds 16 weight rows x 32 inputs: bf16 straight from the matrix (stride = the row's
 * bytes), int8 widened into a scratch tile first. The inputs are packed once per call as VNNI
 * pairs, [group of 16 rows][32-input block][part][16 pairs][16 rows]; the 16 x 16 float32
 * accumulator is transposed (and scaled) into y. A task is a block of 32 weight rows (two
 * accumulators sharing each input tile load); the MLP's variant computes the same block of gate
 * and up rows and writes silu(gate) * up. A ragged end (in not a multiple of 32, or out not of 32)
 * goes through a zero-padded tile, so nothing past the matrix is read.
 *
 * The lower row bounds (6 for bf16, 8 for int8) are where the tiles start to beat the GEMV and the
 * float32 tile on the built-in model's linears (docs/cpu-kernels.md).
 *
 * The tile registers need the kernel's permission (arch_prctl ARCH_REQ_XCOMP_PERM, once per
 * process) and a tile configuration in each thread. Other libraries in the process (oneDNN's AMX
 * kernels) load their own configuration and release it, so every call configures each thread it
 * runs on, at that thread's first task of the call; the configuration is left in place afterwards
 * (releasing it per task added a fixed cost to every task). HYBRIDSERVE_AMX=0 (native.py) turns it off. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "hybridserve_kernels.h"
#include "task_pool.h"
#include "vector_math.h"

#define GEMM_AMX_MIN_ROWS 6       /* bf16 */
#define GEMM_AMX_MIN_ROWS_INT8 8  /* below, the float32 tile of gemm_rows.c is faster */
#define GEMM_AMX_MAX_ROWS 32
#define AMX_BLOCK 32      /* weight rows per task: two 16-row tiles */
#define AMX_K 32          /* inputs per tile (bf16 pairs x 16) */
#define AMX_PARTS 3       /* bf16 parts of each float32 input */

static int amx_enabled = 1;

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Whether this process may use the tile registers (asks the kernel once). */
static int amx_permitted(void) {
    static int permitted = -1;
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return permitted;
}

typedef struct __attribute__((packed)) {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} TileConfig;

/* Eight 16-row x 64-byte tiles: 0-1 accumulators, 2-3 weight rows, 5-7 the input parts. */
static void configure_tiles(void) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.bytes_per_row[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
}

static inline __m512 high_half(__m512 v) {
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* r[i] word j -> r[j] word i (a 16 x 16 transpose of 32-bit words). */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int j = 0; j < 4; j++) {  /* now 4 x 4 blocks per 128-bit lane: gather the lanes */
        __m512i u0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), u1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
        __m512i v0 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
        __m512i v1 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
        t[j] = _mm512_shuffle_i32x4(u0, v0, 0x88);
        t[4 + j] = _mm512_shuffle_i32x4(u0, v0, 0xDD);
        t[8 + j] = _mm512_shuffle_i32x4(u1, v1, 0x88);
        t[12 + j] = _mm512_shuffle_i32x4(u1, v1, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

static inline __mmask16 first_lanes(int64_t count) {
    return count >= 16 ? (__mmask16)0xFFFF : count <= 0 ? 0 : (__mmask16)((1u << count) - 1);
}

/* x [rows, in] into packed[group][k block][part][pair][row] (see the header), zero-padded. */
static void pack_inputs(const float *x, int64_t rows, int64_t ld_x, int64_t in, uint32_t *packed) {
    int64_t blocks = (in + AMX_K - 1) / AMX_K, groups = (rows + 15) / 16;
    for (int64_t g = 0; g < groups; g++)
        for (int64_t kb = 0; kb < blocks; kb++) {
            int64_t k = kb * AMX_K;
            __mmask16 low = first_lanes(in - k), high = first_lanes(in - k - 16);
            __m512i parts[AMX_PARTS][16];
            for (int n = 0; n < 16; n++) {
                int64_t row = g * 16 + n;
                if (row >= rows) {
                    for (int p = 0; p < AMX_PARTS; p++) parts[p][n] = _mm512_setzero_si512();
                    continue;
                }
                const float *src = x + row * ld_x + k;
                __m512 v0 = _mm512_maskz_loadu_ps(low, src), v1 = _mm512_maskz_loadu_ps(high, src + 16);
                __m512 hi0 = high_half(v0), hi1 = high_half(v1);
                __m512 rest0 = _mm512_sub_ps(v0, hi0), rest1 = _mm512_sub_ps(v1, hi1);
                __m512 mid0 = high_half(rest0), mid1 = high_half(rest1);
                /* every part is a bf16 value exactly, so the rounding conversion keeps it */
                parts[0][n] = (__m512i)_mm512_cvtne2ps_pbh(hi1, hi0);
                parts[1][n] = (__m512i)_mm512_cvtne2ps_pbh(mid1, mid0);
                parts[2][n] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(rest1, mid1), _mm512_sub_ps(rest0, mid0));
            }
            for (int p = 0; p < AMX_PARTS; p++) {
                transpose16(parts[p]);  /* row n's pairs -> pair j's rows */
                uint32_t *dst = packed + ((g * blocks + kb) * AMX_PARTS + p) * 256;
                for (int j = 0; j < 16; j++) _mm512_storeu_si512(dst + j * 16, parts[p][j]);
            }
        }
}

/* One call's operands, shared by its tasks. silu: `weight` is the MLP's fused [gate; up] with `out`
 * rows each, and y = silu(x @ G.T) * (x @ U.T). */
typedef struct {
    const void *weight;
    const float *scales;
    const uint32_t *packed;
    float *y;
    int64_t out, in, rows, ld_y, call;
    int format, silu;
} AmxCall;

/* Weight rows [0, count) x inputs [k, k + 32) of a bf16 `w` (row stride `in`), zero-padded to
 * 16 x 32 where the matrix ends. */
static void padded_bf16_tile(const uint16_t *w, int64_t count, int64_t in, int64_t k, uint16_t tile[16][AMX_K]) {
    int64_t width = in - k < AMX_K ? in - k : AMX_K;
    memset(tile, 0, 16 * AMX_K * sizeof(uint16_t));
    for (int64_t r = 0; r < count; r++) memcpy(tile[r], w + r * in + k, (size_t)width * sizeof(uint16_t));
}

/* The same from an int8 `w`: every int8 value is a bf16 value exactly. */
static void int8_tile(const int8_t *w, int64_t count, int64_t in, int64_t k, uint16_t tile[16][AMX_K]) {
    __mmask16 low = first_lanes(in - k), high = first_lanes(in - k - 16);
    int64_t r = 0;
    for (; r < count; r++) {
        const int8_t *src = w + r * in + k;
        __m512 v0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(low, src)));
        __m512 v1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(high, src + 16)));
        _mm512_store_si512(tile[r], (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
    }
    for (; r < 16; r++) _mm512_store_si512(tile[r], _mm512_setzero_si512());
}

/* Weight rows [row, row + count) (count <= 32) against input group g, the sums (before any
 * scale) into sums[half][weight row][input row]. */
static void block_sums(const AmxCall *c, int64_t row, int64_t count, int64_t g, float sums[2][16][16]) {
    int64_t blocks = (c->in + AMX_K - 1) / AMX_K, stride = c->in * (int64_t)sizeof(uint16_t);
    int64_t lower = count < 16 ? count : 16, upper = count - lower;
    const uint16_t *bf16 = (const uint16_t *)c->weight + row * c->in;
    const int8_t *int8 = (const int8_t *)c->weight + row * c->in;
    uint16_t tile[2][16][AMX_K] __attribute__((aligned(64)));
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t kb = 0; kb < blocks; kb++) {
        int64_t k = kb * AMX_K;
        int whole = k + AMX_K <= c->in;
        const uint32_t *b = c->packed + (g * blocks + kb) * AMX_PARTS * 256;
        _tile_loadd(5, b, 64);
        _tile_loadd(6, b + 256, 64);
        _tile_loadd(7, b + 512, 64);
        if (c->format == WEIGHT_I8) {
            int8_tile(int8, lower, c->in, k, tile[0]);
            _tile_loadd(2, tile[0], 64);
        } else if (lower == 16 && whole) {
            _tile_loadd(2, bf16 + k, stride);  /* straight from the matrix */
        } else {
            padded_bf16_tile(bf16, lower, c->in, k, tile[0]);
            _tile_loadd(2, tile[0], 64);
        }
        _tile_dpbf16ps(0, 2, 7);  /* the small parts first */
        _tile_dpbf16ps(0, 2, 6);
        _tile_dpbf16ps(0, 2, 5);
        if (upper == 0) continue;
        if (c->format == WEIGHT_I8) {
            int8_tile(int8 + 16 * c->in, upper, c->in, k, tile[1]);
            _tile_loadd(3, tile[1], 64);
        } else if (upper == 16 && whole) {
            _tile_loadd(3, bf16 + 16 * c->in + k, stride);
        } else {
            padded_bf16_tile(bf16 + 16 * c->in, upper, c->in, k, tile[1]);
            _tile_loadd(3, tile[1], 64);
        }
        _tile_dpbf16ps(1, 3, 7);
        _tile_dpbf16ps(1, 3, 6);
        _tile_dpbf16ps(1, 3, 5);
    }
    _tile_stored(0, sums[0], 64);
    if (upper) _tile_stored(1, sums[1], 64);
}

/* sums [weight row][input row] -> v[input row] = its 16 outputs (times the int8 scales of weight
 * rows [row, row + 16)). */
static void transposed(const AmxCall *c, const float sums[16][16], int64_t row, __mmask16 keep, __m512 v[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i++) t[i] = _mm512_load_si512(sums[i]);
    transpose16(t);
    __m512 scale = c->format == WEIGHT_I8 ? _mm512_maskz_loadu_ps(keep, c->scales + row) : _mm512_set1_ps(1.0f);
    for (int n = 0; n < 16; n++) v[n] = _mm512_mul_ps(_mm512_castsi512_ps(t[n]), scale);
}

/* silu_f32 (vector_math.h) on 16 lanes. */
static inline __m512 silu16(__m512 x) {
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16_ps(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

static void amx_task(void *context, int64_t block) {
    const AmxCall *c = context;
    static __thread int64_t configured_call = -1;
    if (configured_call != c->call) {
        configure_tiles();
        configured_call = c->call;
    }
    int64_t first = block * AMX_BLOCK, count = first + AMX_BLOCK < c->out ? AMX_BLOCK : c->out - first;
    float sums[2][2][16][16] __attribute__((aligned(64)));  /* [gate or plain, up][half] */
    for (int64_t g = 0; g * 16 < c->rows; g++) {
        block_sums(c, first, count, g, sums[0]);
        if (c->silu) block_sums(c, c->out + first, count, g, sums[1]);
        for (int64_t h = 0; h * 16 < count; h++) {
            int64_t column = first + h * 16, width = count - h * 16 < 16 ? count - h * 16 : 16;
            __mmask16 keep = first_lanes(width);
            __m512 v[16], up[16];
            transposed(c, sums[0][h], column, keep, v);
            if (c->silu) transposed(c, sums[1][h], c->out + column, keep, up);
            for (int64_t n = 0; n < 16 && g * 16 + n < c->rows; n++) {
                __m512 out = c->silu ? _mm512_mul_ps(silu16(v[n]), up[n]) : v[n];
                _mm512_mask_storeu_ps(c->y + (g * 16 + n) * c->ld_y + column, keep, out);
            }
        }
    }
}

/* The packed inputs of the calling thread's last call, grown as needed (NULL: out of memory). */
static uint32_t *packed_buffer(size_t words) {
    static __thread uint32_t *buffer;
    static __thread size_t capacity;
    if (words > capacity) {
        free(buffer);
        capacity = (words + 4095) & ~(size_t)4095;
        buffer = aligned_alloc(64, capacity * sizeof(uint32_t));
        if (!buffer) capacity = 0;
    }
    return buffer;
}

static int amx_call(const void *weight, const float *scales, int format, int silu, int64_t out, int64_t in,
                    const float *x, int64_t rows, int64_t ld_x, float *y, int64_t ld_y, int threads) {
    static int64_t calls;  /* a call's number, for the threads' tile configuration */
    int64_t min_rows = format == WEIGHT_I8 ? GEMM_AMX_MIN_ROWS_INT8 : GEMM_AMX_MIN_ROWS;
    if (!amx_enabled || (format != WEIGHT_I8 && format != WEIGHT_BF16) || rows < min_rows
        || rows > GEMM_AMX_MAX_ROWS || out < 1 || in < 1 || (format == WEIGHT_I8 && !scales) || !amx_permitted())
        return 1;
    int64_t groups = (rows + 15) / 16, blocks = (in + AMX_K - 1) / AMX_K;
    uint32_t *packed = packed_buffer((size_t)(groups * blocks * AMX_PARTS * 256));
    if (!packed) return 1;
    pack_inputs(x, rows, ld_x, in, packed);
    AmxCall call = {weight, scales, packed, y, out, in, rows, ld_y, __atomic_add_fetch(&calls, 1, __ATOMIC_RELAXED),
                    format, silu};
    unsigned int saved_csr = denormals_flush_begin();  /* the SiLU's clamped branch (vector_math.h) */
    task_pool_run(threads, amx_task, &call, (out + AMX_BLOCK - 1) / AMX_BLOCK);
    denormals_flush_end(saved_csr);
    return 0;
}

int gemm_amx(const void *weight, const float *scales, int format, int64_t out, int64_t in, const float *x,
             int64_t rows, int64_t ld_x, float *y, int64_t ld_y, int threads) {
    return amx_call(weight, scales, format, 0, out, in, x, rows, ld_x, y, ld_y, threads);
}

int gemm_amx_silu_mul(const void *weight, const float *scales, int format, int64_t half, int64_t in, const float *x,
                      int64_t rows, int64_t ld_x, float *y, int64_t ld_y, int threads) {
    return amx_call(weight, scales, format, 1, half, in, x, rows, ld_x, y, ld_y, threads);
}

int gemm_amx_available(void) { return amx_enabled && amx_permitted(); }
#else
/* This build has no AMX tiles: nothing is taken (1, nothing written). */
int gemm_amx(const void *weight, const float *scales, int format, int64_t out, int64_t in, const float *x,
             int64_t rows, int64_t ld_x, float *y, int64_t ld_y, int threads) {
    (void)weight; (void)scales; (void)format; (void)out; (void)in; (void)x; (void)rows; (void)ld_x; (void)y;
    (void)ld_y; (void)threads;
    return 1;
}

int gemm_amx_silu_mul(const void *weight, const float *scales, int format, int64_t half, int64_t in, const float *x,
                      int64_t rows, int64_t ld_x, float *y, int64_t ld_y, int threads) {
    return gemm_amx(weight, scales, format, half, in, x, rows, ld_x, y, ld_y, threads);
}

int gemm_amx_available(void) { return 0; }
#endif

/* Turns the AMX GEMMs on or off for the process (HYBRIDSERVE_AMX=0 at load: off); returns whether
 * they were on. */
int gemm_amx_set_enabled(int enabled) {
    int previous = amx_enabled;
    amx_enabled = enabled != 0;
    return previous;
}
