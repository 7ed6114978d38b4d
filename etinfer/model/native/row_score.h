/* A vocabulary-wide row's log-probability ingredients, gathered a span at a time: the maximum,
 * the sum of exponentials against it (in double, rescaled when the maximum rises), the count of
 * values above a reference (the scored token's logit) and the k largest with their ids. The
 * spans are a row in memory cut into L1-sized chunks (row_scores.c) or the output head's tiles
 * as the kernel makes them (quant_head_scores.c); states of disjoint spans merge. */
#ifndef ETINFER_ROW_SCORE_H
#define ETINFER_ROW_SCORE_H
#include "vector_math.h"

#define MAX_TOP 64

typedef struct {
    float most;      // the largest value met
    float floor;     // the k-th largest met, once k are held
    double sum;      // of exp(value - most)
    int64_t above;   // values above the reference
    int64_t filled;  // of top and ids, largest first
    float top[MAX_TOP];
    int64_t ids[MAX_TOP];
} RowScore;

static inline void row_score_start(RowScore *s) {
    s->most = s->floor = -INFINITY;
    s->sum = 0.0;
    s->above = s->filled = 0;
}

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

/* `value` into the descending top[0..k) if it is among the k largest yet. Among equal values the
 * first met stays ahead. */
static inline void keep(RowScore *s, float value, int64_t id, int64_t k) {
    int64_t at;
    if (s->filled < k)
        at = s->filled++;
    else if (value > s->top[k - 1])
        at = k - 1;
    else
        return;
    while (at > 0 && value > s->top[at - 1]) {
        s->top[at] = s->top[at - 1];
        s->ids[at] = s->ids[at - 1];
        --at;
    }
    s->top[at] = value;
    s->ids[at] = id;
    if (s->filled == k) s->floor = s->top[k - 1];
}

/* The eight values `x` (ids from `at`) offered to the top k: one comparison against the k-th
 * largest yet turns most vectors away. */
static inline void offer8(RowScore *s, v8 x, int64_t at, int64_t k) {
    if (s->filled < k || any_lane(x > ((v8){0} + s->floor)))
        for (int j = 0; j < 8; ++j) keep(s, x[j], at + j, k);
}

/* The `n` values `x` (ids from `first`) into the state: their maximum, count above `reference`
 * and top k first, then their exponentials against the running maximum, while they are still in
 * L1. */
static inline void row_score_span(RowScore *s, const float *x, int64_t n, int64_t first,
                                  float reference, int64_t k) {
    const v8 reference8 = (v8){0} + reference;
    v8 most8 = (v8){0} - INFINITY;
    v8i above8 = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const v8 v = load8(x + i);
        most8 = blend(v > most8, v, most8);
        above8 -= v > reference8;
        if (k) offer8(s, v, first + i, k);
    }
    float most = lane_max(most8);
    for (int j = 0; j < 8; ++j) s->above += above8[j];
    for (int64_t t = i; t < n; ++t) {
        most = x[t] > most ? x[t] : most;
        s->above += x[t] > reference;
        if (k) keep(s, x[t], first + t, k);
    }
    if (most > s->most) {
        s->sum *= exp((double)s->most - most);
        s->most = most;
    }
    if (s->most == -INFINITY) return;  // every value -inf so far: nothing to add
    const v8 most_8 = (v8){0} + s->most;
    v8 sum8 = {0}, sum8b = {0};
    int64_t c = 0;
    for (; c + 16 <= n; c += 16) {
        sum8 += exp8(load8(x + c) - most_8);
        sum8b += exp8(load8(x + c + 8) - most_8);
    }
    double sum = lane_sum(sum8 + sum8b);
    for (; c < n; ++c) sum += expf(x[c] - s->most);
    s->sum += sum;
}

/* A state of other values (ids apart from `into`'s, all larger where ties are to keep order)
 * into `into`. */
static inline void row_score_merge(RowScore *into, const RowScore *from, int64_t k) {
    if (from->most > into->most) {
        into->sum = into->sum * exp((double)into->most - from->most) + from->sum;
        into->most = from->most;
    } else if (from->sum > 0.0) {
        into->sum += from->sum * exp((double)from->most - into->most);
    }
    into->above += from->above;
    for (int64_t j = 0; j < from->filled; ++j) keep(into, from->top[j], from->ids[j], k);
}

#endif
