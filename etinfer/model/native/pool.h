/* Threads kept for the quantized matmuls (pool.c). */
#pragma once
#include <stdint.h>

/* Calls fn(arg, first, end) over [0, total) in chunks of `chunk`, on the calling thread and up to
 * threads - 1 kept ones, each taking the next chunk when done; returns when all are done. */
void run_parallel(void (*fn)(void *, int64_t, int64_t), void *arg, int64_t total, int64_t chunk,
                  int64_t threads);
