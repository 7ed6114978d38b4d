/* What the KV cache keeps per block for pruning's scorers (model/kv_cache.py), kept where the keys
 * are written and where attention weighs the blocks: the layer-by-layer path calls these after
 * its cache write and attention, the native decoder (decoder.c) inside its step, so a step keeps
 * the same summaries whichever path it took. In torch they were some fifteen operations a layer
 * and step (about 0.9 ms of a 9 ms batch-1 step on the default model).
 */
#include "kernels.h"

/* Element `at` of a 16-bit array (a cache's or its bounds'), widened to float32. */
static inline float widened(const void *base, int64_t at, int kind) {
    const uint16_t h = ((const uint16_t *)base)[at];
    if (kind == KV_FLOAT16) return half_to_float(h);
    const uint32_t bits = (uint32_t)h << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

static inline float bound_at(const void *bounds, int64_t at, int kind) {
    return kind == KV_FLOAT32 ? ((const float *)bounds)[at] : widened(bounds, at, kind);
}

/* A bound takes a key: a 16-bit cache's bounds are in its own type and take the stored element
 * itself (exact, no conversion back); float32 bounds take its float32 value. */
static inline void take_key(void *bounds, int64_t at, int kind, float key, const void *cache,
                            int64_t from) {
    if (kind == KV_FLOAT32)
        ((float *)bounds)[at] = key;
    else
        ((uint16_t *)bounds)[at] = ((const uint16_t *)cache)[from];
}

/* An empty bound: -inf for a largest, +inf for a smallest, in the bounds' type. */
static inline void set_empty(void *bounds, int64_t at, int kind, int largest) {
    if (kind == KV_FLOAT32)
        ((float *)bounds)[at] = largest ? -INFINITY : INFINITY;
    else
        ((uint16_t *)bounds)[at] = (largest ? 0x8000u : 0) | (kind == KV_FLOAT16 ? 0x7c00u : 0x7f80u);
}

/* Element i of a stored cache row (an int8 row times its scale), in float32. */
static inline float stored(const void *cache, int64_t row, int64_t i, int64_t dim, int kind,
                           const float *scales) {
    const int64_t at = row * dim + i;
    switch (kind) {
        case KV_FLOAT32: return ((const float *)cache)[at];
        case KV_INT8: return (float)((const int8_t *)cache)[at] * scales[row];
        default: return widened(cache, at, kind);
    }
}

/* The block summaries of one layer after its keys and values at `slots` [rows] were written.
 * Blocks in `fresh` [num_fresh] receive their first token this step and start afresh: bounds
 * empty, mass +inf (unknown until attended to), sums zero. Then each row's block takes its key
 * into its bounds (per channel the largest [.., 0, :] and smallest [.., 1, :], in `bound_kind`:
 * a 16-bit cache's own, else float32), its value into the value sums and, where `moments` is
 * given, the key and its square into them. Layouts per KV head and block: bounds and moments
 * [kv_heads, blocks, 2, dim], mass [kv_heads, blocks], value sums [kv_heads, blocks, dim]. */
void update_block_summaries(const void *keys, const void *values, const float *key_scales,
                            const float *value_scales, int kind, const int64_t *slots,
                            int64_t rows, int64_t kv_heads, int64_t num_slots, int64_t dim,
                            int64_t block_size, const int64_t *fresh, int64_t num_fresh,
                            void *bounds, int bound_kind, float *mass, float *value_sums,
                            float *moments) {
    const int64_t blocks = num_slots / block_size;
    for (int64_t h = 0; h < kv_heads; ++h)
        for (int64_t f = 0; f < num_fresh; ++f) {
            const int64_t block = h * blocks + fresh[f];
            for (int64_t i = 0; i < dim; ++i) {
                set_empty(bounds, 2 * block * dim + i, bound_kind, 1);
                set_empty(bounds, (2 * block + 1) * dim + i, bound_kind, 0);
                value_sums[block * dim + i] = 0.0f;
                if (moments) moments[2 * block * dim + i] = moments[(2 * block + 1) * dim + i] = 0;
            }
            mass[block] = INFINITY;
        }
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < kv_heads; ++h) {
            const int64_t row = h * num_slots + slots[r], block = h * blocks + slots[r] / block_size;
            for (int64_t i = 0; i < dim; ++i) {
                const float key = stored(keys, row, i, dim, kind, key_scales);
                const int64_t high = 2 * block * dim + i, low = high + dim, at = row * dim + i;
                if (key > bound_at(bounds, high, bound_kind))
                    take_key(bounds, high, bound_kind, key, keys, at);
                if (key < bound_at(bounds, low, bound_kind))
                    take_key(bounds, low, bound_kind, key, keys, at);
                value_sums[block * dim + i] += stored(values, row, i, dim, kind, value_scales);
                if (moments) {
                    moments[high] += key;
                    moments[low] += key * key;
                }
            }
        }
}

/* Each attended block's attention mass into `mass` [kv_heads * blocks], from a decode step's
 * pattern (rows' entries crow/cols, cache rows kv_head * num_slots + slot), the entries'
 * unnormalised weights and each row's softmax denominator: the mean over the `group` query
 * heads that share the KV head of their shares, replacing what the block held. */
void observe_block_mass(float *mass, const int32_t *crow, const int32_t *cols,
                        const float *weights, const float *denominators, int64_t rows,
                        int64_t block_size, int64_t group) {
    const int64_t nnz = crow[rows];
    for (int64_t e = 0; e < nnz; ++e) mass[cols[e] / block_size] = 0.0f;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t e = crow[r]; e < crow[r + 1]; ++e)
            mass[cols[e] / block_size] += weights[e] / denominators[r] / (float)group;
}
