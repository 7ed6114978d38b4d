/* Matrix products with weights in GGUF's block formats, read as the file stores them
 * (model/quant_kernels.py calls them): y[r, o] = sum_k x[r, k] w[o, k] for 1 to a few dozen rows
 * of activations x, the work of a decode step, of speculative verification and of prefill.
 *
 * As llama.cpp does, the activations are first quantized to 8 bits per block (a scale and 32 or
 * 256 signed bytes, with the sums the formats' offsets need: quant_activations.c), and each
 * weight block meets its activation block in an integer dot product: 32 unsigned 4- to 6-bit codes times 32 signed bytes
 * by AVX2's maddubs (or VNNI's dpbusd, which gives the same integers), scaled once a block in
 * float. Our loops are our own: tiles of 4 weight rows by 2 activation rows (the K formats: one
 * weight row by 4), and the output rows shared out in chunks among threads that take the next
 * chunk when done (pool.c's run_parallel). Where one pass over the weights takes every
 * activation row (a decode step), the blocks are decoded as they stream in; with more rows
 * (batches, prefill) a tile's weight rows are decoded once a call into a buffer every pass
 * reads, instead of once a pass (1.5x at 16 and 1,024 rows of Q5_0, the same bits). Q4_0, Q4_1
 * and Q8_0 weights whose rows come in eights take quant_interleaved.c's layout instead, several
 * times fewer instructions a block; this file serves Q5_0, the K formats and any other row
 * count.
 *
 * Row invariance: the result for activation row r and weight row o is the same sequence of
 * operations whatever the other rows of the call and whichever thread computes it, so a token's
 * output is bit-equal alone, in a batch, in a prefill chunk or verified beside drafts.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "pool.h"
#include "quant.h"

enum { TILE = 4 };  // activation rows per pass over a weight row (K formats)
enum { PREFETCH_ROWS = 8 };  // weight rows ahead that a tile asks the memory system for

/* 16 bytes of two codes each: the low nibbles as elements 0-15, the high ones as 16-31. */
static inline __m256i nibbles16(const uint8_t *p) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p), low = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
}

/* Q5_0's 32 high bits as 16 (set) or 0 in the element's byte. */
static inline __m256i high_bits32(const uint8_t *p) {
    uint32_t bits;
    memcpy(&bits, p, 4);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bits),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i mask = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask),
                            _mm256_set1_epi8(16));
}

/* One weight block of a 32-element format as unsigned codes, its scale, and the factor of the
 * activation block's sum s that its offset contributes. */
static inline __m256i codes32(int type, const uint8_t *w, float *scale, float *offset) {
    *scale = half(w);
    switch (type) {
        case Q4_0:
            *offset = -8.0f * *scale;
            return nibbles16(w + 2);
        case Q4_1:
            *offset = half(w + 2);
            return nibbles16(w + 4);
        default:  // Q5_0
            *offset = -16.0f * *scale;
            return _mm256_or_si256(nibbles16(w + 6), high_bits32(w + 2));
    }
}

/* One block of a 32-element format as a tile reads it: unsigned codes (Q8_0's signed ones), the
 * scale, and the factor of the activation block's sum that its offset contributes. */
typedef struct {
    __m256i u;
    float scale, offset;
} Block32;

static inline __m256i block32(int type, const uint8_t *block, float *scale, float *offset) {
    if (type == Q8_0) {  // signed codes: |w| times x with w's sign, as unsigned times signed
        *scale = half(block), *offset = 0.0f;
        return load32(block + 2);
    }
    return codes32(type, block, scale, offset);
}

/* Weight rows [0, count) (row_bytes apart) decoded: with more activation rows than a tile takes
 * (prefill), every pair of rows reads them, and each block is then decoded once a call. */
static void decode32(int type, int64_t block_bytes, const uint8_t *w, int64_t row_bytes,
                     int64_t count, int64_t blocks, Block32 *out) {
    for (int64_t i = 0; i < count; ++i, w += row_bytes)
        for (int64_t b = 0; b < blocks; ++b, ++out) {
            const uint8_t *block = w + b * block_bytes;
            __builtin_prefetch(block + PREFETCH_ROWS * row_bytes, 0, 3);
            out->u = block32(type, block, &out->scale, &out->offset);
        }
}

/* A tile of `WR` weight rows (row_bytes apart) times `TR` activation rows: the tile's products
 * are independent chains, which keeps the FMA units busy where one row's chain would wait on
 * each addition's latency (batch 1). The weight blocks are decoded as they stream in, or read
 * from `decoded` (`blocks` apart a row; prefill). Every product follows the same operations in
 * the same order whatever the tile's shape or source (the offsets by an explicit fmaf, never
 * left to contraction), so all give the same bits. Inlined with WR, TR and the source constant,
 * the arrays live in registers. */
static inline __attribute__((always_inline)) void tile32(int type, int64_t block_bytes,
                                                         const uint8_t *w, int64_t row_bytes,
                                                         const Block32 *decoded, const Act32 *x,
                                                         int64_t blocks, float *y, int64_t ldy,
                                                         const int WR, const int TR) {
    __m256 acc[4][2];
    float offsets[4][2];
    for (int i = 0; i < WR; ++i)
        for (int j = 0; j < TR; ++j) acc[i][j] = _mm256_setzero_ps(), offsets[i][j] = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
        float scale[4], offset[4];
        __m256i u[4];
        for (int i = 0; i < WR; ++i) {
            if (decoded != NULL) {
                const Block32 *k = decoded + i * blocks + b;
                u[i] = k->u, scale[i] = k->scale, offset[i] = k->offset;
                continue;
            }
            const uint8_t *block = w + i * row_bytes + b * block_bytes;
            /* The next tile's rows, a tile ahead: the weights stream from memory once a step,
             * and rows of a few hundred bytes are too short for the hardware's prefetchers. */
            __builtin_prefetch(block + PREFETCH_ROWS * row_bytes, 0, 3);
            u[i] = block32(type, block, &scale[i], &offset[i]);
        }
        for (int j = 0; j < TR; ++j) {
            const Act32 *a = x + j * blocks + b;
            const __m256i s = load32(a->q);
            for (int i = 0; i < WR; ++i) {
                const __m256i p = type == Q8_0 ? dot_us8(_mm256_sign_epi8(u[i], u[i]),
                                                         _mm256_sign_epi8(s, u[i]))
                                               : dot_us8(u[i], s);
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(scale[i] * a->d),
                                            acc[i][j]);
                offsets[i][j] = fmaf(offset[i], a->s, offsets[i][j]);
            }
        }
    }
    for (int i = 0; i < WR; ++i)
        for (int j = 0; j < TR; ++j) y[j * ldy + i] = lanes_sum(acc[i][j]) + offsets[i][j];
}

/* Weight rows [0, count) times every activation row, by tiles of up to 4 x 2, each group of
 * weight rows streamed (`decoded` NULL: one pass takes every row) or decoded once into it. */
static inline __attribute__((always_inline)) void tiles32(int type, int64_t block_bytes,
                                                          const uint8_t *w, int64_t row_bytes,
                                                          int64_t count, const Act32 *x,
                                                          int64_t blocks, int64_t rows, float *y,
                                                          int64_t ldy, Block32 *decoded) {
    int64_t o = 0;
    for (; o + 4 <= count; o += 4) {
        const uint8_t *wo = w + o * row_bytes;
        if (decoded != NULL) decode32(type, block_bytes, wo, row_bytes, 4, blocks, decoded);
        int64_t r = 0;
        for (; r + 2 <= rows; r += 2)
            tile32(type, block_bytes, wo, row_bytes, decoded, x + r * blocks, blocks,
                   y + r * ldy + o, ldy, 4, 2);
        if (r < rows)
            tile32(type, block_bytes, wo, row_bytes, decoded, x + r * blocks, blocks,
                   y + r * ldy + o, ldy, 4, 1);
    }
    for (; o < count; ++o) {
        const uint8_t *wo = w + o * row_bytes;
        if (decoded != NULL) decode32(type, block_bytes, wo, row_bytes, 1, blocks, decoded);
        for (int64_t r = 0; r < rows; ++r)
            tile32(type, block_bytes, wo, row_bytes, decoded, x + r * blocks, blocks,
                   y + r * ldy + o, ldy, 1, 1);
    }
}

static void rows32(int type, int64_t block_bytes, const uint8_t *w, int64_t row_bytes,
                   int64_t count, const Act32 *x, int64_t blocks, int64_t rows, float *y,
                   int64_t ldy) {
    if (rows <= 2) {  // one pass over the weights: decode them as they stream in
        tiles32(type, block_bytes, w, row_bytes, count, x, blocks, rows, y, ldy, NULL);
        return;
    }
    Block32 decoded[4 * blocks];  // a group of weight rows, read by every pair of rows
    tiles32(type, block_bytes, w, row_bytes, count, x, blocks, rows, y, ldy, decoded);
}

/* One K-format block decoded: 256 unsigned codes, the 16 group scales, Q4_K/Q5_K's 8 minimums,
 * d and dmin. Inlined into arrays the caller holds (registers when they stream). */
static inline __attribute__((always_inline)) void block_k(int type, const uint8_t *w, __m256i *u,
                                                          int16_t *scale, uint8_t *mins, float *d,
                                                          float *dmin) {
    const __m256i low = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    *dmin = 0.0f;
    if (type == Q6_K) {  // ql[128], qh[64], scales[16] (int8), d; groups of 16 elements
        const uint8_t *ql = w, *qh = w + 128;
        for (int half_ = 0; half_ < 2; ++half_, ql += 64, qh += 32) {
            const __m256i l0 = load32(ql), l1 = load32(ql + 32), h = load32(qh);
            for (int s = 0; s < 4; ++s) {
                const __m256i lows = s & 2 ? _mm256_and_si256(_mm256_srli_epi16(s & 1 ? l1 : l0, 4), low)
                                           : _mm256_and_si256(s & 1 ? l1 : l0, low);
                const __m256i highs = _mm256_and_si256(_mm256_srli_epi16(h, 2 * s),
                                                       _mm256_set1_epi8(3));
                u[4 * half_ + s] = _mm256_or_si256(lows, _mm256_slli_epi16(highs, 4));
            }
        }
        for (int g = 0; g < 16; ++g) scale[g] = (int8_t)w[192 + g];
        *d = half(w + 208);
        return;
    }
    // Q4_K, Q5_K: d, dmin, scales[12], (Q5_K: qh[32],) qs[128]
    uint8_t sc[8];
    scales_mins(w + 4, sc, mins);
    for (int j = 0; j < 8; ++j) scale[2 * j] = scale[2 * j + 1] = sc[j];
    *d = half(w), *dmin = half(w + 2);
    const uint8_t *qs = w + (type == Q5_K ? 48 : 16);
    const __m256i h = type == Q5_K ? load32(w + 16) : _mm256_setzero_si256();
    for (int j = 0; j < 8; j += 2) {
        const __m256i v = load32(qs + 16 * j);
        u[j] = _mm256_and_si256(v, low);
        u[j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        if (type == Q5_K) {
            for (int t = 0; t < 2; ++t) {
                const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(h, j + t), one);
                u[j + t] = _mm256_or_si256(u[j + t], _mm256_slli_epi16(bit, 4));
            }
        }
    }
}

/* A K-format weight row decoded, block by block, for prefill: with more activation rows than
 * a pass takes, every TILE of them reads it, and each block is then decoded once a call. */
typedef struct {
    __m256i u[8];
    __m256i scales[8];  // 32 elements: two groups of 16, each with its scale
    __m256i groups;     // a group's factor of its codes' sum (group_factors)
    float d, dmin;
} KBlock;

/* Per group of 16 elements, the factor of its activation codes' sum: Q6_K's scale (its codes are
 * stored plus 32), Q4_K's and Q5_K's minimum (one a sub-block of 32, so each twice). */
static inline __m256i group_factors(int type, const uint8_t *w, const uint8_t *mins) {
    if (type == Q6_K) return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 192)));
    const __m128i eight = _mm_loadl_epi64((const __m128i *)mins);
    return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(eight, eight));
}

/* sum over g of factors[g] * sums[g]: 16 products in one madd, then the 8 lanes; an exact
 * integer, the same as a scalar loop's. */
static inline int32_t grouped_sum(__m256i factors, const int16_t *sums) {
    const __m256i p = _mm256_madd_epi16(factors, load32(sums));
    __m128i v = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)));
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(v);
}

static inline __attribute__((always_inline)) void group_scales(const int16_t *scale,
                                                               __m256i *scales) {
    for (int j = 0; j < 8; ++j)
        scales[j] = _mm256_set_m128i(_mm_set1_epi16(scale[2 * j + 1]), _mm_set1_epi16(scale[2 * j]));
}

static void decode_k(int type, const uint8_t *w, int64_t block_bytes, int64_t blocks,
                     KBlock *out) {
    for (int64_t b = 0; b < blocks; ++b, w += block_bytes, ++out) {
        for (int64_t line = 0; line < block_bytes; line += 64)
            __builtin_prefetch(w + PREFETCH_BYTES + line, 0, 3);
        int16_t scale[16];
        uint8_t mins[8];
        block_k(type, w, out->u, scale, mins, &out->d, &out->dmin);
        group_scales(scale, out->scales);
        out->groups = group_factors(type, w, mins);
    }
}

/* One weight row times up to TILE activation rows, its blocks decoded as they stream in
 * (`decoded` NULL) or read from `decoded`; the same operations either way. Inlined with the
 * source constant, the streaming arrays live in registers. */
static inline __attribute__((always_inline)) void rows_k(int type, int64_t block_bytes,
                                                         const uint8_t *w, const KBlock *decoded,
                                                         const Act256 *x, int64_t blocks,
                                                         int64_t rows, float *y, int64_t ldy) {
    __m256 acc[TILE];
    for (int64_t i = 0; i < rows; ++i) acc[i] = _mm256_setzero_ps();
    float minimums[TILE] = {0};
    for (int64_t b = 0; b < blocks; ++b, w += block_bytes) {
        __m256i streamed_u[8], streamed_scales[8], groups;
        int16_t scale[16];
        uint8_t mins[8];
        const __m256i *u = streamed_u, *scales = streamed_scales;
        float d, dmin;
        if (decoded != NULL) {
            const KBlock *k = decoded + b;
            u = k->u, scales = k->scales, groups = k->groups, d = k->d, dmin = k->dmin;
        } else {
            for (int64_t line = 0; line < block_bytes; line += 64)
                __builtin_prefetch(w + PREFETCH_BYTES + line, 0, 3);
            block_k(type, w, streamed_u, scale, mins, &d, &dmin);
            group_scales(scale, streamed_scales);
            // Q6_K's factors load straight from the block; Q4_K's minimums were just unpacked
            // byte by byte, and a vector load of them would wait on those stores: a loop then.
            if (type == Q6_K) groups = group_factors(type, w, mins);
        }
        const int vector = decoded != NULL || type == Q6_K;
        for (int64_t i = 0; i < rows; ++i) {
            const Act256 *a = x + i * blocks + b;
            __m256i sum = _mm256_setzero_si256();
            for (int j = 0; j < 8; ++j) {
                const __m256i p = _mm256_maddubs_epi16(u[j], load32(a->q + 32 * j));
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, scales[j]));
            }
            int32_t grouped = 0;  // the same integer either way
            if (vector) {
                grouped = grouped_sum(groups, a->sums);
            } else {
                for (int j = 0; j < 8; ++j) grouped += mins[j] * (a->sums[2 * j] + a->sums[2 * j + 1]);
            }
            const int32_t offset = type == Q6_K ? -32 * grouped : 0;
            if (type != Q6_K) minimums[i] += dmin * a->d * (float)grouped;
            const __m256i total = _mm256_add_epi32(sum, _mm256_setr_epi32(offset, 0, 0, 0, 0, 0, 0, 0));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_set1_ps(d * a->d), acc[i]);
        }
    }
    for (int64_t i = 0; i < rows; ++i) y[i * ldy] = lanes_sum(acc[i]) - minimums[i];
}

typedef struct {
    int type;
    int64_t block_bytes, blocks, row_bytes, rows, ldy;
    const uint8_t *w;
    const void *x;
    float *y;
} Task;

static void run_rows(void *arg, int64_t first, int64_t end) {
    const Task *t = arg;
    const uint8_t *w = t->w + first * t->row_bytes;
    if (!is_k_format(t->type)) {
        rows32(t->type, t->block_bytes, w, t->row_bytes, end - first, t->x, t->blocks, t->rows,
               t->y + first, t->ldy);
        return;
    }
    const Act256 *x = t->x;
    if (t->rows <= TILE) {  // one pass over the weights: decode them as they stream in
        for (int64_t o = first; o < end; ++o, w += t->row_bytes)
            rows_k(t->type, t->block_bytes, w, NULL, x, t->blocks, t->rows, t->y + o, t->ldy);
        return;
    }
    KBlock decoded[t->blocks];  // one weight row, read by every TILE of activation rows
    for (int64_t o = first; o < end; ++o, w += t->row_bytes) {
        decode_k(t->type, w, t->block_bytes, t->blocks, decoded);
        for (int64_t r = 0; r < t->rows; r += TILE) {
            const int64_t rows = t->rows - r < TILE ? t->rows - r : TILE;
            rows_k(t->type, t->block_bytes, w, decoded, x + r * t->blocks, t->blocks, rows,
                   t->y + r * t->ldy + o, t->ldy);
        }
    }
}

/* y [rows, out] (rows `ldy` apart: a part of a wider output) = x [rows, k] (quantized by
 * quantize_act32 or quantize_act256, as the format wants) times the weight [out, k] in `type`'s
 * blocks of `block_bytes`. Returns -1 for a format without a kernel here. */
int quant_matmul(int type, const uint8_t *w, int64_t out, int64_t k, int64_t block_bytes,
                 const void *x, int64_t rows, float *y, int64_t ldy, int64_t threads) {
    const int64_t elements = is_k_format(type) ? 256 : 32;
    if (type != Q4_0 && type != Q4_1 && type != Q5_0 && type != Q8_0 && elements == 32) return -1;
    const int64_t blocks = k / elements;
    Task task = {type, block_bytes, blocks, blocks * block_bytes, rows, ldy, w, x, y};
    run_parallel(run_rows, &task, out, chunk_size(out, threads, 16, TILE), threads);
    return 0;
}
