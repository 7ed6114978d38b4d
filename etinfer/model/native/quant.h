/* What the quantized matmul files share (quant_linear.c, quant_matmul.c, quant_interleaved.c,
 * quant_dequantize.c): GGML's format ids, the quantized activations' layout, the entry points,
 * and AVX2 helpers. */
#pragma once
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "the quantized matmuls need x86-64-v3 (AVX2, FMA, F16C); quant_kernels.py builds them only there"
#endif
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };  // GGML's ids

/* The K formats: blocks of 256, which meet activations quantized in blocks of 256 (Act256). */
static inline int is_k_format(int64_t type) { return type == Q4_K || type == Q5_K || type == Q6_K; }

/* Activations, quantized: a block of 32 for the 32-element formats, with s = d * sum(q) (the
 * offsets of Q4_0, Q4_1 and Q5_0 multiply it); a block of 256 for the K formats, with the sums
 * of each 16 codes (their minimums and offsets multiply those). */
typedef struct {
    float d, s;
    int8_t q[32];
} Act32;
typedef struct {
    float d;
    int16_t sums[16];
    int8_t q[256];
} Act256;

/* One weight of a layer as block_linear (quant_linear.c) takes it: a format id, the bytes,
 * output rows, a block's bytes in the file, and whether rows are interleaved by eight. */
typedef struct {
    int64_t type;
    const uint8_t *w;
    int64_t out, block_bytes, interleaved;
} BlockPart;

/* Each file's entry points, for quant_linear.c. Activations are quantized a row at a time, rows
 * shared among `threads` when there are many; `split`, each row as two (its codes, then the codes
 * of its remainder). */
void quantize_act32(const float *x, int64_t rows, int64_t k, Act32 *out, int64_t threads,
                    int split);
void quantize_act256(const float *x, int64_t rows, int64_t k, Act256 *out, int64_t threads,
                     int split);
int quant_matmul(int type, const uint8_t *w, int64_t out, int64_t k, int64_t block_bytes,
                 const void *x, int64_t rows, float *y, int64_t ldy, int64_t threads);
int quant_matmul8(int type, const uint8_t *w, int64_t out, int64_t k, const Act32 *x,
                  int64_t rows, float *y, int64_t ldy, int64_t threads);
/* Groups [first, end) of a weight interleaved by eight (eight output rows each) times `rows`
 * activation rows, on the calling thread, into y (group g's columns at y + 8 * (g - first), rows
 * `ldy` apart): a thread's share of quant_matmul8, or one tile of the output head's scores. */
void matmul8_groups(int type, const uint8_t *w, int64_t k, const Act32 *x, int64_t rows,
                    int64_t first, int64_t end, float *y, int64_t ldy);
int unpack8_rows(int type, const uint8_t *src, int64_t rows, int64_t blocks, const int64_t *index,
                 int64_t n, uint8_t *dst);

/* Q4_K and Q5_K: 8 sub-blocks of 32 with 6-bit scales and minimums packed in 12 bytes
 * (quant_matmul.c multiplies them, quant_dequantize.c decodes them). */
static inline void scales_mins(const uint8_t *p, uint8_t *scale, uint8_t *min) {
    for (int j = 0; j < 4; ++j) {
        scale[j] = p[j] & 63, min[j] = p[j + 4] & 63;
        scale[j + 4] = (p[j + 8] & 15) | ((p[j] >> 6) << 4);
        min[j + 4] = (p[j + 8] >> 4) | ((p[j + 4] >> 6) << 4);
    }
}

/* How far ahead of a weight stream the kernels ask for its cache lines, every line of a block:
 * the weights come from memory once a step, and software prefetches, unlike the hardware's,
 * cross 4 KB pages. One line a block, a few hundred bytes ahead and marked non-temporal (an
 * earlier version), left a core reading the default model's layers at 7 GB/s; this reads them at
 * about 10 (one thread) and 20 (two), held to AVX2. Distances of 1 to 8 KB measured alike. */
enum { PREFETCH_BYTES = 4096 };

/* A float16 field (F16C: x86-64-v3 has it; the library is built only there). */
static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define HAS_VNNI 1
#endif

/* acc + sums of products of 32 unsigned bytes (at most 63) and 32 signed bytes, 4 to a lane. */
static inline __m256i dot_us8_add(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

static inline __m256i dot_us8(__m256i u, __m256i s) {
    return dot_us8_add(_mm256_setzero_si256(), u, s);
}

static inline float lanes_sum(__m256 v) {
    const __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 y = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(y, _mm_movehdup_ps(y)));
}

static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

