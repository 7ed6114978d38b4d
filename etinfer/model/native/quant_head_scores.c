/* Prompt rows scored by an output head on interleaved blocks without writing its logits out
 * (model/head_scores.py): each thread makes a tile of logits at a time (TILE_COLUMNS of every
 * row, in L2) with quant_matmul8's own arithmetic and folds it into each row's state
 * (row_score.h: maximum, sum of exponentials, count above the scored token's logit, the largest
 * with their ids); the threads' states are merged at the end.
 *
 * Written out, Gemma 3's 262,144 logits a row were 134 MB for 128 rows, written by the head and
 * read twice more (its candidates, then the scores): 30 ms beside the head's 153 on two cores.
 * Folded in as they are made they never leave the cache. */
#include <stdlib.h>

#include "pool.h"
#include "quant.h"
#include "row_score.h"

enum { TILE_COLUMNS = 512 };  // a tile's logits a row: 128 rows of them are 256 KiB

/* x [rows, k] float32 times the interleaved weight [out, k] (`type` Q4_0, Q4_1 or Q8_0, its
 * activations quantized to 8 bits a block as quant_matmul8's are), per row r: the largest logit
 * (most), the sum of exp(logit - most) (sums), the count of logits above references[r] (above),
 * the logit of token targets[r] (target_logits), and the `top` largest logits and their ids,
 * largest first (top_ids, top_logits [rows, top]). Returns 0; -1 for a layout, a `top` (at most
 * MAX_TOP) or a target out of range (nothing written); -3 without memory. */
int head_scores8(int type, const uint8_t *w, int64_t out, int64_t k, const float *x, int64_t rows,
                 const int64_t *targets, const float *references, int64_t top, int64_t threads,
                 float *most, double *sums, int64_t *above, float *target_logits,
                 int64_t *top_ids, float *top_logits) {
    if ((type != Q4_0 && type != Q4_1 && type != Q8_0) || out % 8 || k % 32) return -1;
    if (top < 0 || top > MAX_TOP || top > out) return -1;
    for (int64_t r = 0; r < rows; ++r)
        if (targets[r] < 0 || targets[r] >= out) return -1;
    if (rows == 0) return 0;
    if (threads < 1) threads = 1;
    Act32 *x32 = scratch_of((size_t)(rows * (k / 32)) * sizeof(Act32));
    RowScore *states = malloc((size_t)(threads * rows) * sizeof(RowScore));
    float *tiles = aligned_alloc(64, (size_t)(threads * rows * TILE_COLUMNS) * sizeof(float));
    if (x32 == NULL || states == NULL || tiles == NULL) {
        free(states);
        free(tiles);
        return -3;
    }
    quantize_act32(x, rows, k, x32, threads, 0);
    const int64_t groups = out / 8, tile_groups = TILE_COLUMNS / 8;
    // One contiguous share of the groups a thread, in order: merged by thread, ties among the
    // largest keep the lower id first, as one pass over a whole row does.
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < threads; ++t) {
        const int64_t first = groups * t / threads, end = groups * (t + 1) / threads;
        RowScore *state = states + t * rows;
        float *tile = tiles + t * rows * TILE_COLUMNS;
        for (int64_t r = 0; r < rows; ++r) row_score_start(&state[r]);
        for (int64_t g = first; g < end; g += tile_groups) {
            const int64_t stop = g + tile_groups < end ? g + tile_groups : end;
            const int64_t n = 8 * (stop - g);
            matmul8_groups(type, w, k, x32, rows, g, stop, tile, TILE_COLUMNS);
            for (int64_t r = 0; r < rows; ++r) {
                const float *row = tile + r * TILE_COLUMNS;
                row_score_span(&state[r], row, n, 8 * g, references[r], top);
                const int64_t at = targets[r] - 8 * g;
                if (at >= 0 && at < n) target_logits[r] = row[at];
            }
        }
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; ++r) {
        RowScore *s = states + r;
        for (int64_t t = 1; t < threads; ++t) row_score_merge(s, states + t * rows + r, top);
        most[r] = s->most;
        sums[r] = s->sum;
        above[r] = s->above;
        memcpy(top_ids + r * top, s->ids, (size_t)top * sizeof(int64_t));
        memcpy(top_logits + r * top, s->top, (size_t)top * sizeof(float));
    }
    free(states);
    free(tiles);
    return 0;
}
