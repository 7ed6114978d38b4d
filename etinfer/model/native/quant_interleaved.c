/* Q4_0, Q4_1 and Q8_0 weights with eight rows interleaved, the layout a batch-1 product wants.
 *
 * In GGUF's layout a block holds 32 weights of one row, so an integer dot product sums 32
 * products into one row's result and then needs a horizontal reduction and a scalar scale:
 * about 20 instructions a block at batch 1 (quant_matmul.c). Interleaved, a 32-byte vector holds
 * four consecutive weights of each of eight rows; multiplied by the activation's four bytes
 * broadcast, each lane accumulates one row (VNNI's dpbusd, or maddubs and madd on AVX2). A block
 * of eight rows then costs about 40 instructions, 5 a row, and its eight scales convert in one
 * instruction. The bytes are the file's, moved (repack8): the same size, the same values.
 *
 * Layout of a group of eight rows, block b (the groups one after another, each group's blocks in
 * order): the eight float16 scales, for Q4_1 the eight float16 minimums, then the codes: for Q4_0
 * and Q4_1 four vectors V_j of 32 bytes, byte 4r + t of V_j holding row r's weights 4j + t (low
 * nibble) and 16 + 4j + t (high nibble); for Q8_0 eight vectors, byte 4r + t of V_j row r's
 * weight 4j + t.
 *
 * Each output row is one lane through the same operations whatever the call's other rows, so
 * results are row-invariant as in quant_matmul.c.
 */
#include "pool.h"
#include "quant.h"

static int64_t header_bytes(int type) { return type == Q4_1 ? 32 : 16; }

static int64_t interleaved_block_bytes(int type) {
    switch (type) {
        case Q4_0: return 16 + 128;
        case Q4_1: return 32 + 128;
        case Q8_0: return 16 + 256;
        default: return -1;
    }
}

/* One row's block in GGUF's layout (`file`) and its lane's bytes in an interleaved block, copied
 * one way or the other: repack8 moves whole weights in, unpack8_rows reads rows back out. */
static void move_lane(int type, uint8_t *file, uint8_t *interleaved, int lane,
                      int to_interleaved) {
    const int header = type == Q4_1 ? 4 : 2, vectors = type == Q8_0 ? 8 : 4;
#define MOVE(at_file, at_interleaved, bytes)                                            \
    (to_interleaved ? memcpy(interleaved + (at_interleaved), file + (at_file), bytes) \
                    : memcpy(file + (at_file), interleaved + (at_interleaved), bytes))
    MOVE(0, 2 * lane, 2);                                   // scale
    if (type == Q4_1) MOVE(2, 16 + 2 * lane, 2);            // minimum
    /* Q4_0 and Q4_1: byte i holds weight i (low nibble) and 16 + i (high), moved as bytes. */
    for (int j = 0; j < vectors; ++j)
        MOVE(header + 4 * j, header_bytes(type) + 32 * j + 4 * lane, 4);
#undef MOVE
}

static int64_t file_block_bytes(int type) { return type == Q4_0 ? 18 : type == Q4_1 ? 20 : 34; }

/* src [rows, blocks * row block bytes] in GGUF's layout -> dst interleaved; rows a multiple of
 * 8. Returns -1 for a format without this layout. */
int repack8(int type, const uint8_t *src, int64_t rows, int64_t blocks, uint8_t *dst) {
    const int64_t size = interleaved_block_bytes(type);
    if (size < 0 || rows % 8) return -1;
    const int64_t block = file_block_bytes(type), row_bytes = blocks * block;
    /* On every thread: a head the size of Gemma 3's (262,144 rows) is a tenth of its load. */
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < rows / 8; ++g)
        for (int64_t b = 0; b < blocks; ++b)
            for (int r = 0; r < 8; ++r)
                move_lane(type, (uint8_t *)src + (8 * g + r) * row_bytes + b * block,
                          dst + (g * blocks + b) * size, r, 1);
    return 0;
}

/* The inverse for the rows listed: dst [n, blocks * row block bytes] in GGUF's layout, from an
 * interleaved src of `rows` rows (a tied embedding's rows, the head's candidates). Returns -1 for
 * a format without this layout, -2 for a row outside [0, rows), before anything is copied. */
int unpack8_rows(int type, const uint8_t *src, int64_t rows, int64_t blocks, const int64_t *index,
                 int64_t n, uint8_t *dst) {
    const int64_t size = interleaved_block_bytes(type);
    if (size < 0) return -1;
    for (int64_t i = 0; i < n; ++i)
        if (index[i] < 0 || index[i] >= rows) return -2;
    const int64_t block = file_block_bytes(type);
    for (int64_t i = 0; i < n; ++i)
        for (int64_t b = 0; b < blocks; ++b)
            move_lane(type, dst + (i * blocks + b) * block,
                      (uint8_t *)src + (index[i] / 8 * blocks + b) * size, (int)(index[i] % 8), 0);
    return 0;
}

/* Eight rows (one group) times `TR` activation rows, lanes = rows. */
static inline __attribute__((always_inline)) void group8(int type, const uint8_t *w, int64_t size,
                                                         const Act32 *x, int64_t blocks, float *y,
                                                         int64_t ldy, const int TR) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256 acc[4], offsets[4];
    for (int j = 0; j < TR; ++j) acc[j] = offsets[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b, w += size) {
        for (int64_t line = 0; line < size; line += 64)
            __builtin_prefetch(w + PREFETCH_BYTES + line, 0, 3);
        __m256i sums[4];
        for (int j = 0; j < TR; ++j) sums[j] = _mm256_setzero_si256();
        const uint8_t *vectors = w + header_bytes(type);
        if (type == Q8_0) {
            for (int c = 0; c < 8; ++c) {
                const __m256i v = load32(vectors + 32 * c), magnitude = _mm256_sign_epi8(v, v);
                for (int j = 0; j < TR; ++j) {
                    int32_t four;
                    memcpy(&four, x[j * blocks + b].q + 4 * c, 4);
                    const __m256i a = _mm256_sign_epi8(_mm256_set1_epi32(four), v);
                    sums[j] = dot_us8_add(sums[j], magnitude, a);
                }
            }
        } else {
#if !defined(HAS_VNNI)
            /* Without VNNI: 4-bit codes times bytes stay within 8 x 2 x 15 x 128 = 30,720, so the
             * block's eight maddubs add up in 16 bits and widen once (the same integers). */
            __m256i pairs[4];
            for (int j = 0; j < TR; ++j) pairs[j] = _mm256_setzero_si256();
#endif
            for (int c = 0; c < 4; ++c) {
                const __m256i v = load32(vectors + 32 * c), lo = _mm256_and_si256(v, low),
                              hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                for (int j = 0; j < TR; ++j) {
                    int32_t first, second;
                    memcpy(&first, x[j * blocks + b].q + 4 * c, 4);
                    memcpy(&second, x[j * blocks + b].q + 16 + 4 * c, 4);
                    const __m256i a = _mm256_set1_epi32(first), a2 = _mm256_set1_epi32(second);
#if defined(HAS_VNNI)
                    sums[j] = dot_us8_add(dot_us8_add(sums[j], lo, a), hi, a2);
#else
                    pairs[j] = _mm256_add_epi16(pairs[j], _mm256_maddubs_epi16(lo, a));
                    pairs[j] = _mm256_add_epi16(pairs[j], _mm256_maddubs_epi16(hi, a2));
#endif
                }
            }
#if !defined(HAS_VNNI)
            for (int j = 0; j < TR; ++j) sums[j] = _mm256_madd_epi16(pairs[j], _mm256_set1_epi16(1));
#endif
        }
        const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
        const __m256 offset =
            type == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 16)))
            : type == Q4_0 ? _mm256_mul_ps(scale, _mm256_set1_ps(-8.0f))
                           : _mm256_setzero_ps();
        for (int j = 0; j < TR; ++j) {
            const Act32 *a = x + j * blocks + b;
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[j]),
                                     _mm256_mul_ps(scale, _mm256_set1_ps(a->d)), acc[j]);
            offsets[j] = _mm256_fmadd_ps(offset, _mm256_set1_ps(a->s), offsets[j]);
        }
    }
    for (int j = 0; j < TR; ++j)
        _mm256_storeu_ps(y + j * ldy, _mm256_add_ps(acc[j], offsets[j]));
}

void matmul8_groups(int type, const uint8_t *w, int64_t k, const Act32 *x, int64_t rows,
                    int64_t first, int64_t end, float *y, int64_t ldy) {
    const int64_t size = interleaved_block_bytes(type), blocks = k / 32;
    for (int64_t g = first; g < end; ++g) {
        const uint8_t *wg = w + g * blocks * size;
        float *yg = y + 8 * (g - first);
        int64_t r = 0;
        for (; r + 4 <= rows; r += 4)
            group8(type, wg, size, x + r * blocks, blocks, yg + r * ldy, ldy, 4);
        switch (rows - r) {
            case 3: group8(type, wg, size, x + r * blocks, blocks, yg + r * ldy, ldy, 3); break;
            case 2: group8(type, wg, size, x + r * blocks, blocks, yg + r * ldy, ldy, 2); break;
            case 1: group8(type, wg, size, x + r * blocks, blocks, yg + r * ldy, ldy, 1); break;
            default: break;
        }
    }
}

typedef struct {
    int type;
    int64_t k, rows, ldy;
    const uint8_t *w;
    const Act32 *x;
    float *y;
} Task8;

static void run_groups(void *arg, int64_t first, int64_t end) {
    const Task8 *t = arg;
    matmul8_groups(t->type, t->w, t->k, t->x, t->rows, first, end, t->y + 8 * first, t->ldy);
}

/* y [rows, out] (rows `ldy` apart) = x [rows, k] (quantize_act32) times the repacked weight
 * [out, k], out a multiple of 8. Returns -1 for a format without this layout. */
int quant_matmul8(int type, const uint8_t *w, int64_t out, int64_t k, const Act32 *x,
                  int64_t rows, float *y, int64_t ldy, int64_t threads) {
    if (interleaved_block_bytes(type) < 0 || out % 8 || k % 32) return -1;
    Task8 task = {type, k, rows, ldy, w, x, y};
    run_parallel(run_groups, &task, out / 8, chunk_size(out / 8, threads, 2, 1), threads);
    return 0;
}
