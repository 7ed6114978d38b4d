/* Output rows shared among threads by OpenMP's dynamic schedule: a thread that starts late (its
 * core busy with another process) takes fewer chunks, though the call still ends at the loop's
 * barrier, when every thread of the team has arrived.
 * The threads are torch's: the library links the libgomp that torch loaded. An earlier pool of
 * threads of its own spun beside torch's, which spin a while after each parallel operation of
 * theirs, and on two cores the two pools took turns: a batch-1 step took 15.3 ms against 10.8.
 */
#include "pool.h"

#include <pthread.h>
#include <stdlib.h>

static _Thread_local void *scratch;
static _Thread_local size_t scratch_bytes;
static pthread_key_t scratch_owner;  // its destructor frees a thread's buffer when it exits
static pthread_once_t owner_made = PTHREAD_ONCE_INIT;

static void make_owner(void) { pthread_key_create(&scratch_owner, free); }

void *scratch_of(size_t bytes) {
    if (bytes > scratch_bytes) {
        pthread_once(&owner_made, make_owner);
        free(scratch);
        scratch = aligned_alloc(64, (bytes + 63) / 64 * 64);
        scratch_bytes = scratch ? bytes : 0;
        pthread_setspecific(scratch_owner, scratch);
    }
    return scratch;
}

int64_t chunk_size(int64_t total, int64_t threads, int64_t minimum, int64_t multiple) {
    if (threads <= 1) return total;
    const int64_t share = (total + 8 * threads - 1) / (8 * threads);
    const int64_t rounded = (share + multiple - 1) / multiple * multiple;
    return rounded < minimum ? minimum : rounded;
}

void run_parallel(void (*fn)(void *, int64_t, int64_t), void *arg, int64_t total, int64_t chunk,
                  int64_t threads) {
    if (total <= 0) return;
    const int64_t chunks = (total + chunk - 1) / chunk;
    if (threads > chunks) threads = chunks;
    if (threads <= 1) {
        fn(arg, 0, total);
        return;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t first = c * chunk;
        fn(arg, first, first + chunk < total ? first + chunk : total);
    }
}
