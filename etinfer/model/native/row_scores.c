/* Log-probabilities of vocabulary-wide logit rows, for scoring a prompt's tokens
 * (engine/sampling/prompt_logprobs.py): per row, a target token's log-probability and rank, and
 * the k most likely tokens with theirs. One pass over each row from memory, in chunks that stay
 * in L1 (row_score.h: a chunk's maximum, count and top k, then its exponentials). No second
 * vocabulary-wide buffer. torch's form (a log-sum-exp made in place, a comparison, a top-k)
 * reads each row five times and cost as much again as the output head on Gemma 3's 262,144
 * entries; two passes over each row took 1.3x this one's time. */
#include "row_score.h"

#define CHUNK 2048  // floats a chunk: 8 KiB, held in L1 between its two looks

static void score_row(const float *row, int64_t vocab, int64_t target, int64_t k, float *token_logprob,
                      int64_t *rank, int64_t *top_ids, float *top_logprobs) {
    const float chosen = row[target];
    RowScore s;
    row_score_start(&s);
    for (int64_t i = 0; i < vocab; i += CHUNK)
        row_score_span(&s, row + i, vocab - i < CHUNK ? vocab - i : CHUNK, i, chosen, k);
    const float log_z = s.most + (float)log(s.sum);
    *token_logprob = chosen - log_z;
    *rank = s.above + 1;
    for (int64_t j = 0; j < k; ++j) {
        top_ids[j] = s.ids[j];
        top_logprobs[j] = s.top[j] - log_z;
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
        RowScore s;
        row_score_start(&s);
        int64_t i = 0;
        for (; i + 8 <= vocab; i += 8) offer8(&s, load8(row + i), i, k);
        for (; i < vocab; ++i) keep(&s, row[i], i, k);
        memcpy(out + r * k, s.ids, (size_t)k * sizeof(int64_t));
    }
    return 0;
}
