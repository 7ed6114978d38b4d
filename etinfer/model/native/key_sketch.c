/* Block scores from the low-rank key copy (control/key_sketch.py; model/block_kernels.py calls
 * this): every context token scored against each query head's projected query, and each block's
 * share of the softmax mass those scores give, in logs. It runs in every pruned layer of a decode
 * step over every context token, where the torch form gathers the copy of every table entry
 * (padding included) as float32 and keeps a logit a token and query head: at 8K tokens and
 * batch 8 some 13 MB written and read again a layer. Here each block's codes are read once and
 * widened in L1 for all the query heads of their KV head; a context's logits go to a scratch of
 * the thread's (L2-sized), and a second pass sums each block's exponentials against the
 * context's largest logit, eight blocks at a time, with one vector log for the eight. The same
 * answer as the torch form up to float rounding: a block far enough below the largest that its
 * exponentials would underflow is summed again against its own largest, as torch sums every
 * block, so that it keeps its finite score. The same logits choose single tokens instead
 * (sketch_token_pattern; the choice in token_choice.c).
 */
#include <stdlib.h>

#include "kernels.h"
#include "vector_math.h"

/* The floats of one thread's widened codes: a chunk of at most MAX_CHUNK of a block's tokens,
 * each padded to whole vectors (the copy is int8; the dot products read it eight floats at a
 * time, once per query head, from L1). Ranks above MAX_RANK leave no room for eight tokens: the
 * caller takes torch's form for them. */
enum { CHUNK_FLOATS = 8192, MAX_RANK = CHUNK_FLOATS / 8, MAX_CHUNK = 64 };
/* A block whose exponentials against the context's largest logit sum below this is summed again
 * against its own largest: its terms lie near float's underflow (exp8 flushes below e^-87), where
 * torch's form, which subtracts each block's own largest, keeps them to full precision. */
#define FAR_BELOW 1e-20f

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

/* `count` tokens' codes from `src` widened into keys, each to `padded` floats (zeros past the
 * rank), then zero rows up to the next multiple of eight tokens (their logits are discarded;
 * zeros keep them finite). A rank of whole vectors is one run of conversions. */
static inline void widen(const int8_t *src, int64_t count, float *keys, const int64_t rank,
                         const int64_t padded) {
    if (rank == padded) {
        for (int64_t e = 0; e < count * rank; e += 8) {
            const v8 x = load_kv(src, e, KV_INT8);
            memcpy(keys + e, &x, sizeof x);
        }
    } else {
        for (int64_t i = 0; i < count; ++i) {
            for (int64_t c = 0; c + 8 <= rank; c += 8) {
                const v8 x = load_kv(src, i * rank + c, KV_INT8);
                memcpy(keys + i * padded + c, &x, sizeof x);
            }
            v8i8 tail = {0};  // the last partial vector, copied so as not to read past the copy
            memcpy(&tail, src + i * rank + rank / 8 * 8, rank % 8);
            const v8 x = __builtin_convertvector(tail, v8);
            memcpy(keys + i * padded + rank / 8 * 8, &x, sizeof x);
        }
    }
    const int64_t rounded = (count + 7) / 8 * 8;
    memset(keys + count * padded, 0, (rounded - count) * padded * sizeof *keys);
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
 * each head's largest into `high`. Inlined with `rank` a constant for the common ranks, so that
 * the dot products unroll into registers. */
static inline __attribute__((always_inline)) void logits_of(const Sketch *k, int64_t pair,
                                                            float *scratch, int64_t span,
                                                            const int64_t rank, float *high) {
    const int64_t s = pair / k->kv_heads, h = pair % k->kv_heads;
    const int64_t group = k->group, size = k->block_size, width = k->width;
    const int64_t padded = (rank + 7) / 8 * 8, lanes = padded / 8;
    const int64_t tokens = context_of(k, s), blocks = (tokens + size - 1) / size;
    int64_t chunk = CHUNK_FLOATS / padded / 8 * 8;
    if (chunk > MAX_CHUNK) chunk = MAX_CHUNK;
    float query[group * padded], keys[CHUNK_FLOATS];
    v8 top[group];
    for (int64_t j = 0; j < group; ++j) {  // zeros past the rank meet the widened codes' zeros
        memcpy(query + j * padded, k->projected + (pair * group + j) * rank, rank * sizeof *query);
        memset(query + j * padded + rank, 0, (padded - rank) * sizeof *query);
        top[j] = (v8){0} - INFINITY;
    }
    const int64_t *table = k->tables + s * width;
    const int8_t *codes = k->codes + h * k->num_slots * rank;
    const float *code_scales = k->code_scales + h * k->num_slots;
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t first = table[b] * size;
        const int64_t count = tokens - b * size < size ? tokens - b * size : size;
        if (b + 1 < blocks) {  // the next block's codes: blocks lie anywhere in the cache
            const int64_t next = table[b + 1] * size;
            for (int64_t e = 0; e < size * rank; e += 64)
                __builtin_prefetch(codes + next * rank + e, 0, 3);
            __builtin_prefetch(code_scales + next, 0, 3);
        }
        for (int64_t t = 0; t < count; t += chunk) {
            const int64_t m = count - t < chunk ? count - t : chunk;
            widen(codes + (first + t) * rank, m, keys, rank, padded);
            for (int64_t i0 = 0; i0 < m; i0 += 8) {  // eight tokens, each read by every head
                const int64_t present = m - i0 < 8 ? m - i0 : 8;
                const float *scales = code_scales + first + t + i0;
                v8 factor = {0};
                if (present == 8) factor = load8(scales) * k->scale;
                for (int64_t i = 0; i < present && present < 8; ++i)
                    factor[i] = scales[i] * k->scale;
                const float *key = keys + i0 * padded;
                /* Eight values from b * size + t + i0 on: past a block of no multiple of eight
                 * tokens they spill into the next block's, written after them. */
                float *at = scratch + b * size + t + i0;
                for (int64_t j = 0; j < group; ++j) {
                    const float *q = query + j * padded;
                    v8 acc[8];
                    const v8 q0 = load8(q);
                    for (int i = 0; i < 8; ++i) acc[i] = q0 * load8(key + i * padded);
                    for (int64_t l = 1; l < lanes; ++l) {
                        const v8 ql = load8(q + 8 * l);
                        for (int i = 0; i < 8; ++i) acc[i] += ql * load8(key + i * padded + 8 * l);
                    }
                    v8 x = lane_sums(acc) * factor;
                    for (int64_t i = present; i < 8; ++i) x[i] = -INFINITY;
                    top[j] = blend(x > top[j], x, top[j]);
                    memcpy(at + j * span, &x, sizeof x);
                }
            }
        }
    }
    for (int64_t j = 0; j < group; ++j) {
        high[j] = lane_max(top[j]);
        for (int64_t t = tokens; t < blocks * size; ++t) scratch[j * span + t] = -INFINITY;
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
                                                 int64_t span, const float *high) {
    const int64_t s = pair / k->kv_heads, tokens = context_of(k, s), row = pair * k->group;
    float lse[k->group];
    for (int64_t j = 0; j < k->group; ++j)
        lse[j] = high[j] + logf(lane_sum(block_exps(scratch + j * span, tokens, high[j])));
    choose_tokens(scratch, span, k->group, lse, tokens, k->lens[s], k->sink, k->recent,
                  k->crow[row + 1] - k->crow[row], k->tables + s * k->width, k->block_size,
                  pair % k->kv_heads * k->num_slots, k->cols + k->crow[row],
                  k->out + pair * k->width, k->width);
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
        float high[k->group];
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t pair = 0; pair < seqs * k->kv_heads; ++pair) {
            if (!scratch) continue;
            switch (k->rank) {
                case 16: logits_of(k, pair, scratch, span, 16, high); break;
                case 32: logits_of(k, pair, scratch, span, 32, high); break;
                case 48: logits_of(k, pair, scratch, span, 48, high); break;
                case 64: logits_of(k, pair, scratch, span, 64, high); break;
                default: logits_of(k, pair, scratch, span, k->rank, high);
            }
            if (k->crow) token_rows(k, pair, scratch, span, high);
            else block_shares(k, pair, scratch, span, high);
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
 * scale * code_scales[h, slot] * projected[s, h, j, :] . codes[h, slot, :], with projected
 * [seqs, kv_heads, group, rank], codes [kv_heads, num_slots, rank] and code_scales [kv_heads,
 * num_slots]. Only entries holding context are read: padding may hold any id. Returns 0; -1
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
