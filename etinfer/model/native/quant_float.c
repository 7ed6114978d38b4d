/* Q4_0 and Q4_1 weights, rows interleaved by eight (quant_interleaved.c's layout), times float32
 * activations: `auto`'s 4-bit path on hosts without AVX-512, where torch's int4 kernel is slow
 * (held to AVX2, twice this kernel's time at batch 1) and 8-bit activations would cost fidelity.
 *
 * A 32-byte code vector holds four bytes of each of eight rows; shifted by 8t (and 8t + 4) and
 * masked, each 32-bit lane holds one row's code of weight 4j + t (and 16 + 4j + t), which one
 * conversion makes eight floats: one weight of eight rows. Each activation row multiplies it in
 * by one FMA with its activation broadcast; the block's scales (and minimums, or -8 times the
 * scale for Q4_0) multiply the block's sum and the activations' sum once a block. Each output row
 * is one lane through the same operations in the same order whatever the call's other rows, so
 * results are row-invariant; the products are float32's own (no rounding of the activations).
 */
#include "pool.h"
#include "quant.h"

static int64_t block_bytes(int type) { return type == Q4_1 ? 32 + 128 : 16 + 128; }

/* `G` groups of eight weight rows (`stride` bytes apart) times `TR` activation rows x (k apart),
 * their block sums given; G * TR <= 8. Each (row, group) pair is
 * its own chain of FMAs, the same whatever G and TR: several groups at once give a lone row
 * independent chains (one chain waits on each FMA's latency), without changing its bits. */
static inline __attribute__((always_inline)) void tile_float(int type, const uint8_t *w,
                                                             int64_t stride, const float *x,
                                                             const float *sums, int64_t blocks,
                                                             int64_t k, float *y, int64_t ldy,
                                                             const int G, const int TR) {
    const __m256i low = _mm256_set1_epi32(0x0f);
    const int64_t size = block_bytes(type), codes_at = type == Q4_1 ? 32 : 16;
    __m256 acc[8];
    for (int c = 0; c < G * TR; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *wb[4];
        for (int g = 0; g < G; ++g) {
            wb[g] = w + g * stride + b * size;
            for (int64_t line = 0; line < size; line += 64)
                __builtin_prefetch(wb[g] + PREFETCH_BYTES + line, 0, 3);
        }
        __m256 part[8];
        for (int c = 0; c < G * TR; ++c) part[c] = _mm256_setzero_ps();
        const float *xb = x + 32 * b;
        for (int j = 0; j < 4; ++j)
            for (int g = 0; g < G; ++g) {
                const __m256i v = load32(wb[g] + codes_at + 32 * j);
                for (int t = 0; t < 4; ++t) {
                    const __m256 lo =
                        _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8 * t), low));
                    const __m256 hi =
                        _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8 * t + 4), low));
                    for (int r = 0; r < TR; ++r) {
                        __m256 *chain = &part[g * TR + r];
                        *chain = _mm256_fmadd_ps(lo, _mm256_broadcast_ss(xb + r * k + 4 * j + t),
                                                 *chain);
                        *chain = _mm256_fmadd_ps(
                            hi, _mm256_broadcast_ss(xb + r * k + 16 + 4 * j + t), *chain);
                    }
                }
            }
        for (int g = 0; g < G; ++g) {
            const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)wb[g]));
            const __m256 offset =
                type == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb[g] + 16)))
                             : _mm256_mul_ps(scale, _mm256_set1_ps(-8.0f));
            for (int r = 0; r < TR; ++r) {
                __m256 *total = &acc[g * TR + r];
                *total = _mm256_fmadd_ps(scale, part[g * TR + r], *total);
                *total = _mm256_fmadd_ps(offset, _mm256_broadcast_ss(sums + r * blocks + b), *total);
            }
        }
    }
    for (int g = 0; g < G; ++g)
        for (int r = 0; r < TR; ++r) _mm256_storeu_ps(y + r * ldy + 8 * g, acc[g * TR + r]);
}

typedef struct {
    int type;
    int64_t blocks, k, rows, ldy;
    const uint8_t *w;
    const float *x, *sums;
    float *y;
} FloatTask;

/* Groups [first, end): each group over the rows eight at a time, then four (its weights stay in
 * the cache while the rows pass; eight rows convert each weight vector for twice the FMAs of
 * four: held to AVX2, 11-15 % less time at 16 and 512 rows); the rows left over one at a time,
 * four groups at once. */
static void run_float_groups(void *arg, int64_t first, int64_t end) {
    const FloatTask *t = arg;
    const int64_t stride = t->blocks * block_bytes(t->type), eights = t->rows / 8 * 8,
                  quads = t->rows / 4 * 4;
    for (int64_t g = first; g < end; ++g) {
        for (int64_t r = 0; r < eights; r += 8)
            tile_float(t->type, t->w + g * stride, stride, t->x + r * t->k,
                       t->sums + r * t->blocks, t->blocks, t->k, t->y + r * t->ldy + 8 * g,
                       t->ldy, 1, 8);
        for (int64_t r = eights; r < quads; r += 4)
            tile_float(t->type, t->w + g * stride, stride, t->x + r * t->k,
                       t->sums + r * t->blocks, t->blocks, t->k, t->y + r * t->ldy + 8 * g,
                       t->ldy, 1, 4);
    }
    for (int64_t r = quads; r < t->rows; ++r) {
        const float *x = t->x + r * t->k, *sums = t->sums + r * t->blocks;
        float *y = t->y + r * t->ldy;
        int64_t g = first;
        for (; g + 4 <= end; g += 4)
            tile_float(t->type, t->w + g * stride, stride, x, sums, t->blocks, t->k, y + 8 * g,
                       t->ldy, 4, 1);
        for (; g < end; ++g)
            tile_float(t->type, t->w + g * stride, stride, x, sums, t->blocks, t->k, y + 8 * g,
                       t->ldy, 1, 1);
    }
}

typedef struct {
    const float *x;
    int64_t k;
    float *sums;
} SumTask;

/* Rows [first, end)'s block sums, each by the same tree of vector adds: where a row is summed,
 * and beside which rows, does not change its bits. */
static void sum_blocks(void *arg, int64_t first, int64_t end) {
    const SumTask *t = arg;
    const int64_t blocks = t->k / 32;
    for (int64_t r = first; r < end; ++r)
        for (int64_t b = 0; b < blocks; ++b) {
            const float *x = t->x + r * t->k + 32 * b;
            const __m256 low = _mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8));
            const __m256 high = _mm256_add_ps(_mm256_loadu_ps(x + 16), _mm256_loadu_ps(x + 24));
            t->sums[r * blocks + b] = lanes_sum(_mm256_add_ps(low, high));
        }
}

/* Groups a chunk: a multiple of four (a lone row takes four at once), rounded down from
 * chunk_size's share so that 72 groups (576 rows) make 18 chunks, not 9 that two threads split
 * 5 to 4. */
static int64_t group_chunk(int64_t groups, int64_t threads) {
    if (threads <= 1) return groups;
    const int64_t share = groups / (8 * threads) / 4 * 4;
    return share < 4 ? 4 : share;
}

/* y [rows, sum of the parts' outs] = x [rows, k] times the parts' weights stacked by output rows,
 * every part interleaved Q4_0 or Q4_1. Returns 0; -1 for another format or layout, -3 without
 * memory for the activations' block sums (a buffer of the calling thread's, kept for its next
 * call). */
int float_linear(const BlockPart *parts, int64_t count, const float *x, int64_t rows, int64_t k,
                 float *y, int64_t threads) {
    int64_t total = 0;
    for (int64_t p = 0; p < count; ++p) {
        const int type = (int)parts[p].type;
        if ((type != Q4_0 && type != Q4_1) || !parts[p].interleaved || parts[p].out % 8)
            return -1;
        total += parts[p].out;
    }
    if (k <= 0 || k % 32) return -1;
    if (rows == 0 || total == 0) return 0;
    const int64_t blocks = k / 32;
    float *sums = scratch_of((size_t)(rows * blocks) * sizeof(float));
    if (sums == NULL) return -3;
    SumTask sum = {x, k, sums};
    run_parallel(sum_blocks, &sum, rows, chunk_size(rows, threads, 64, 1), threads);
    int64_t column = 0;
    for (int64_t p = 0; p < count; ++p) {
        FloatTask task = {(int)parts[p].type, blocks, k, rows, total, parts[p].w, x, sums,
                          y + column};
        const int64_t groups = parts[p].out / 8;
        run_parallel(run_float_groups, &task, groups, group_chunk(groups, threads), threads);
        column += parts[p].out;
    }
    return 0;
}
