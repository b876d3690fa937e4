/* All-reduce through shared memory for the tensor-parallel ranks of one host (CPU).
 *
 * The region (created by rank 0, mapped by every rank; see distributed/shm_allreduce.py) is
 *   [0, HEADER_BYTES)            header: Python's magic/token/world/slot words at 0..31, the abort word at 64
 *   [HEADER_BYTES, +world*256)   one control block per rank (below)
 *   [data_offset, ...)           two buffers of slot_bytes per rank: rank r, parity b at (2r + b) * slot_bytes
 *
 * One call reduces a tensor in pieces of at most slot_bytes. Every rank numbers its pieces with the
 * same sequence s = 1, 2, ... (its `seq` word holds the last one it posted). For piece s a rank
 *   1. waits until every peer's `done` >= s - 2: nobody still reads its buffer of parity s & 1
 *      (double buffering: a fast rank may post s + 1 while a slow one still reads s);
 *   2. copies its piece into that buffer, writes the piece's signature and size, and publishes
 *      `seq` = s (release);
 *   3. waits until every peer's `seq` >= s (acquire), checks that the peer posted the same
 *      operation (signature: element count, dtype, op, tag; and piece size), and reduces all
 *      ranks' buffers into its own tensor in rank order 0..N-1, so every rank computes the same
 *      floating-point sum bit for bit (bfloat16 accumulates in float32 and rounds once);
 *   4. publishes `done` = s (release): it no longer reads anyone's buffer of piece s.
 * A wait spins with a pause hint for SPIN_NS, then yields the CPU, then sleeps in short steps, and
 * gives up after the caller's timeout. A timeout or a mismatch sets the abort word, so the other
 * ranks fail at once instead of waiting for their own timeout; the channel is then unusable.
 */
#define _GNU_SOURCE
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "hybridserve_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__) || defined(__arm__)
#define CPU_RELAX() __asm__ __volatile__("yield" ::: "memory")
#else
#define CPU_RELAX() __asm__ __volatile__("" ::: "memory")
#endif

enum { SHM_OK = 0, SHM_TIMEOUT = -1, SHM_MISMATCH = -2, SHM_BAD_ARGS = -3, SHM_ABORTED = -4 };
enum { DT_F32 = 0, DT_BF16 = 1, DT_I32 = 2 };
enum { OP_SUM = 0, OP_MIN = 1, OP_MAX = 2 };

#define HEADER_BYTES 4096
#define ABORT_OFFSET 64
#define RANK_BYTES 256
#define MAX_WORLD 256
#define BLOCK 2048               /* elements reduced at a time in a float32/int32 accumulator on the stack */
#define SPIN_NS 50000            /* spin with a pause hint this long, */
#define YIELD_NS 10000000        /* then sched_yield() up to this, then sleep SLEEP_NS per check */
#define SLEEP_NS 50000

typedef struct {
    int64_t seq;                 /* the last piece this rank posted */
    int64_t pad0;
    uint64_t sig[2];             /* per buffer parity: what the posted piece belongs to */
    int64_t nbytes[2];           /* per buffer parity: the piece's size */
    char pad1[128 - 48];         /* `done` on its own cache lines: written once per piece by its owner */
    int64_t done;                /* the last piece this rank finished reading */
    char pad2[RANK_BYTES - 136];
} rank_ctl;

_Static_assert(sizeof(rank_ctl) == RANK_BYTES, "rank control block size");

static int64_t data_offset(int64_t world) {
    int64_t end = HEADER_BYTES + world * RANK_BYTES;
    return (end + 4095) / 4096 * 4096;
}

/* Bytes the region needs for `world` ranks with buffers of `slot_bytes` (the Python side sizes the file with it). */
int64_t shm_allreduce_region_bytes(int64_t world, int64_t slot_bytes) {
    return data_offset(world) + world * 2 * slot_bytes;
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static int aborted(const int64_t *abort_word) { return __atomic_load_n(abort_word, __ATOMIC_ACQUIRE) != 0; }

/* Mark the channel broken: every rank waiting in it (or calling it later) returns SHM_ABORTED. */
void shm_allreduce_abort(void *base) {
    __atomic_store_n((int64_t *)((char *)base + ABORT_OFFSET), 1, __ATOMIC_RELEASE);
}

/* Wait until *word >= target: spin, then yield, then sleep; SHM_TIMEOUT after timeout_ns. */
static int wait_at_least(const int64_t *word, int64_t target, const int64_t *abort_word, int64_t timeout_ns) {
    if (__atomic_load_n(word, __ATOMIC_ACQUIRE) >= target) return SHM_OK;
    int64_t start = now_ns();
    for (uint64_t i = 1;; i++) {
        if (__atomic_load_n(word, __ATOMIC_ACQUIRE) >= target) return SHM_OK;
        if (i % 64 != 0) {  /* between clock reads: spin in the first phase, yield or sleep later */
            CPU_RELAX();
            continue;
        }
        if (aborted(abort_word)) return SHM_ABORTED;
        int64_t waited = now_ns() - start;
        if (waited > timeout_ns) return SHM_TIMEOUT;
        if (waited >= YIELD_NS) {
            struct timespec pause = {0, SLEEP_NS};
            nanosleep(&pause, NULL);
            i = 63;                 /* read the clock again after the next check */
        } else if (waited >= SPIN_NS) {
            sched_yield();
            i = 63;
        }
    }
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  /* NaN, as torch rounds it */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* out[i] = reduce over r = 0..world-1 (in that order) of piece r[i], i < n. */
static void reduce_piece(void *out, char *const *pieces, int64_t world, int64_t n, int dtype, int op) {
    for (int64_t i0 = 0; i0 < n; i0 += BLOCK) {
        int64_t m = n - i0 < BLOCK ? n - i0 : BLOCK;
        if (dtype == DT_F32) {
            float acc[BLOCK];
            memcpy(acc, (const float *)pieces[0] + i0, (size_t)m * 4);
            for (int64_t r = 1; r < world; r++) {
                const float *x = (const float *)pieces[r] + i0;
                for (int64_t i = 0; i < m; i++) acc[i] += x[i];
            }
            memcpy((float *)out + i0, acc, (size_t)m * 4);
        } else if (dtype == DT_BF16) {
            float acc[BLOCK];
            const uint16_t *x0 = (const uint16_t *)pieces[0] + i0;
            for (int64_t i = 0; i < m; i++) acc[i] = bf16_to_f32(x0[i]);
            for (int64_t r = 1; r < world; r++) {
                const uint16_t *x = (const uint16_t *)pieces[r] + i0;
                for (int64_t i = 0; i < m; i++) acc[i] += bf16_to_f32(x[i]);
            }
            uint16_t *dst = (uint16_t *)out + i0;
            for (int64_t i = 0; i < m; i++) dst[i] = f32_to_bf16(acc[i]);
        } else {  /* DT_I32: SUM wraps around (two's complement), as torch's int32 sum does */
            int32_t acc[BLOCK];
            memcpy(acc, (const int32_t *)pieces[0] + i0, (size_t)m * 4);
            for (int64_t r = 1; r < world; r++) {
                const int32_t *x = (const int32_t *)pieces[r] + i0;
                if (op == OP_SUM) {
                    for (int64_t i = 0; i < m; i++) acc[i] = (int32_t)((uint32_t)acc[i] + (uint32_t)x[i]);
                } else if (op == OP_MIN) {
                    for (int64_t i = 0; i < m; i++) acc[i] = x[i] < acc[i] ? x[i] : acc[i];
                } else {
                    for (int64_t i = 0; i < m; i++) acc[i] = x[i] > acc[i] ? x[i] : acc[i];
                }
            }
            memcpy((int32_t *)out + i0, acc, (size_t)m * 4);
        }
    }
}

/* Reduce `numel` elements at `data` in place over all ranks (every rank calls it with the same
 * numel, dtype, op and tag, in the same order as its other calls). dtype: 0 float32, 1 bfloat16,
 * 2 int32; op: 0 SUM (every dtype), 1 MIN, 2 MAX (int32 only); tag: which caller (0..255), part
 * of the signature the ranks compare. Returns 0, or SHM_TIMEOUT / SHM_MISMATCH / SHM_ABORTED
 * (the channel is then broken on every rank) / SHM_BAD_ARGS (nothing was touched). */
int shm_allreduce(void *base, int64_t world, int64_t rank, int64_t slot_bytes, void *data, int64_t numel,
                  int dtype, int op, int tag, int64_t timeout_ns) {
    if (base == NULL || world < 1 || world > MAX_WORLD || rank < 0 || rank >= world || slot_bytes < 64
        || slot_bytes % 64 != 0 || numel < 0 || (numel > 0 && data == NULL) || tag < 0 || tag > 255
        || dtype < DT_F32 || dtype > DT_I32 || op < OP_SUM || op > OP_MAX || (op != OP_SUM && dtype != DT_I32)
        || numel >= ((int64_t)1 << 47))
        return SHM_BAD_ARGS;
    int64_t *abort_word = (int64_t *)((char *)base + ABORT_OFFSET);
    if (aborted(abort_word)) return SHM_ABORTED;
    if (numel == 0) return SHM_OK;
    int64_t esize = dtype == DT_BF16 ? 2 : 4;
    uint64_t sig = ((uint64_t)numel << 16) | ((uint64_t)tag << 8) | ((uint64_t)dtype << 4) | (uint64_t)op;
    rank_ctl *ctl = (rank_ctl *)((char *)base + HEADER_BYTES);
    char *buffers = (char *)base + data_offset(world);
    rank_ctl *mine = &ctl[rank];
    int64_t per_piece = slot_bytes / esize;
    char *pieces[MAX_WORLD];
    int rc = SHM_OK;
    for (int64_t off = 0; off < numel && rc == SHM_OK; off += per_piece) {
        int64_t n = numel - off < per_piece ? numel - off : per_piece;
        int64_t s = __atomic_load_n(&mine->seq, __ATOMIC_RELAXED) + 1;
        int b = (int)(s & 1);
        char *src = (char *)data + off * esize;
        for (int64_t p = 0; p < world && rc == SHM_OK; p++)  /* 1. my buffer b is free */
            if (p != rank) rc = wait_at_least(&ctl[p].done, s - 2, abort_word, timeout_ns);
        if (rc != SHM_OK) break;
        char *own = buffers + (rank * 2 + b) * slot_bytes;
        memcpy(own, src, (size_t)(n * esize));        /* 2. post the piece */
        __atomic_store_n(&mine->sig[b], sig, __ATOMIC_RELAXED);
        __atomic_store_n(&mine->nbytes[b], n * esize, __ATOMIC_RELAXED);
        __atomic_store_n(&mine->seq, s, __ATOMIC_RELEASE);
        for (int64_t p = 0; p < world && rc == SHM_OK; p++) {  /* 3. every peer posted the same piece */
            pieces[p] = buffers + (p * 2 + b) * slot_bytes;
            if (p == rank) continue;
            rc = wait_at_least(&ctl[p].seq, s, abort_word, timeout_ns);
            if (rc == SHM_OK && (__atomic_load_n(&ctl[p].sig[b], __ATOMIC_RELAXED) != sig
                                 || __atomic_load_n(&ctl[p].nbytes[b], __ATOMIC_RELAXED) != n * esize))
                rc = SHM_MISMATCH;
        }
        if (rc != SHM_OK) break;
        reduce_piece(src, pieces, world, n, dtype, op);
        __atomic_store_n(&mine->done, s, __ATOMIC_RELEASE);  /* 4. done reading piece s */
    }
    if (rc == SHM_TIMEOUT || rc == SHM_MISMATCH) shm_allreduce_abort(base);
    return rc;
}
