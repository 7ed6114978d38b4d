/* Weights in GGUF's block formats decoded to float32, a band of output rows at a time: what a
 * prefill's many rows multiply in one float32 GEMM (model/linear.py's BlockLinear). The block
 * kernels quantize activations to 8 bits and reach 80-125 GFLOP/s on two cores at 2,048 rows;
 * torch's float32 GEMM reaches about 400 on the same host, and decoding a weight costs a
 * nanosecond or so, once a band for all the rows. Values follow gguf's dequantize formulas. */
#include <stdint.h>
#include <string.h>

#include "pool.h"
#include "quant.h"

static void decode_block32(int type, const uint8_t *b, float *y) {
    const float d = half(b);
    if (type == Q8_0) {
        for (int j = 0; j < 32; ++j) y[j] = d * (float)(int8_t)b[2 + j];
        return;
    }
    const uint8_t *qs = b + (type == Q4_0 ? 2 : type == Q4_1 ? 4 : 6);
    uint32_t high = 0;
    if (type == Q5_0) memcpy(&high, b + 2, 4);
    for (int j = 0; j < 16; ++j) {
        int lo = qs[j] & 15, hi = qs[j] >> 4;
        if (type == Q5_0) {
            lo |= (int)((high >> j) & 1) << 4, hi |= (int)((high >> (j + 16)) & 1) << 4;
            y[j] = d * (float)(lo - 16), y[j + 16] = d * (float)(hi - 16);
        } else if (type == Q4_0) {
            y[j] = d * (float)(lo - 8), y[j + 16] = d * (float)(hi - 8);
        } else {  // Q4_1: a scale and a minimum
            const float m = half(b + 2);
            y[j] = d * (float)lo + m, y[j + 16] = d * (float)hi + m;
        }
    }
}

static void decode_block_k(int type, const uint8_t *b, float *y) {
    if (type == Q6_K) {  // ql[128], qh[64], scales[16] (int8), d
        const float d = half(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int h = 0; h < 2; ++h, y += 128, sc += 8) {
            const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
            for (int l = 0; l < 32; ++l) {
                const int s = l / 16;
                const int q1 = ((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32;
                const int q2 = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l] = d * (float)sc[s] * (float)q1;
                y[l + 32] = d * (float)sc[s + 2] * (float)q2;
                y[l + 64] = d * (float)sc[s + 4] * (float)q3;
                y[l + 96] = d * (float)sc[s + 6] * (float)q4;
            }
        }
        return;
    }
    // Q4_K, Q5_K: d, dmin, scales[12], (Q5_K: qh[32],) qs[128]; sub-blocks of 32
    const float d = half(b), dmin = half(b + 2);
    uint8_t scale[8], min[8];
    scales_mins(b + 4, scale, min);
    const uint8_t *qh = b + 16, *qs = b + (type == Q5_K ? 48 : 16);
    for (int s = 0; s < 8; ++s, y += 32) {
        const float factor = d * (float)scale[s], offset = dmin * (float)min[s];
        const uint8_t *q = qs + 32 * (s / 2);
        for (int l = 0; l < 32; ++l) {
            int code = s & 1 ? q[l] >> 4 : q[l] & 15;
            if (type == Q5_K) code |= ((qh[l] >> s) & 1) << 4;
            y[l] = factor * (float)code - offset;
        }
    }
}

typedef struct {
    const BlockPart *parts;
    int64_t count, k, first;
    float *out;
} Band;

static void decode_rows(void *arg, int64_t begin, int64_t end) {
    const Band *t = arg;
    uint8_t unpacked[t->k / 32 * 34];  // one interleaved row in the file's layout
    for (int64_t r = begin; r < end; ++r) {
        int64_t row = t->first + r, p = 0;
        while (row >= t->parts[p].out) row -= t->parts[p++].out;
        const BlockPart *part = &t->parts[p];
        const int type = (int)part->type;
        const int64_t elements = is_k_format(type) ? 256 : 32, blocks = t->k / elements;
        const uint8_t *w = part->w + row * blocks * part->block_bytes;
        if (part->interleaved) {
            unpack8_rows(type, part->w, part->out, blocks, &row, 1, unpacked);
            w = unpacked;
        }
        float *y = t->out + r * t->k;
        for (int64_t b = 0; b < blocks; ++b, w += part->block_bytes, y += elements)
            (elements == 256 ? decode_block_k : decode_block32)(type, w, y);
    }
}

/* Rows [first, first + n) of the parts' weights stacked by output rows (as block_linear takes
 * them), decoded into out [n, k]. Returns 0, or -1 for a format this file does not decode. */
int dequantize_parts(const BlockPart *parts, int64_t count, int64_t k, int64_t first, int64_t n,
                     float *out, int64_t threads) {
    for (int64_t p = 0; p < count; ++p) {
        const int64_t type = parts[p].type;
        if (type != Q4_0 && type != Q4_1 && type != Q5_0 && type != Q8_0 && !is_k_format(type))
            return -1;
    }
    Band band = {parts, count, k, first, out};
    run_parallel(decode_rows, &band, n, chunk_size(n, threads, 16, 1), threads);
    return 0;
}
