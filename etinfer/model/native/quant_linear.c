/* One call for a whole layer on GGUF blocks (model/quant_kernels.py's entry point): the
 * activations quantized once for each block size the layer's parts need, then each part's
 * product into its columns of the output. At batch 1 a decode step makes about 120 such calls
 * of a few tens of microseconds each, so the Python side's per-call work (two foreign calls, a
 * scratch tensor, a slice for each part) was a fifth of the matmuls' time; here it is one
 * foreign call and the output's allocation.
 *
 * The quantized activations live in a buffer of the calling thread's, grown as needed and kept
 * until the thread ends: engines in different threads never share one.
 */
#include "pool.h"
#include "quant.h"

/* The products of `rows` activation rows (as quantize_act32/256 left them) and every part, into
 * y's columns. Returns 0, or the first part's nonzero status. */
static int parts_product(const BlockPart *parts, int64_t count, const Act32 *x32,
                         const Act256 *x256, int64_t rows, int64_t k, float *y, int64_t total,
                         int64_t threads) {
    int64_t column = 0;
    for (int64_t p = 0; p < count; ++p) {
        const BlockPart *part = &parts[p];
        const void *act = is_k_format(part->type) ? (const void *)x256 : (const void *)x32;
        const int status =
            part->interleaved
                ? quant_matmul8((int)part->type, part->w, part->out, k, act, rows, y + column,
                                total, threads)
                : quant_matmul((int)part->type, part->w, part->out, k, part->block_bytes, act,
                               rows, y + column, total, threads);
        if (status != 0) return status;
        column += part->out;
    }
    return 0;
}

/* Bytes of the buffer that holds a precise call's two products a token, the tokens it takes at
 * a time set by them: a layer's products take a prefill chunk of hundreds of tokens at once (each
 * pass over the weights then serves them all; chunks of 16 cost a fifth of prefill's rate), a
 * 262,144-row head a few tokens at a time instead of 4 GiB for 2,048. */
enum { PRECISE_BUFFER_BYTES = 16 << 20 };

/* y [rows, sum of the parts' outs] = x [rows, k] times the parts' weights, stacked by output
 * rows. `precise`: each activation row is quantized as two, its 8-bit codes and those of the
 * remainder they leave, both products computed in the one pass over the weights and added (about
 * 15 bits of activation; see quant_kernels.py for what that buys and costs). Returns 0; -1 for a
 * format or layout without a kernel, -3 if scratch memory ran out. */
int block_linear(const BlockPart *parts, int64_t count, const float *x, int64_t rows, int64_t k,
                 float *y, int64_t threads, int64_t precise) {
    int64_t total = 0, with32 = 0, with256 = 0;
    for (int64_t p = 0; p < count; ++p) {
        total += parts[p].out;
        with256 |= is_k_format(parts[p].type);
        with32 |= !is_k_format(parts[p].type);
    }
    if (rows == 0 || total == 0) return 0;
    const int split = precise != 0;
    int64_t chunk = rows;
    if (split) {
        const int64_t fits = PRECISE_BUFFER_BYTES / (2 * total * (int64_t)sizeof(float));
        chunk = fits < 1 ? 1 : fits < rows ? fits : rows;
    }
    const int64_t act_rows = chunk * (split + 1);
    const size_t bytes32 = with32 ? (size_t)(act_rows * (k / 32)) * sizeof(Act32) : 0;
    const size_t bytes256 = with256 ? (size_t)(act_rows * (k / 256)) * sizeof(Act256) : 0;
    const size_t bytes_y = split ? (size_t)(act_rows * total) * sizeof(float) : 0;
    uint8_t *buffer = scratch_of(bytes32 + bytes256 + bytes_y);
    if (buffer == NULL) return -3;
    Act32 *x32 = (Act32 *)buffer;
    Act256 *x256 = (Act256 *)(buffer + bytes32);
    if (!split) {
        if (with32) quantize_act32(x, rows, k, x32, threads, 0);
        if (with256) quantize_act256(x, rows, k, x256, threads, 0);
        return parts_product(parts, count, x32, x256, rows, k, y, total, threads);
    }
    float *pairs = (float *)(buffer + bytes32 + bytes256);  // a token's two products, in turn
    for (int64_t first = 0; first < rows; first += chunk) {
        const int64_t n = rows - first < chunk ? rows - first : chunk;
        if (with32) quantize_act32(x + first * k, n, k, x32, threads, 1);
        if (with256) quantize_act256(x + first * k, n, k, x256, threads, 1);
        const int status = parts_product(parts, count, x32, x256, 2 * n, k, pairs, total, threads);
        if (status != 0) return status;
        for (int64_t r = 0; r < n; ++r)  // a row's codes' product plus its remainder's
            for (int64_t c = 0; c < total; ++c)
                y[(first + r) * total + c] =
                    pairs[2 * r * total + c] + pairs[(2 * r + 1) * total + c];
    }
    return 0;
}
