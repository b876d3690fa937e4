/* The worker pool of task_pool.h (Linux: futex; elsewhere the caller runs every task itself). */
#include "task_pool.h"

#include <stdatomic.h>
#include <stddef.h>
#include <time.h>

#include "vector_math.h"

#if defined(__linux__)
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#define TASK_POOL_MAX_WORKERS 63
#define TASK_POOL_SPIN_US 300  /* how long an idle worker keeps polling before it sleeps */
#define TASK_POOL_CALLER_SPINS 4096  /* pause rounds before the caller, waiting for a task, yields */

/* One call's work. Calls alternate between two descriptors: a worker that read call g's claim word
 * may read the descriptor late, but it runs a task only after claiming it with call g's generation,
 * and while call g has an unfinished claimed task, call g + 2 cannot have started. */
typedef struct {
    task_fn fn;
    void *context;
    int64_t tasks;
    int active;  /* workers allowed to join */
} Call;

static struct {
    pthread_mutex_t lock;        /* one call at a time; guards starting workers */
    int workers;                 /* started so far */
    _Atomic uint64_t claim;      /* generation << 32 | the next unclaimed task */
    _Atomic uint32_t generation; /* bumped once per call: the futex word idle workers wait on */
    _Atomic int64_t done;        /* tasks of the current call finished */
    _Atomic int sleeping;        /* workers waiting on the futex */
    Call call[2];
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static void futex_wait(_Atomic uint32_t *word, uint32_t value) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *word) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, TASK_POOL_MAX_WORKERS, NULL, NULL, 0);
}

/* Claim and run tasks of call `generation` until none is left or another call has begun. */
static void run_tasks(uint32_t generation) {
    const Call *call = &pool.call[generation % 2];
    uint64_t claim = atomic_load(&pool.claim);
    for (;;) {
        if ((uint32_t)(claim >> 32) != generation || (int64_t)(uint32_t)claim >= call->tasks) return;
        if (!atomic_compare_exchange_weak(&pool.claim, &claim, claim + 1)) continue;  /* claim reloaded */
        call->fn(call->context, (int64_t)(uint32_t)claim);
        atomic_fetch_add(&pool.done, 1);
        claim = atomic_load(&pool.claim);
    }
}

/* Wait until the generation moves past `seen`: poll (yielding the core) for TASK_POOL_SPIN_US,
 * then sleep on the futex. */
static uint32_t wait_for_call(uint32_t seen) {
    double start = now_us();
    for (;;) {
        uint32_t current = atomic_load(&pool.generation);
        if (current != seen) return current;
        if (now_us() - start < TASK_POOL_SPIN_US) {
            sched_yield();
            continue;
        }
        atomic_fetch_add(&pool.sleeping, 1);
        futex_wait(&pool.generation, seen);  /* returns at once if the generation moved */
        atomic_fetch_sub(&pool.sleeping, 1);
        start = now_us();
    }
}

static void *worker_main(void *arg) {
    int index = (int)(intptr_t)arg;
    denormals_flush_begin();  /* kept for the thread's life: it runs nothing but the kernels' tasks */
    uint32_t seen = atomic_load(&pool.generation);
    for (;;) {
        seen = wait_for_call(seen);
        if (index < pool.call[seen % 2].active) run_tasks(seen);
    }
    return NULL;
}

/* After fork only the forking thread exists in the child: forget the workers (the child starts
 * its own if it calls in). The lock is held across fork by `before_fork`. */
static void before_fork(void) { pthread_mutex_lock(&pool.lock); }
static void after_fork_parent(void) { pthread_mutex_unlock(&pool.lock); }
static void after_fork_child(void) {
    pool.workers = 0;
    atomic_store(&pool.sleeping, 0);
    pthread_mutex_unlock(&pool.lock);
}

static pthread_once_t fork_handlers_once = PTHREAD_ONCE_INIT;
static void install_fork_handlers(void) { pthread_atfork(before_fork, after_fork_parent, after_fork_child); }

static void start_workers(int wanted) {
    pthread_once(&fork_handlers_once, install_fork_handlers);
    while (pool.workers < wanted) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attr, worker_main, (void *)(intptr_t)pool.workers);
        pthread_attr_destroy(&attr);
        if (failed) break;  /* run with the workers there are */
        pool.workers++;
    }
}

void task_pool_run(int threads, task_fn fn, void *context, int64_t tasks) {
    if (tasks <= 0) return;
    int wanted = threads - 1 < TASK_POOL_MAX_WORKERS ? threads - 1 : TASK_POOL_MAX_WORKERS;
    if (wanted > tasks - 1) wanted = (int)(tasks - 1);
    if (wanted < 1 || tasks > UINT32_MAX || pthread_mutex_trylock(&pool.lock) != 0) {
        for (int64_t i = 0; i < tasks; i++) fn(context, i);
        return;
    }
    start_workers(wanted);
    uint32_t generation = atomic_load(&pool.generation) + 1;
    Call *call = &pool.call[generation % 2];
    call->fn = fn;
    call->context = context;
    call->tasks = tasks;
    call->active = wanted < pool.workers ? wanted : pool.workers;
    atomic_store(&pool.done, 0);
    atomic_store(&pool.claim, (uint64_t)generation << 32);
    atomic_store(&pool.generation, generation);
    if (atomic_load(&pool.sleeping) > 0) futex_wake_all(&pool.generation);
    run_tasks(generation);
    /* every task is claimed now; wait for the ones workers are running (yielding after a while, in
     * case a worker waits for this very core: more threads than CPUs) */
    for (int spins = 0; atomic_load(&pool.done) < tasks; spins++) {
        if (spins < TASK_POOL_CALLER_SPINS)
            cpu_relax();
        else
            sched_yield();
    }
    pthread_mutex_unlock(&pool.lock);
}

#else  /* no futex: the caller runs every task */
void task_pool_run(int threads, task_fn fn, void *context, int64_t tasks) {
    (void)threads;
    for (int64_t i = 0; i < tasks; i++) fn(context, i);
}
#endif
