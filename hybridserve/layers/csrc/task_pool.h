/* A small pool of worker threads for the kernels that Python calls one after another during a
 * prefill chunk's forward (csrc/task_pool.c).
 *
 * With OpenMP each such call is a parallel region whose worker has gone back to sleep in the tens
 * of microseconds of Python between two calls (GOMP_SPINCOUNT is kept short: spinning workers
 * stall every region when another process holds a core), and waking it took 40-85 us on the 2-core
 * KVM guest, while the caller waited for it at the region's end. Here:
 *   - the caller claims tasks too, from the same counter, and waits only for tasks a worker has
 *     started: a worker that wakes late takes fewer tasks instead of holding up the call;
 *   - an idle worker keeps polling for TASK_POOL_SPIN_US, yielding the core on every round, so a
 *     call that follows within that time finds it awake, and a process that wants the core gets it;
 *     then it sleeps on a futex until the next call.
 * One call runs at a time (the model's forward is single-threaded in Python); a call made while
 * another runs, from a child after fork, or with one thread runs on the caller alone.
 */
#ifndef HYBRIDSERVE_TASK_POOL_H
#define HYBRIDSERVE_TASK_POOL_H

#include <stdint.h>

typedef void (*task_fn)(void *context, int64_t task);

/* fn(context, i) for every i in [0, tasks), on the caller and up to threads - 1 workers; returns
 * when all are done. Each worker thread keeps flush-to-zero / denormals-are-zero set (the kernels
 * run with them, see vector_math.h); the caller's own mode is the caller's business. */
void task_pool_run(int threads, task_fn fn, void *context, int64_t tasks);

#endif
