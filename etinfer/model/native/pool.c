/* Output rows shared among threads by OpenMP's dynamic schedule: a thread that starts late (its
 * core busy with another process) takes fewer chunks, though the call still ends at the loop's
 * barrier, when every thread of the team has arrived.
 * The threads are torch's: the library links the libgomp that torch loaded. An earlier pool of
 * threads of its own spun beside torch's, which spin a while after each parallel operation of
 * theirs, and on two cores the two pools took turns: a batch-1 step took 15.3 ms against 10.8.
 */
#include "pool.h"

int64_t chunk_size(int64_t total, int64_t threads, int64_t minimum, int64_t multiple) {
    if (threads <= 1) return total;
    const int64_t share = (total + 8 * threads - 1) / (8 * threads);
    const int64_t rounded = (share + multiple - 1) / multiple * multiple;
    return rounded < minimum ? minimum : rounded;
}

void run_parallel(void (*fn)(void *, int64_t, int64_t), void *arg, int64_t total, int64_t chunk,
                  int64_t threads) {
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
