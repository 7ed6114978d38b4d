/* Block-sparse decode, the parts around the attention kernel (model/block_kernels.py calls
 * them): the CSR pattern of the blocks each decode row reads, and the key-bound and digest scores
 * of every block for every query head. In torch each is some twenty operations a layer, which at 8K
 * tokens cost more than the attention that pruning saves (BENCHMARKS.md, "Entropic pruning"); here each is
 * one pass over what it writes. Both compute exactly what their torch forms in model/attention/pattern.py
 * and control/block_selection.py compute (the pattern bit for bit; the scores up to the order of
 * a dot product's additions).
 */
#include "kv_elements.h"
#include "select_largest.h"

/* Which blocks each (row, KV head) reads, and the pattern of cache rows its query heads read.
 *
 * tables [rows, width] block ids, lens [rows] tokens in context (the current one included);
 * mask [rows, kv_heads, width] the blocks a selector keeps, or NULL for all of them (the block
 * of the current token is read whatever the mask says); window: a sliding window in tokens, or
 * 0 for none. Writes visible [rows, kv_heads, width] (1 where read), crow [rows * kv_heads *
 * group + 1], and cols and outside (one entry a slot of every read block: its cache row
 * kv_head * num_slots + slot, and 1 where the slot is outside the context). A query row
 * (row, kv_head, j) reads its blocks in order, as model/attention/pattern.py lays them
 * out. Returns the entries written, or -1 (nothing valid written) if they would pass
 * `capacity`, or a block id is outside [0, num_blocks). */
int64_t decode_pattern(const int64_t *tables, const int64_t *lens, const uint8_t *mask,
                       int64_t rows, int64_t kv_heads, int64_t width, int64_t group,
                       int64_t block_size, int64_t num_blocks, int64_t window, uint8_t *visible,
                       int32_t *crow, int32_t *cols, uint8_t *outside, int64_t capacity) {
    int64_t entries = 0, query_row = 0;
    crow[0] = 0;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t len = lens[r], current = (len - 1) / block_size;
        for (int64_t h = 0; h < kv_heads; ++h) {
            uint8_t *read = visible + (r * kv_heads + h) * width;
            const uint8_t *kept = mask ? mask + (r * kv_heads + h) * width : NULL;
            int64_t count = 0;
            for (int64_t b = 0; b < width; ++b) {
                int in_context = b * block_size < len;
                if (window > 0) in_context &= (b + 1) * block_size > len - window;
                read[b] = in_context && (!kept || kept[b] || b == current);
                count += read[b];
            }
            const int64_t run = count * block_size;
            if (entries + group * run > capacity) return -1;
            const int64_t first = entries;  // of the group's first query row
            for (int64_t b = 0; b < width; ++b) {
                if (!read[b]) continue;
                const int64_t block = tables[r * width + b];
                if (block < 0 || block >= num_blocks) return -1;
                const int64_t start = (h * num_blocks + block) * block_size;
                const int64_t offset = b * block_size;
                const int64_t end = len - offset;
                const int64_t skip = window > 0 ? len - window - offset : 0;
                for (int64_t t = 0; t < block_size; ++t) {
                    cols[entries + t] = (int32_t)(start + t);
                    outside[entries + t] = t >= end || t < skip;
                }
                entries += block_size;
            }
            for (int64_t j = 1; j < group; ++j) {  // the group's other query heads read the same
                memcpy(cols + entries, cols + first, run * sizeof *cols);
                memcpy(outside + entries, outside + first, run);
                entries += run;
            }
            for (int64_t j = 0; j < group; ++j, ++query_row)
                crow[query_row + 1] = (int32_t)(crow[query_row] + run);
        }
    }
    return entries;
}

/* Whether every one of the n block ids lies in [0, num_blocks). */
static int tables_inside(const int64_t *tables, int64_t n, int64_t num_blocks) {
    for (int64_t i = 0; i < n; ++i)
        if (tables[i] < 0 || tables[i] >= num_blocks) return 0;
    return 1;
}

/* The key-bound score of one block for one query head: sum_c max(q_c M_c, q_c m_c), with the
 * block's maxima M at bounds[top] and minima m dim after them, of `kind`. */
static inline float bound_score(const float *query, const void *bounds, int kind, int64_t top,
                                int64_t dim) {
    v8 acc = {0};
    for (int64_t c = 0; c < dim; c += 8) {
        const v8 x = load8(query + c);
        const v8 a = x * load_kv(bounds, top + c, kind);
        const v8 z = x * load_kv(bounds, top + dim + c, kind);
        const v8i more = a > z;
        acc += (v8)((more & (v8i)a) | (~more & (v8i)z));
    }
    return lane_sum(acc);
}

/* The digest score of one block for one query head: q.mu + spread * ||q * sigma||, from the
 * block's sums of keys and (dim after them) of their squares, over `count` keys. */
static inline float digest_score(const float *query, const float *sums, int64_t count,
                                 float spread, int64_t dim) {
    const float inverse = 1.0f / (float)(count > 0 ? count : 1);
    const v8 zero = {0};
    v8 centre = {0}, reach = {0};
    for (int64_t c = 0; c < dim; c += 8) {
        const v8 x = load8(query + c);
        const v8 mean = load8(sums + c) * inverse;
        v8 variance = load8(sums + dim + c) * inverse - mean * mean;
        variance = (v8)((v8i)variance & (variance > zero));  // rounding: never below 0
        centre += x * mean;
        reach += x * x * variance;
    }
    return lane_sum(centre) + spread * sqrtf(lane_sum(reach));
}

/* Every table entry's score per query head, out [rows, kv_heads, group, width]: by key bounds
 * (moments NULL) or by key digest. q is [rows, kv_heads * group, dim]; `dim` a multiple of 8.
 * Every table entry is scored, padding included, as the torch forms do. Parallel over (row, KV
 * head) pairs; -1 (nothing written) for a block id outside [0, num_blocks). */
static int score_blocks(const float *q, const void *bounds, int kind, const float *moments,
                        const int64_t *tokens, float spread, const int64_t *tables, int64_t rows,
                        int64_t kv_heads, int64_t group, int64_t width, int64_t num_blocks,
                        int64_t dim, float *out, int64_t threads) {
    if (!tables_inside(tables, rows * width, num_blocks)) return -1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t pair = 0; pair < rows * kv_heads; ++pair) {
        const int64_t r = pair / kv_heads, h = pair % kv_heads;
        const float *queries = q + pair * group * dim;
        float *scores = out + pair * group * width;
        for (int64_t b = 0; b < width; ++b) {
            const int64_t at = (h * num_blocks + tables[r * width + b]) * 2 * dim;
            for (int64_t j = 0; j < group; ++j) {
                const float *query = queries + j * dim;
                scores[j * width + b] =
                    moments ? digest_score(query, moments + at, tokens[r * width + b], spread, dim)
                            : bound_score(query, bounds, kind, at, dim);
            }
        }
    }
    return 0;
}

/* Upper bounds of q.k over each block's keys, per query head, with M and m the block's
 * per-channel key maxima and minima, bounds [kv_heads, num_blocks, 2, dim] (maxima first) of
 * `kind` (float32, or the 16-bit type of a cache that stores its keys so); -1 also for a kind
 * it does not read. */
int key_bound_scores(const float *q, const void *bounds, int kind, const int64_t *tables,
                     int64_t rows, int64_t kv_heads, int64_t group, int64_t width,
                     int64_t num_blocks, int64_t dim, float *out, int64_t threads) {
    if (kind != KV_FLOAT32 && kind != KV_FLOAT16 && kind != KV_BFLOAT16) return -1;
    return score_blocks(q, bounds, kind, NULL, NULL, 0.0f, tables, rows, kv_heads, group, width,
                        num_blocks, dim, out, threads);
}

/* Each block's digest score per query head, q.mu + spread * ||q * sigma|| with mu and sigma^2
 * the per-channel mean and variance of its keys, from moments [kv_heads, num_blocks, 2, dim]
 * (float32: the sums of the keys, then of their squares) and tokens [rows, width] (keys in each
 * table entry; none: counted as one). The walk and the bytes of key_bound_scores. */
int key_digest_scores(const float *q, const float *moments, const int64_t *tables,
                      const int64_t *tokens, int64_t rows, int64_t kv_heads, int64_t group,
                      int64_t width, int64_t num_blocks, int64_t dim, float spread, float *out,
                      int64_t threads) {
    return score_blocks(q, NULL, KV_FLOAT32, moments, tokens, spread, tables, rows, kv_heads,
                        group, width, num_blocks, dim, out, threads);
}

/* mask [rows, width]: 1 at the budgets[r] largest of each row of scores (ties at the threshold
 * taken in index order; NaN ranks as -inf), one thread: a torch top-k of this size goes parallel
 * and, on a 2-core VM whose second core has gone idle, spends ~150 us waking it, five times the
 * work. scratch holds `width` floats. A budget outside [0, width] is clamped to it. */
void keep_largest(const float *scores, const int64_t *budgets, int64_t rows, int64_t width,
                  uint8_t *mask, float *scratch) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = scores + r * width;
        uint8_t *keep = mask + r * width;
        const int64_t budget = budgets[r] < 0 ? 0 : budgets[r] > width ? width : budgets[r];
        memset(keep, 0, width);
        if (budget == 0) continue;
        for (int64_t b = 0; b < width; ++b) scratch[b] = row[b] == row[b] ? row[b] : -INFINITY;
        const float threshold = scratch[select_largest(scratch, width, budget - 1)];
        int64_t above = 0;
        for (int64_t b = 0; b < width; ++b) above += row[b] > threshold;
        int64_t ties = budget - above;
        for (int64_t b = 0; b < width; ++b) {
            const float value = row[b] == row[b] ? row[b] : -INFINITY;
            keep[b] = value > threshold || (value == threshold && ties-- > 0);
        }
    }
}
