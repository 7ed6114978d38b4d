/* The products of the low-rank key copy's layout (model/key_copy.py: by block and pairs of
 * directions, each token's two codes of a pair side by side) with a query quantized to 16 bits:
 * key_sketch.c's first pass. */
#ifndef ETINFER_COPY_PRODUCTS_H
#define ETINFER_COPY_PRODUCTS_H
#include <math.h>

#include "kv_elements.h"

/* A query head's projected query in 16 bits: each of its rank values divided by its largest
 * magnitude over 32767, rounded to nearest even (control/key_sketch.py's quantize_queries), as
 * pairs (value 2p in the low half, 2p + 1 in the high; a zero past an odd rank); returns the
 * scale. */
static float query_pairs(const float *q, int64_t rank, int32_t *pairs) {
    float most = 0.0f;
    for (int64_t r = 0; r < rank; ++r) most = fabsf(q[r]) > most ? fabsf(q[r]) : most;
    const float scale = most / 32767.0f, divisor = scale > 0.0f ? scale : 1.0f;
    for (int64_t p = 0; p < (rank + 1) / 2; ++p) {
        const int32_t low = (int32_t)lrintf(q[2 * p] / divisor);
        const int32_t high = 2 * p + 1 < rank ? (int32_t)lrintf(q[2 * p + 1] / divisor) : 0;
        pairs[p] = (int32_t)((uint32_t)(uint16_t)low | (uint32_t)high << 16);
    }
    return scale;
}

/* The eight int32 sums of eight tokens' pairs of codes times a query head's: `codes` holds a
 * pair's 16 bytes (each token's two codes side by side), `pair` the query's two 16-bit values. */
static inline v8i pair_products(v8i acc, const int8_t *codes, int32_t pair) {
#if defined(__AVX2__)
    const __m256i wide = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)codes));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return (v8i)_mm256_dpwssd_epi32((__m256i)acc, wide, _mm256_set1_epi32(pair));
#elif defined(__AVXVNNI__)
    return (v8i)_mm256_dpwssd_avx_epi32((__m256i)acc, wide, _mm256_set1_epi32(pair));
#else
    return acc + (v8i)_mm256_madd_epi16(wide, _mm256_set1_epi32(pair));
#endif
#else
    const int32_t low = (int16_t)(pair & 0xffff), high = (int16_t)((uint32_t)pair >> 16);
    for (int i = 0; i < 8; ++i) acc[i] += codes[2 * i] * low + codes[2 * i + 1] * high;
    return acc;
#endif
}

#endif
