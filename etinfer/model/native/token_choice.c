/* The choice of single tokens for key_sketch.c's sketch_token_pattern (control/key_sketch.py's
 * sketch_token_pattern holds the torch form): each context's sink and recent tokens, and the
 * best others by their score under the low-rank key copy. The threshold is found in O(n) on a
 * copy of the scores (where a top-k sorts what it keeps), the kept tokens written in one ordered
 * pass; at 8K tokens and group 3 some 15 us a (sequence, KV head) pair, where its logits take
 * 40: a plain quickselect mispredicts a branch every other value and took 60. */
#include <float.h>

#include "vector_math.h"
#include "select_largest.h"

/* The tokens of a context of `tokens` (of len, clamped to its table's room) always kept:
 * [0, *lo) and [*hi, tokens), t < sink or t >= len - recent. */
static inline void forced_range(int64_t len, int64_t tokens, int64_t sink, int64_t recent,
                                int64_t *lo, int64_t *hi) {
    *lo = sink < 0 ? 0 : sink > tokens ? tokens : sink;
    *hi = len - recent < *lo ? *lo : len - recent > tokens ? tokens : len - recent;
}

/* crow [seqs * heads + 1]: each sequence's count, min(tokens, max(budgets[s], forced)), for
 * each of its `heads` rows, summed (its tokens: lens[s] clamped to [0, room]). Returns crow's
 * last, or -2 past int32's range. */
int token_offsets(const int64_t *lens, const int64_t *budgets, int64_t seqs, int64_t heads,
                  int64_t room, int64_t sink, int64_t recent, int32_t *crow) {
    int64_t total = 0, lo, hi;
    crow[0] = 0;
    for (int64_t s = 0; s < seqs; ++s) {
        const int64_t tokens = lens[s] < 0 ? 0 : lens[s] > room ? room : lens[s];
        forced_range(lens[s], tokens, sink, recent, &lo, &hi);
        const int64_t forced = lo + tokens - hi;
        const int64_t wanted = budgets[s] > forced ? budgets[s] : forced;
        const int64_t count = wanted < tokens ? wanted : tokens;
        for (int64_t r = 0; r < heads; ++r) {
            if ((total += count) > INT32_MAX) return -2;
            crow[s * heads + r + 1] = (int32_t)total;
        }
    }
    return (int)total;
}

enum { BINS = 256, CHUNK = 64 };

/* x[0, n) with NaN as -inf into x and into copy (which may be x), and its finite range into
 * *low and *high (inf and -inf where there is none). */
static void clean(float *x, float *copy, int64_t n, float *low, float *high) {
    v8 lo = (v8){0} + INFINITY, hi = (v8){0} - INFINITY;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8 v = load8(x + i);
        v = blend(v == v, v, (v8){0} - INFINITY);
        memcpy(x + i, &v, sizeof v);
        memcpy(copy + i, &v, sizeof v);
        const v8i finite = (v > -INFINITY) & (v < INFINITY);
        lo = blend(finite & (v < lo), v, lo);
        hi = blend(finite & (v > hi), v, hi);
    }
    *low = INFINITY, *high = -INFINITY;
    for (int l = 0; l < 8; ++l) {
        *low = lo[l] < *low ? lo[l] : *low;
        *high = hi[l] > *high ? hi[l] : *high;
    }
    for (; i < n; ++i) {
        copy[i] = x[i] = x[i] == x[i] ? x[i] : -INFINITY;
        const int finite = x[i] > -INFINITY && x[i] < INFINITY;
        *low = finite && x[i] < *low ? x[i] : *low;
        *high = finite && x[i] > *high ? x[i] : *high;
    }
}

/* The bins of x[0, n), n <= CHUNK, BINS of them from `low` on, 1 / inverse wide (the ends
 * clamped): monotone in x, so that each bin's values lie between the bins' below and above. */
static inline void bins_of(const float *x, int64_t n, float low, float inverse, int32_t *bins) {
    for (int64_t i = 0; i < n; i += 8) {
        v8 v = {0};
        if (n - i >= 8) v = load8(x + i);  // a memcpy of a variable size would stall the load
        else memcpy(&v, x + i, (n - i) * sizeof *x);
        v8 f = (v - low) * inverse;
        f = blend(f > 0.0f, f, (v8){0});
        f = blend(f < (float)(BINS - 1), f, (v8){0} + (float)(BINS - 1));
        const v8i bin = __builtin_convertvector(f, v8i);
        memcpy(bins + i, &bin, sizeof bin);
    }
}

/* The k-th largest (k in [1, n]) of values[0, n) (no NaN; their finite range [low, high]),
 * which it reorders, and into *greater how many exceed it. A quickselect's branches mispredict
 * every other value: the values are first narrowed by histograms over their finite range
 * (passes without branches) to the bin that holds it, and only that bin's are selected among. */
static float kth_largest(float *values, int64_t n, int64_t k, float low, float high,
                         int64_t *greater) {
    int32_t bins[CHUNK];
    *greater = 0;
    for (int round = 0; round < 4 && n > 2 * BINS; ++round) {
        if (round > 0) clean(values, values, n, &low, &high);
        const float inverse = BINS / (high - low);
        if (!(high > low && inverse < INFINITY && inverse > 0.0f)) break;
        int32_t counts[BINS] = {0};
        for (int64_t i = 0; i < n; i += CHUNK) {
            const int64_t m = n - i < CHUNK ? n - i : CHUNK;
            bins_of(values + i, m, low, inverse, bins);
            for (int64_t c = 0; c < m; ++c) ++counts[bins[c]];
        }
        int64_t above = 0, target = BINS - 1;
        while (above + counts[target] < k) above += counts[target--];
        int64_t kept = 0;  // the target bin's values to the front, in place
        for (int64_t i = 0; i < n; i += CHUNK) {
            const int64_t m = n - i < CHUNK ? n - i : CHUNK;
            bins_of(values + i, m, low, inverse, bins);
            for (int64_t c = 0; c < m; ++c) {
                values[kept] = values[i + c];
                kept += bins[c] == target;
            }
        }
        n = kept, k -= above, *greater += above;
    }
    const float kth = values[select_largest(values, n, k - 1)];
    for (int64_t i = 0; i < n; ++i) *greater += values[i] > kth;
    return kth;
}

/* first + i for each bit i of `take`, in order, from `out` on (eight written whatever `take`;
 * int32 into a float buffer, by bytes: no aliasing assumed). */
static inline void pack(float *out, int32_t first, unsigned take) {
#if defined(__AVX2__) && defined(__BMI2__)  // the lanes' indices picked by pext, then permuted
    const uint64_t spread = _pdep_u64(take, 0x0101010101010101ull) * 0xff;
    const __m128i picked = _mm_cvtsi64_si128((int64_t)_pext_u64(0x0706050403020100ull, spread));
    const __m256i at = _mm256_add_epi32(_mm256_set1_epi32(first), _mm256_cvtepu8_epi32(picked));
    _mm256_storeu_si256((__m256i *)(void *)out, at);
#else
    for (int i = 0, m = 0; i < 8; ++i) {
        const int32_t at = first + i;
        memcpy(out + m, &at, sizeof at);
        m += (take >> i) & 1;
    }
#endif
}

/* One (sequence, KV head) pair's rows. `rows` holds each of the group's query heads' logits of
 * the context's `tokens` (a row of `span` floats a head), `lse` each head's log-sum-exp: a
 * token's score is the most log share of the mass any head gives it (NaN ranked as -inf, the
 * forced tokens as inf), into the first row; the second is the selection's copy, then the kept
 * list's. `count` tokens are kept: the forced ones and the best others (ties at the threshold in
 * position order), written in order to cols as cache rows base + table[t / size] * size + t %
 * size, then repeated for the group's other rows (`count` entries each, one after another);
 * kept [width]: the share of each table entry's context tokens kept, 0 where it holds none. */
void choose_tokens(float *rows, int64_t span, int64_t group, const float *lse, int64_t tokens,
                   int64_t len, int64_t sink, int64_t recent, int64_t count,
                   const int64_t *table, int64_t size, int64_t base, int32_t *cols, float *kept,
                   int64_t width) {
    float *score = rows, *copy = rows + span;
    for (int64_t t = 0; t < tokens; ++t) score[t] -= lse[0];
    for (int64_t j = 1; j < group; ++j) {
        const float *x = rows + j * span;
        for (int64_t t = 0; t < tokens; ++t)
            score[t] = x[t] - lse[j] > score[t] ? x[t] - lse[j] : score[t];
    }
    int64_t lo, hi, greater;
    float low, high;
    forced_range(len, tokens, sink, recent, &lo, &hi);
    for (int64_t t = 0; t < lo; ++t) score[t] = INFINITY;
    for (int64_t t = hi; t < tokens; ++t) score[t] = INFINITY;
    clean(score + lo, copy, hi - lo, &low, &high);
    const int64_t others = hi - lo, best = count - (tokens - others);  // in [0, others]
    float threshold = best > 0 ? -INFINITY : FLT_MAX;  // all the others, or none (no score is
    int64_t ties = best;                               // inf but the forced ones')
    if (best > 0 && best < others) {
        threshold = kth_largest(copy, others, best, low, high, &greater);
        ties = best - greater;
    }
    const v8 edge = (v8){0} + threshold;
    int64_t m = 0;  // the kept rows into the copy (read by now), each past the last overwritten
    for (int64_t b = 0; b * size < tokens; ++b) {
        const int64_t first = b * size, end = tokens - first < size ? tokens : first + size;
        const int64_t before = m, row = base + table[b] * size - first;
        for (int64_t t = first; t < end; t += 8) {
            const int64_t n = end - t < 8 ? end - t : 8;
            v8 v = (v8){0} + NAN;
            if (n == 8) v = load8(score + t);
            else memcpy(&v, score + t, n * sizeof *score);
            unsigned take = lane_bits(v > edge), tie = ties > 0 ? lane_bits(v == edge) : 0;
            for (int64_t i = 0; tie && i < n; ++i)  // the threshold's own, in position order
                if ((tie >> i) & 1 && ties > 0) take |= 1u << i, --ties;
            pack(copy + m, (int32_t)(row + t), take);
            m += __builtin_popcount(take);
        }
        kept[b] = (float)(m - before) / (float)(end - first);
    }
    for (int64_t b = (tokens + size - 1) / size; b < width; ++b) kept[b] = 0.0f;
    for (int64_t j = 0; j < group && count > 0; ++j)  // none: cols may be NULL
        memcpy(cols + j * count, copy, count * sizeof *cols);
}
