/* How the quantized matmuls share a call's output rows among threads (pool.c). */
#pragma once
#include <stddef.h>
#include <stdint.h>

/* Calls fn(arg, first, end) over [0, total) in chunks of `chunk` on up to `threads` of torch's
 * OpenMP threads, each taking the next chunk when done; returns when all are done. */
void run_parallel(void (*fn)(void *, int64_t, int64_t), void *arg, int64_t total, int64_t chunk,
                  int64_t threads);

/* A chunk for run_parallel: eight a thread, at least `minimum`, a multiple of `multiple`. Enough
 * that a thread that starts late still finds work, few enough that taking one costs little
 * beside it: chunks of 16 rows made two threads barely faster than one on the default model's
 * 576-row matrices. */
int64_t chunk_size(int64_t total, int64_t threads, int64_t minimum, int64_t multiple);

/* A buffer of at least `bytes` of the calling thread's own, kept for its next call (a large
 * prefill's buffers would otherwise be mapped and unmapped on every call); NULL without memory.
 * Freed when the thread exits. */
void *scratch_of(size_t bytes);
