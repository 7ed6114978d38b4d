/* Activations quantized for the block kernels (quant_matmul.c, quant_interleaved.c), as llama.cpp
 * quantizes them: a scale and 8-bit codes a block of 32 (the 32-element formats, with d times the
 * codes' sum that their offsets multiply) or of 256 (the K formats, with the sums of each 16
 * codes that their minimums and offsets multiply). Split (quantization='gguf-a16'), a row is
 * quantized as two: its codes, then the codes of what they leave out.
 *
 * Each row's blocks are quantized alone and in their own order, so where and beside what a row
 * is quantized does not change its codes (the kernels' row invariance starts here).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "quant.h"

/* Round to nearest, halves away from zero, as llama.cpp's quantizers do; the scale is the block's
 * largest magnitude over 127, so codes stay in -127..127 (the Q8_0 kernels' sign trick needs that). */
static void quantize_block(const float *x, int64_t count, float *d, int8_t *q) {
    float amax = 0.0f;
    for (int64_t i = 0; i < count; ++i) amax = fmaxf(amax, fabsf(x[i]));
    *d = amax / 127.0f;
    const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    int64_t i = 0;
    /* roundf eight at a time (it was a library call a value, 2 % of a pruned step at batch 8):
     * truncate, then step away from zero where the dropped fraction is a half or more (exact:
     * x - trunc(x) is, for |x| <= 127). */
    const __m256 scale = _mm256_set1_ps(inverse), half = _mm256_set1_ps(0.5f);
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= count; i += 8) {
        const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), scale);
        const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        const __m256 away = _mm256_and_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(v, t)),
                                                        half, _CMP_GE_OQ),
                                          _mm256_or_ps(one, _mm256_and_ps(sign, v)));
        const __m256i codes = _mm256_cvttps_epi32(_mm256_add_ps(t, away));
        const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(codes),
                                              _mm256_extracti128_si256(codes, 1));
        _mm_storel_epi64((__m128i *)(void *)(q + i), _mm_packs_epi16(words, words));
    }
    for (; i < count; ++i) q[i] = (int8_t)roundf(x[i] * inverse);
}

/* A block's codes and scale, then, where asked (d2 and q2 not NULL), the codes and scale of what
 * they leave out, x - d q: the two products add up to about 15 bits of each activation
 * (block_linear's `precise`). */
static void quantize_split(const float *x, int64_t count, float *d, int8_t *q, float *d2,
                           int8_t *q2) {
    quantize_block(x, count, d, q);
    if (q2 == NULL) return;
    float rest[256];
    for (int64_t i = 0; i < count; ++i) rest[i] = x[i] - *d * (float)q[i];
    quantize_block(rest, count, d2, q2);
}

static void sums32(void *block) {
    Act32 *a = block;
    int sum = 0;
    for (int i = 0; i < 32; ++i) sum += a->q[i];
    a->s = a->d * (float)sum;
}

static void sums256(void *block) {
    Act256 *a = block;
    for (int g = 0; g < 16; ++g) {
        int sum = 0;
        for (int i = 0; i < 16; ++i) sum += a->q[16 * g + i];
        a->sums[g] = (int16_t)sum;
    }
}

/* Rows below which quantizing them is not worth a second thread (about 1 us for 576 values). */
enum { QUANTIZE_ROWS_PER_THREAD = 16 };

/* An activation block's layout: its elements, its size, where its codes sit (d is first in
 * both), and what fills in the sums its weight formats need. */
typedef struct {
    int64_t elements;
    size_t size, codes_at;
    void (*sums)(void *block);
} ActKind;

static const ActKind ACT32 = {32, sizeof(Act32), offsetof(Act32, q), sums32};
static const ActKind ACT256 = {256, sizeof(Act256), offsetof(Act256, q), sums256};

/* Rows [first, end) of x; split, each row becomes two activation rows, its codes then its
 * remainder's (rows 2i and 2i + 1, which a kernel's tile then reads in one pass). */
static void quantize_block_rows(const ActKind *kind, const float *x, int64_t k, void *out,
                                int64_t first, int64_t end, int split) {
    const int64_t blocks = k / kind->elements;
    for (int64_t row = first; row < end; ++row)
        for (int64_t b = 0; b < blocks; ++b) {
            uint8_t *a = (uint8_t *)out + (row * (split + 1) * blocks + b) * kind->size;
            uint8_t *rest = split ? a + blocks * kind->size : NULL;
            quantize_split(x + row * k + b * kind->elements, kind->elements, (float *)a,
                           (int8_t *)(a + kind->codes_at), rest ? (float *)rest : NULL,
                           rest ? (int8_t *)(rest + kind->codes_at) : NULL);
            kind->sums(a);
            if (rest) kind->sums(rest);
        }
}

/* Rows shared among threads when there are many; each row's blocks are quantized alone, in
 * their own order, so where a row is quantized does not change it. */
static void quantize_rows(const ActKind *kind, const float *x, int64_t rows, int64_t k, void *out,
                          int64_t threads, int split) {
    int64_t parts = rows / QUANTIZE_ROWS_PER_THREAD;
    if (parts > threads) parts = threads;
    if (parts <= 1) {
        quantize_block_rows(kind, x, k, out, 0, rows, split);
        return;
    }
#pragma omp parallel for num_threads(parts)
    for (int64_t p = 0; p < parts; ++p)
        quantize_block_rows(kind, x, k, out, rows * p / parts, rows * (p + 1) / parts, split);
}

void quantize_act32(const float *x, int64_t rows, int64_t k, Act32 *out, int64_t threads,
                    int split) {
    quantize_rows(&ACT32, x, rows, k, out, threads, split);
}

void quantize_act256(const float *x, int64_t rows, int64_t k, Act256 *out, int64_t threads,
                     int split) {
    quantize_rows(&ACT256, x, rows, k, out, threads, split);
}
