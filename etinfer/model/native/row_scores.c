/* Log-probabilities of vocabulary-wide logit rows, for scoring a prompt's tokens
 * (engine/sampling/prompt_logprobs.py): per row, a target token's log-probability and rank, and
 * the k most likely tokens with theirs. One pass over each row from memory, in chunks that stay
 * in L1: a chunk's maximum, the count of logits above the target's and the top k first, then its
 * exponentials against the running maximum (the sum, in double, rescaled when the maximum
 * rises). No second vocabulary-wide buffer. torch's form (a log-sum-exp made in place, a
 * comparison, a top-k) reads each row five times and cost as much again as the output head on
 * Gemma 3's 262,144 entries; two passes over each row took 1.3x this one's time. */
#include "vector_math.h"

#define MAX_TOP 64

static inline float lane_max(v8 x) {
    float m = x[0];
    for (int i = 1; i < 8; ++i) m = x[i] > m ? x[i] : m;
    return m;
}

static inline int any_lane(v8i mask) {
    int64_t parts[4];
    memcpy(parts, &mask, sizeof parts);
    return (parts[0] | parts[1] | parts[2] | parts[3]) != 0;
}

/* `value` into the descending top[0..k) (ids alongside, `filled` of them taken so far) if it is
 * among the k largest yet. Among equal values the first met stays ahead. */
static inline void keep(float value, int64_t id, float *top, int64_t *ids, int64_t k, int64_t *filled) {
    int64_t at;
    if (*filled < k)
        at = (*filled)++;
    else if (value > top[k - 1])
        at = k - 1;
    else
        return;
    while (at > 0 && value > top[at - 1]) {
        top[at] = top[at - 1];
        ids[at] = ids[at - 1];
        --at;
    }
    top[at] = value;
    ids[at] = id;
}

/* The eight logits `x` (ids from `at`) offered to the top k: one comparison against the k-th
 * largest yet (`floor`) turns most vectors away. */
static inline void offer8(v8 x, int64_t at, float *top, int64_t *ids, int64_t k, int64_t *filled,
                          float *floor) {
    if (*filled < k || any_lane(x > ((v8){0} + *floor))) {
        for (int j = 0; j < 8; ++j) keep(x[j], at + j, top, ids, k, filled);
        if (*filled == k) *floor = top[k - 1];
    }
}

#define CHUNK 2048  // floats a chunk: 8 KiB, held in L1 between its two looks

static void score_row(const float *row, int64_t vocab, int64_t target, int64_t k, float *token_logprob,
                      int64_t *rank, int64_t *top_ids, float *top_logprobs) {
    const float chosen = row[target];
    float top[MAX_TOP];
    int64_t ids[MAX_TOP], filled = 0, above = 0;
    const v8 chosen8 = (v8){0} + chosen;
    v8i above8 = {0};
    float floor = -INFINITY, most = -INFINITY;
    double sum = 0.0;  // across chunks: 128 of them in a Gemma row
    int64_t i = 0;
    // One pass over the row in chunks held in L1: each chunk's maximum, count and top k first,
    // then its exponentials against the running maximum (the sum rescaled when it rises).
    for (; i + CHUNK <= vocab; i += CHUNK) {
        v8 most8 = (v8){0} - INFINITY;
        for (int64_t c = i; c < i + CHUNK; c += 8) {
            const v8 x = load8(row + c);
            most8 = blend(x > most8, x, most8);
            above8 -= x > chosen8;
            if (k) offer8(x, c, top, ids, k, &filled, &floor);
        }
        const float chunk_most = lane_max(most8);
        if (chunk_most > most) {
            sum *= exp((double)most - chunk_most);
            most = chunk_most;
        }
        const v8 most_8 = (v8){0} + most;
        v8 sum8 = {0}, sum8b = {0};
        for (int64_t c = i; c < i + CHUNK; c += 16) {
            sum8 += exp8(load8(row + c) - most_8);
            sum8b += exp8(load8(row + c + 8) - most_8);
        }
        sum += lane_sum(sum8 + sum8b);
    }
    for (int j = 0; j < 8; ++j) above += above8[j];
    for (; i < vocab; ++i) {
        const float x = row[i];
        above += x > chosen;
        if (k) keep(x, i, top, ids, k, &filled);
        if (x > most) {
            sum *= exp((double)most - x);
            most = x;
        }
        sum += expf(x - most);
    }
    const float log_z = most + (float)log(sum);
    *token_logprob = chosen - log_z;
    *rank = above + 1;
    for (int64_t j = 0; j < k; ++j) {
        top_ids[j] = ids[j];
        top_logprobs[j] = top[j] - log_z;
    }
}

/* logits [rows, vocab] float32; targets [rows]; out: token_logprob [rows], rank [rows],
 * top_ids [rows, k], top_logprobs [rows, k] (k <= MAX_TOP, k <= vocab). Parallel over rows.
 * Returns -1 (nothing written) for k or a target out of range. */
int score_rows(const float *logits, int64_t rows, int64_t vocab, const int64_t *targets, int64_t k,
               int64_t threads, float *token_logprob, int64_t *rank, int64_t *top_ids,
               float *top_logprobs) {
    if (k < 0 || k > MAX_TOP || k > vocab) return -1;
    for (int64_t r = 0; r < rows; ++r)
        if (targets[r] < 0 || targets[r] >= vocab) return -1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; ++r)
        score_row(logits + r * vocab, vocab, targets[r], k, token_logprob + r, rank + r, top_ids + r * k,
                  top_logprobs + r * k);
    return 0;
}

/* ids [rows, k]: each row of logits [rows, vocab]'s k largest, largest first (among equal values
 * the first met), in one pass (k <= MAX_TOP, k <= vocab; -1 otherwise). The output head's
 * candidates for recomputation (model/linear.py): torch's top-k took 0.52 ms on one Gemma 3
 * row of 262,144 logits, a twentieth of a decode step. Parallel over rows. */
int top_ids(const float *logits, int64_t rows, int64_t vocab, int64_t k, int64_t threads, int64_t *out) {
    if (k < 1 || k > MAX_TOP || k > vocab) return -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 1)
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = logits + r * vocab;
        float top[MAX_TOP], floor = -INFINITY;
        int64_t filled = 0, i = 0;
        for (; i + 8 <= vocab; i += 8) offer8(load8(row + i), i, top, out + r * k, k, &filled, &floor);
        for (; i < vocab; ++i) keep(row[i], i, top, out + r * k, k, &filled);
    }
    return 0;
}
