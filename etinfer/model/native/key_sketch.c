/* Block scores from the low-rank key copy (control/key_sketch.py; model/block_kernels.py calls
 * this): every context token scored against each query head's projected query, and each block's
 * share of the softmax mass those scores give, in logs. It runs in every pruned layer of a decode
 * step over every context token, where the torch form gathers the copy of every table entry
 * (padding included) and keeps a logit a token and query head: at 8K tokens and batch 8 some
 * 13 MB written and read again a layer. Here the copy is stored by block and pairs of its
 * directions, [kv_heads, blocks, rank / 2, block_size, 2] (each token's two codes of a pair side
 * by side), so that eight tokens' codes of a pair widen to one vector of 16-bit integers and one
 * multiply-add of pairs (vpmaddwd; vpdpwssd with VNNI) scores them against a query head's pair,
 * quantized to 16 bits: no sum across lanes, where a token-major copy needed one a token and
 * head (the first pass took 2.1x as long held to AVX2, 3.4x with VNNI). The dot products are
 * exact integers, so the torch form computes them alike. A context's logits go to a scratch of
 * the thread's (L2-sized), and a second pass sums each block's exponentials against the
 * context's largest logit, eight blocks at a time, with one vector log for the eight. The same
 * answer as the torch form up to float rounding: a block far enough below the largest that its
 * exponentials would underflow is summed again against its own largest, as torch sums every
 * block, so that it keeps its finite score. The same logits choose single tokens instead
 * (sketch_token_pattern; the choice in token_choice.c).
 */
#include <stdlib.h>

#include "copy_products.h"
#include "kernels.h"
#include "vector_math.h"

/* The largest rank: its int32 sums of 16-bit queries times 8-bit codes stay exact (127 * 32767 *
 * 512 < 2^31). */
enum { MAX_RANK = 512 };
/* A block whose exponentials against the context's largest logit sum below this is summed again
 * against its own largest: its terms lie near float's underflow (exp8 flushes below e^-87), where
 * torch's form, which subtracts each block's own largest, keeps them to full precision. */
#define FAR_BELOW 1e-20f
/* How many blocks ahead the first pass asks for a block's codes: at 8K tokens and batch 8 the
 * copy comes from memory (the cache's keys and values evict it between layers), and the next
 * block alone left it waiting (a pruned step 0.58x dense's, held to AVX2; 0.54x four blocks
 * ahead, 0.55x eight). */
enum { AHEAD = 4 };

static inline float lane_max(v8 x) {
    float m = x[0];
    for (int i = 1; i < 8; ++i) m = x[i] > m ? x[i] : m;
    return m;
}

/* What every (sequence, KV head) pair of a call shares. */
typedef struct {
    const float *projected;
    const int8_t *codes;
    const float *code_scales;
    const int64_t *tables, *lens;
    int64_t kv_heads, group, rank, width, num_slots, block_size, sink, recent;
    float scale;
    float *out;  // the block scores; or, with crow, the token pattern's kept shares
    int32_t *crow, *cols;
} Sketch;

/* Tokens of sequence s's context the table covers (the torch form masks at width * size too). */
static inline int64_t context_of(const Sketch *k, int64_t s) {
    const int64_t len = k->lens[s], room = k->width * k->block_size;
    return len < 0 ? 0 : len > room ? room : len;
}

/* The exponentials of a block's `size` logits against `high` (>= each), summed lane-wise. */
static inline v8 block_exps(const float *x, int64_t size, float high) {
    v8 acc = {0};
    int64_t c = 0;
    for (; c + 8 <= size; c += 8) acc += exp8(load8(x + c) - high);
    if (c < size) {
        v8 tail = (v8){0} - INFINITY;
        memcpy(&tail, x + c, (size - c) * sizeof *x);
        acc += exp8(tail - high);
    }
    return acc;
}

/* A block's log-sum-exp against its own largest logit, as torch takes it (the few blocks far
 * below the context's largest). */
static float own_lse(const float *x, int64_t size) {
    float high = -INFINITY, sum = 0.0f;
    for (int64_t c = 0; c < size; ++c) high = x[c] > high ? x[c] : high;
    if (high == -INFINITY) return high;
    for (int64_t c = 0; c < size; ++c) sum += expf(x[c] - high);
    return high + logf(sum);
}

/* The first pass of one (sequence s, KV head h) pair: every context token's logits into
 * `scratch` (a row of `span` floats a head, -inf from the context's end to its last block's) and
 * each head's largest into `high`; with `lse`, each head's log-sum-exp too, summed as the logits
 * come (each lane's exponentials against its running largest, rescaled the few times it rises):
 * where the copy's bytes come from memory the exponentials hide under its loads, where a second
 * pass over the scratch cost a twentieth of a pruned step. Inlined with `group` a constant for the
 * common groups (first_pass), so that the heads' sums stay in registers. */
static inline __attribute__((always_inline)) void logits_of(const Sketch *k, int64_t pair,
                                                            float *scratch, int64_t span,
                                                            const int64_t group, float *high,
                                                            float *lse) {
    const int64_t s = pair / k->kv_heads, h = pair % k->kv_heads;
    const int64_t size = k->block_size, pairs = (k->rank + 1) / 2;
    const int64_t tokens = context_of(k, s), blocks = (tokens + size - 1) / size;
    const int64_t block_bytes = pairs * size * 2, num_blocks = k->num_slots / size;
    int32_t query[group * pairs];
    float factor[group];
    v8 top[group], sums[group];
    for (int64_t j = 0; j < group; ++j) {
        const float *q = k->projected + (pair * group + j) * k->rank;
        factor[j] = query_pairs(q, k->rank, query + j * pairs) * k->scale;
        top[j] = (v8){0} - INFINITY, sums[j] = (v8){0};
    }
    const int64_t *table = k->tables + s * k->width;
    const int8_t *codes = k->codes + h * num_blocks * block_bytes;
    const float *code_scales = k->code_scales + h * k->num_slots;
    for (int64_t b = 0; b < blocks; ++b) {
        const int8_t *block = codes + table[b] * block_bytes;
        if (b + AHEAD < blocks) {  // a later block's codes: blocks lie anywhere in the cache
            const int8_t *next = codes + table[b + AHEAD] * block_bytes;
            for (int64_t e = 0; e < block_bytes; e += 64) __builtin_prefetch(next + e, 0, 3);
            __builtin_prefetch(code_scales + table[b + AHEAD] * size, 0, 3);
        }
        const int64_t count = tokens - b * size < size ? tokens - b * size : size;
        for (int64_t i0 = 0; i0 < count; i0 += 8) {  // eight tokens, each read by every head
            const int64_t present = count - i0 < 8 ? count - i0 : 8, whole = size - i0 >= 8;
            v8i acc[group];
            for (int64_t j = 0; j < group; ++j) acc[j] = (v8i){0};
            for (int64_t p = 0; p < pairs; ++p) {
                const int8_t *at = block + (p * size + i0) * 2;
                int8_t part[16] = {0};  // a block of no multiple of eight tokens: its last ones
                if (!whole) memcpy(part, at, (size - i0) * 2);
                for (int64_t j = 0; j < group; ++j)
                    acc[j] = pair_products(acc[j], whole ? at : part, query[j * pairs + p]);
            }
            const float *scales = code_scales + table[b] * size + i0;
            v8 unit = {0};  // each token's code scale
            if (whole) unit = load8(scales);
            else memcpy(&unit, scales, (size - i0) * sizeof *scales);
            /* Eight values from b * size + i0 on: past a block of no multiple of eight tokens they
             * spill into the next block's, written after them. */
            float *out = scratch + b * size + i0;
            for (int64_t j = 0; j < group; ++j) {
                v8 x = __builtin_convertvector(acc[j], v8) * (unit * factor[j]);
                for (int64_t i = present; i < 8; ++i) x[i] = -INFINITY;
                const v8i rises = x > top[j];
                if (lse && lane_bits(rises)) {  // the lanes' sums against their new largest
                    const v8 raised = blend(rises, x, top[j]);
                    sums[j] *= exp8(blend(top[j] > -INFINITY, top[j] - raised, top[j]));
                }
                top[j] = blend(rises, x, top[j]);
                if (lse) sums[j] += exp8(blend(x > -INFINITY, x - top[j], x));
                memcpy(out + j * span, &x, sizeof x);
            }
        }
    }
    for (int64_t j = 0; j < group; ++j) {
        high[j] = lane_max(top[j]);
        for (int64_t t = tokens; t < blocks * size; ++t) scratch[j * span + t] = -INFINITY;
        if (lse)  // the lanes' sums against the largest of all (a lane without logits adds 0)
            lse[j] = high[j] + logf(lane_sum(sums[j] * exp8(blend(top[j] > -INFINITY,
                                                                  top[j] - high[j], top[j]))));
    }
}

/* out[s, h, j, :] for each of the pair's `group` query heads, from its logits: each block's sum
 * of exponentials against the head's largest, eight blocks at a time, their logs, and the
 * context's. Not inlined (nor token_rows) into the first pass's loop, which it slowed by 2%. */
static __attribute__((noinline)) void block_shares(const Sketch *k, int64_t pair,
                                                   const float *scratch, int64_t span,
                                                   const float *high) {
    const int64_t size = k->block_size, width = k->width;
    const int64_t blocks = (context_of(k, pair / k->kv_heads) + size - 1) / size;
    float *out = k->out + pair * k->group * width;
    for (int64_t j = 0; j < k->group; ++j) {
        const float *x = scratch + j * span, most = high[j];
        float *lse = out + j * width;
        for (int64_t b = blocks; b < width; ++b) lse[b] = -INFINITY;
        if (!(most > -INFINITY && most < INFINITY)) {  // no finite logit: torch's NaN
            for (int64_t b = 0; b < blocks; ++b) lse[b] = NAN;
            continue;
        }
        v8 total = {0};
        for (int64_t b0 = 0; b0 < blocks; b0 += 8) {
            const int64_t n = blocks - b0 < 8 ? blocks - b0 : 8;
            v8 acc[8];
            for (int64_t i = 0; i < 8; ++i)
                acc[i] = i < n ? block_exps(x + (b0 + i) * size, size, most) : (v8){0};
            const v8 sums = lane_sums(acc);
            total += sums;
            const v8i near = sums >= FAR_BELOW;
            v8 logs = log8(blend(near, sums, (v8){0} + 1.0f));
            for (int64_t i = 0; i < n; ++i)
                lse[b0 + i] = near[i] ? logs[i] : own_lse(x + (b0 + i) * size, size) - most;
        }
        const float whole = logf(lane_sum(total));  // at least 1: the largest logit's own term
        for (int64_t b = 0; b < blocks; ++b) lse[b] -= whole;
    }
}

/* token_choice.c: each row's entries, and a pair's choice of tokens from its heads' logits. */
int token_offsets(const int64_t *lens, const int64_t *budgets, int64_t seqs, int64_t heads,
                  int64_t room, int64_t sink, int64_t recent, int32_t *crow);
void choose_tokens(float *rows, int64_t span, int64_t group, const float *lse, int64_t tokens,
                   int64_t len, int64_t sink, int64_t recent, int64_t count,
                   const int64_t *table, int64_t size, int64_t base, int32_t *cols, float *kept,
                   int64_t width);

/* The pair's rows of the token pattern, from its logits: each head's log-sum-exp against its
 * largest (as the blocks' pass sums), and the choice (token_choice.c). */
static __attribute__((noinline)) void token_rows(const Sketch *k, int64_t pair, float *scratch,
                                                 int64_t span, const float *lse) {
    const int64_t s = pair / k->kv_heads, tokens = context_of(k, s), row = pair * k->group;
    choose_tokens(scratch, span, k->group, lse, tokens, k->lens[s], k->sink, k->recent,
                  k->crow[row + 1] - k->crow[row], k->tables + s * k->width, k->block_size,
                  pair % k->kv_heads * k->num_slots, k->cols + k->crow[row],
                  k->out + pair * k->width, k->width);
}

/* logits_of with `group` a constant for the common groups (and `lse`, NULL or not, too). */
static inline __attribute__((always_inline)) void first_pass(const Sketch *k, int64_t pair,
                                                             float *scratch, int64_t span,
                                                             float *high, float *lse) {
    switch (k->group) {
        case 1: logits_of(k, pair, scratch, span, 1, high, lse); break;
        case 2: logits_of(k, pair, scratch, span, 2, high, lse); break;
        case 3: logits_of(k, pair, scratch, span, 3, high, lse); break;
        case 4: logits_of(k, pair, scratch, span, 4, high, lse); break;
        default: logits_of(k, pair, scratch, span, k->group, high, lse);
    }
}

/* Every (sequence, KV head) pair's logits, then its block shares or (with crow) its token rows,
 * in parallel over pairs taken one at a time (contexts differ in length), each thread with a
 * scratch of max(group, 2) rows of width * size + 8 floats. The ids are checked first: the
 * exported functions' statuses. */
static int run_pairs(const Sketch *k, int64_t seqs, int64_t threads) {
    if (k->rank < 1 || k->rank > MAX_RANK || k->group < 1 || k->block_size < 1 || k->width < 0)
        return -2;
    const int64_t num_blocks = k->num_slots / k->block_size;
    for (int64_t s = 0; s < seqs; ++s) {
        const int64_t *table = k->tables + s * k->width;
        const int64_t blocks = (context_of(k, s) + k->block_size - 1) / k->block_size;
        for (int64_t b = 0; b < blocks; ++b)
            if (table[b] < 0 || table[b] >= num_blocks) return -1;
    }
    const int64_t span = k->width * k->block_size + 8;  // a head's logits, and eight spilled
    const int64_t rows = k->group < 2 ? 2 : k->group;
    int failed = 0;
#pragma omp parallel num_threads(threads < 1 ? 1 : threads)
    {
        float *scratch = malloc(rows * span * sizeof *scratch);  // once a thread and call
        float high[k->group], lse[k->group];
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t pair = 0; pair < seqs * k->kv_heads; ++pair) {
            if (!scratch) continue;
            if (k->crow) {
                first_pass(k, pair, scratch, span, high, lse);
                token_rows(k, pair, scratch, span, lse);
            } else {
                first_pass(k, pair, scratch, span, high, NULL);
                block_shares(k, pair, scratch, span, high);
            }
        }
        free(scratch);
    }
    return failed ? -3 : 0;
}

/* projected [seqs, kv_heads, group, rank]: each query head's row of q [seqs, kv_heads * group,
 * dim] times its KV head's map [kv_heads, dim, rank] (control/key_sketch.py's project), summed
 * over dim in order: the layer-by-layer path and the native decoder call this one, so that both
 * choose the same tokens. */
void project_queries(const float *q, const float *maps, int64_t seqs, int64_t kv_heads,
                     int64_t group, int64_t dim, int64_t rank, float *projected) {
    for (int64_t row = 0; row < seqs * kv_heads * group; ++row) {
        const float *query = q + row * dim, *map = maps + row / group % kv_heads * dim * rank;
        float *out = projected + row * rank;
        for (int64_t r = 0; r < rank; ++r) out[r] = 0.0f;
        for (int64_t d = 0; d < dim; ++d)
            for (int64_t r = 0; r < rank; ++r) out[r] += query[d] * map[d * rank + r];
    }
}

/* Each block's share of the softmax mass under the key copy's scores, in logs, per query head:
 * out [seqs, kv_heads, group, width], -inf for a table entry holding no context token (a
 * sequence without context has -inf throughout, where torch's form has NaN). A token t < lens[s]
 * sits in slot tables[s, t / size] * size + t % size; its logit for query head j of KV head h is
 * (q . c) * (code_scales[h, slot] * (query_scale * scale)), with q the head's projected query in
 * 16 bits and query_scale its scale (query_pairs), c the slot's codes, projected [seqs, kv_heads,
 * group, rank], codes [kv_heads, num_slots / size, (rank + 1) / 2, size, 2] (a zero past an odd
 * rank) and code_scales [kv_heads, num_slots]. Only entries holding context are read: padding
 * may hold any id. Returns 0; -1
 * (nothing written) for a block id of the context outside [0, num_slots / size); -2 for sizes it
 * does not take (a rank above MAX_RANK among them); -3 where a scratch could not be allocated. */
int sketch_block_scores(const float *projected, const int8_t *codes, const float *code_scales,
                        const int64_t *tables, const int64_t *lens, int64_t seqs,
                        int64_t kv_heads, int64_t group, int64_t rank, int64_t width,
                        int64_t num_slots, int64_t block_size, float scale, float *out,
                        int64_t threads) {
    const Sketch k = {.projected = projected, .codes = codes, .code_scales = code_scales,
                      .tables = tables, .lens = lens, .kv_heads = kv_heads, .group = group,
                      .rank = rank, .width = width, .num_slots = num_slots,
                      .block_size = block_size, .scale = scale, .out = out};
    return run_pairs(&k, seqs, threads);
}

/* The cache rows each decode row reads where single tokens are kept (control/key_sketch.py's
 * sketch_token_pattern), from sketch_block_scores' logits: per (sequence, KV head) the sink and
 * recent tokens of the context and its best others by the largest log share of the mass any
 * query head gives them, min(tokens, max(budgets[s], forced)) in all (token_choice.c). crow
 * [seqs * kv_heads * group + 1] int32, rows (s, h, j) in order; cols [crow's last] int32; kept
 * [seqs, kv_heads, width] (without it only crow is written, for the caller to size cols, and no
 * id checked). Returns crow's last; else -1 and -3 as sketch_block_scores, -2 for sizes it does
 * not take (entries or cache rows past int32's range among them). */
int sketch_token_pattern(const float *projected, const int8_t *codes, const float *code_scales,
                         const int64_t *tables, const int64_t *lens, int64_t seqs,
                         int64_t kv_heads, int64_t group, int64_t rank, int64_t width,
                         int64_t num_slots, int64_t block_size, float scale, float *kept,
                         int64_t threads, const int64_t *budgets, int64_t sink, int64_t recent,
                         int32_t *crow, int32_t *cols) {
    const Sketch k = {.projected = projected, .codes = codes, .code_scales = code_scales,
                      .tables = tables, .lens = lens, .kv_heads = kv_heads, .group = group,
                      .rank = rank, .width = width, .num_slots = num_slots,
                      .block_size = block_size, .sink = sink, .recent = recent, .scale = scale,
                      .out = kept, .crow = crow, .cols = cols};
    if (kv_heads * num_slots > INT32_MAX) return -2;
    const int total = token_offsets(lens, budgets, seqs, kv_heads * group, width * block_size,
                                    sink, recent, crow);
    const int status = total < 0 || !kept ? 0 : run_pairs(&k, seqs, threads);
    return status ? status : total;
}
