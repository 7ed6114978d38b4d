/* Threads kept for the quantized matmuls. A decode step calls about 120 of them, each a few tens
 * of microseconds of work at batch 1: starting a thread per call (as the attention kernel does
 * for its long calls) would cost as much as the work. Kept threads spin a while after a call,
 * yielding the core to any other runnable thread (torch's own pool among them), then sleep.
 *
 * Work is shared by chunks taken from one counter, the calling thread among the takers: when a
 * kept thread is late (its core busy with another process, or asleep), the caller does its
 * chunks, so no call waits for a thread that is not running. The counter carries the call's
 * number in its high half, so a thread still looking at the last call never takes a chunk of the
 * next one; while a call is written, the counter is closed (an odd number, no chunk to take), so
 * a thread that read a call half-written never finds a chunk to take with it.
 */
#include "pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

enum { MAX_KEPT = 15 };
static const int64_t SPIN_NS = 2000000;  // a decode step's gaps between matmuls are far shorter

typedef struct {
    void (*fn)(void *, int64_t, int64_t);
    void *arg;
    int64_t total, chunk, chunks, helpers;
} Call;

static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER;  // one call at a time
static pthread_mutex_t sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static Call call;
// Each on a cache line of its own: the takers write both, and the waiting threads read them.
static _Alignas(64) _Atomic uint64_t ticket;  // call number << 32 | next chunk
static const uint64_t CLOSED = 0xffffffffu;
static _Alignas(64) _Atomic int64_t done;
static _Alignas(64) _Atomic int64_t sleepers;
static int64_t kept;

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Takes chunks of call number `number` until none is left. */
static void take_chunks(uint32_t number, const Call *c) {
    uint64_t t = atomic_load(&ticket);
    while ((uint32_t)(t >> 32) == number && (int64_t)(t & 0xffffffffu) < c->chunks) {
        if (!atomic_compare_exchange_weak(&ticket, &t, t + 1)) continue;
        const int64_t first = (int64_t)(t & 0xffffffffu) * c->chunk;
        c->fn(c->arg, first, first + c->chunk < c->total ? first + c->chunk : c->total);
        atomic_fetch_add(&done, 1);
        t = atomic_load(&ticket);
    }
}

/* The next open call's number after `seen`, spinning a while before sleeping. */
static uint32_t next_call(uint32_t seen) {
    const int64_t deadline = now_ns() + SPIN_NS;
    for (int spins = 0;; ++spins) {
        const uint64_t t = atomic_load(&ticket);
        if ((uint32_t)(t >> 32) != seen && (t & CLOSED) != CLOSED) return (uint32_t)(t >> 32);
        if (spins % 64 == 63 && now_ns() > deadline) break;
        relax();
        sched_yield();
    }
    pthread_mutex_lock(&sleep_lock);
    atomic_fetch_add(&sleepers, 1);
    uint64_t t;
    while ((t = atomic_load(&ticket)) >> 32 == seen || (t & CLOSED) == CLOSED)
        pthread_cond_wait(&wake, &sleep_lock);
    atomic_fetch_sub(&sleepers, 1);
    pthread_mutex_unlock(&sleep_lock);
    return (uint32_t)(t >> 32);
}

static void *keep(void *index_) {
    const int64_t index = (int64_t)(intptr_t)index_;
    uint32_t seen = (uint32_t)(atomic_load(&ticket) >> 32);
    for (;;) {
        seen = next_call(seen);
        const Call c = call;  // consistent if the ticket still has this number when a chunk is taken
        if (index < c.helpers) take_chunks(seen, &c);
    }
    return NULL;
}

static void forget_threads(void) { kept = 0; }  // a forked child has none of them

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, forget_threads); }

int64_t chunk_size(int64_t total, int64_t threads, int64_t minimum, int64_t multiple) {
    if (threads <= 1) return total;
    const int64_t share = (total + 8 * threads - 1) / (8 * threads);
    const int64_t rounded = (share + multiple - 1) / multiple * multiple;
    return rounded < minimum ? minimum : rounded;
}

void run_parallel(void (*fn)(void *, int64_t, int64_t), void *arg, int64_t total, int64_t chunk,
                  int64_t threads) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, register_fork_handler);
    const int64_t chunks = (total + chunk - 1) / chunk;
    int64_t helpers = threads - 1 < chunks - 1 ? threads - 1 : chunks - 1;
    if (helpers > MAX_KEPT) helpers = MAX_KEPT;
    if (helpers <= 0) {
        fn(arg, 0, total);
        return;
    }
    pthread_mutex_lock(&call_lock);
    while (kept < helpers) {  // started once, on the first call that wants them
        pthread_t thread;
        if (pthread_create(&thread, NULL, keep, (void *)(intptr_t)kept) != 0) break;
        pthread_detach(thread);
        ++kept;
    }
    const uint32_t number = (uint32_t)(atomic_load(&ticket) >> 32) + 2;
    atomic_store(&ticket, (uint64_t)(number - 1) << 32 | CLOSED);
    call = (Call){fn, arg, total, chunk, chunks, helpers};
    atomic_store(&done, 0);
    atomic_store(&ticket, (uint64_t)number << 32);
    if (atomic_load(&sleepers) > 0) {
        pthread_mutex_lock(&sleep_lock);
        pthread_cond_broadcast(&wake);
        pthread_mutex_unlock(&sleep_lock);
    }
    take_chunks(number, &call);
    while (atomic_load(&done) < chunks) relax();
    pthread_mutex_unlock(&call_lock);
}
