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

/* Eight weight rows (one group) times `TR` activation rows x (k apart), their block sums given. */
static inline __attribute__((always_inline)) void group8_float(int type, const uint8_t *w,
                                                               const float *x, const float *sums,
                                                               int64_t blocks, int64_t k, float *y,
                                                               int64_t ldy, const int TR) {
    const __m256i low = _mm256_set1_epi32(0x0f);
    const int64_t size = block_bytes(type), codes_at = type == Q4_1 ? 32 : 16;
    __m256 acc[4];
    for (int r = 0; r < TR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b, w += size) {
        for (int64_t line = 0; line < size; line += 64)
            __builtin_prefetch(w + PREFETCH_BYTES + line, 0, 3);
        __m256 part[4];
        for (int r = 0; r < TR; ++r) part[r] = _mm256_setzero_ps();
        const float *xb = x + 32 * b;
        for (int j = 0; j < 4; ++j) {
            const __m256i v = load32(w + codes_at + 32 * j);
            for (int t = 0; t < 4; ++t) {
                const __m256 lo =
                    _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8 * t), low));
                const __m256 hi =
                    _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8 * t + 4), low));
                for (int r = 0; r < TR; ++r) {
                    part[r] = _mm256_fmadd_ps(lo, _mm256_broadcast_ss(xb + r * k + 4 * j + t), part[r]);
                    part[r] = _mm256_fmadd_ps(hi, _mm256_broadcast_ss(xb + r * k + 16 + 4 * j + t),
                                              part[r]);
                }
            }
        }
        const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
        const __m256 offset = type == Q4_1
                                  ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 16)))
                                  : _mm256_mul_ps(scale, _mm256_set1_ps(-8.0f));
        for (int r = 0; r < TR; ++r) {
            acc[r] = _mm256_fmadd_ps(scale, part[r], acc[r]);
            acc[r] = _mm256_fmadd_ps(offset, _mm256_broadcast_ss(sums + r * blocks + b), acc[r]);
        }
    }
    for (int r = 0; r < TR; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

typedef struct {
    int type;
    int64_t blocks, k, rows, ldy;
    const uint8_t *w;
    const float *x, *sums;
    float *y;
} FloatTask;

static void run_float_groups(void *arg, int64_t first, int64_t end) {
    const FloatTask *t = arg;
    const int64_t size = block_bytes(t->type);
    for (int64_t g = first; g < end; ++g) {
        const uint8_t *w = t->w + g * t->blocks * size;
        int64_t r = 0;
        for (; r + 4 <= t->rows; r += 4)
            group8_float(t->type, w, t->x + r * t->k, t->sums + r * t->blocks, t->blocks, t->k,
                         t->y + r * t->ldy + 8 * g, t->ldy, 4);
        for (; r < t->rows; ++r)  // the last rows one by one: the same lane operations as in 4s
            group8_float(t->type, w, t->x + r * t->k, t->sums + r * t->blocks, t->blocks, t->k,
                         t->y + r * t->ldy + 8 * g, t->ldy, 1);
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
        run_parallel(run_float_groups, &task, groups, chunk_size(groups, threads, 2, 1), threads);
        column += parts[p].out;
    }
    return 0;
}
