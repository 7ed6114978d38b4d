/* The engine's native kernels (model/native_kernels.py builds and calls them): decode attention,
 * the cache write, and the residual add with the RMS norm before an integer kernel. Each does in
 * one call what torch does in several operations, each of which costs a microsecond or more of
 * dispatch at batch 1, where a step is about 6 ms.
 *
 * Decode attention runs over a CSR pattern of cache rows: scores, masking, softmax and the
 * weighted sum of values. The query heads that share a KV head read the same entries
 * (model/attention/pattern.py repeats a KV head's runs for each of them), so they are taken together:
 * each key is loaded once for the group's dot products. Every row is still computed on its own,
 * in entry order, with a fixed order of additions: a row's result depends neither on the other
 * rows of the call nor on how they are split among threads (batching invariance). Vectors are 8
 * floats wide, which AVX2 has; the head dimension must be a multiple of 8 (the caller checks).
 */
#include "kernels.h"
#include "vector_math.h"

enum { MAX_GROUP = 16, MAX_LANES = 32, MAX_THREADS = 64 };

/* Entries ahead that the loops ask the memory system for: the cache of a layer is cold when the
 * layer starts (the weights of the layers before it went through the caches since), and a run
 * of a block's slots is 4 KB for a head size of 64, one page, where hardware prefetchers stop. */
enum { PREFETCH = 16 };

static inline int64_t kv_size(int kind) {
    return kind == KV_FLOAT32 ? 4 : kind == KV_INT8 ? 1 : 2;
}

/* The bytes of a cache row of `dim` elements, line by line. */
static inline void prefetch_row(const void *base, int64_t row, int64_t dim, int kind) {
    const char *p = (const char *)base + row * dim * kv_size(kind);
    for (int64_t b = 0; b < dim * kv_size(kind); b += 64) __builtin_prefetch(p + b, 0, 3);
}

typedef struct {
    const float *q;
    const void *keys, *values;  // elements of kind `kind`
    const float *key_scales, *value_scales;  // a scale a cache row, for KV_INT8
    const int32_t *crow, *cols;
    const uint8_t *outside;
    int64_t dim, group;
    int kind;
    float scale;
    float *out, *row_max, *denominators, *weights;
    int64_t first_group, end_group;
} Job;

/* q times the cache row starting at element `at`. */
static inline float dot(const float *q, const void *keys, int64_t at, int64_t lanes,
                        const int kind) {
    v8 acc = load8(q) * load_kv(keys, at, kind);
    for (int64_t l = 1; l < lanes; ++l) acc += load8(q + 8 * l) * load_kv(keys, at + 8 * l, kind);
    return lane_sum(acc);
}

/* One group of `group` query rows over their shared entries. Inlined with `dim` a constant for
 * the common head sizes, so that the accumulators live in registers. Scores are taken eight
 * entries at a time (each key is loaded once for the whole group); a row's remaining entries one
 * at a time. Where a row's entries fall depends on its own length only. */
static inline __attribute__((always_inline)) void attend_group(const Job *job, int64_t g,
                                                               const int64_t dim, const int kind) {
    const int64_t group = job->group, lanes = dim / 8, first = g * group;
    const int32_t begin = job->crow[first], end = job->crow[first + 1];
    const int64_t length = end - begin, whole = length - length % 8;
    v8 best[MAX_GROUP];
    for (int64_t j = 0; j < group; ++j) best[j] = (v8){0} - INFINITY;
    for (int64_t e = 0; e < whole; e += 8) {
        int64_t k[8];  // the entries' first elements
        for (int i = 0; i < 8; ++i) k[i] = (int64_t)job->cols[begin + e + i] * dim;
        v8 key_scale = {1, 1, 1, 1, 1, 1, 1, 1};
        if (kind == KV_INT8)
            for (int i = 0; i < 8; ++i) key_scale[i] = job->key_scales[job->cols[begin + e + i]];
        if (e + PREFETCH + 8 <= length)
            for (int i = 0; i < 8; ++i)
                prefetch_row(job->keys, job->cols[begin + e + PREFETCH + i], dim, kind);
        for (int64_t j = 0; j < group; ++j) {
            const float *q = job->q + (first + j) * dim;
            v8 acc[8];
            const v8 q0 = load8(q);
            for (int i = 0; i < 8; ++i) acc[i] = q0 * load_kv(job->keys, k[i], kind);
            for (int64_t l = 1; l < lanes; ++l) {
                const v8 ql = load8(q + 8 * l);
                for (int i = 0; i < 8; ++i) acc[i] += ql * load_kv(job->keys, k[i] + 8 * l, kind);
            }
            const int64_t at = begin + j * length + e;
            v8 s = lane_sums(acc) * job->scale;
            if (kind == KV_INT8) s *= key_scale;
            uint64_t flags;  // the eight entries' flags at once: almost always all zero
            memcpy(&flags, job->outside + at, sizeof flags);
            if (flags)
                for (int i = 0; i < 8; ++i) s[i] = job->outside[at + i] ? -INFINITY : s[i];
            memcpy(job->weights + at, &s, sizeof s);
            best[j] = blend(s > best[j], s, best[j]);
        }
    }
    for (int64_t j = 0; j < group; ++j) {
        const int64_t row = first + j;
        const float *q = job->q + row * dim;
        float *w = job->weights + begin + j * length;
        float top = -INFINITY;
        for (int i = 0; i < 8; ++i) top = best[j][i] > top ? best[j][i] : top;
        for (int64_t e = whole; e < length; ++e) {
            const int32_t col = job->cols[begin + e];
            float s = dot(q, job->keys, (int64_t)col * dim, lanes, kind) * job->scale;
            if (kind == KV_INT8) s *= job->key_scales[col];
            w[e] = job->outside[begin + j * length + e] ? -INFINITY : s;
            top = w[e] > top ? w[e] : top;
        }
        v8 sums = {0};
        for (int64_t e = 0; e < whole; e += 8) {
            const v8 p = exp8(load8(w + e) - top);
            memcpy(w + e, &p, sizeof p);
            sums += p;
        }
        float total = lane_sum(sums);
        for (int64_t e = whole; e < length; ++e) {
            w[e] = expf(w[e] - top);
            total += w[e];
        }
        v8 acc[MAX_LANES];
        for (int64_t l = 0; l < lanes; ++l) acc[l] = (v8){0};
        for (int64_t e = 0; e < length; ++e) {
            const int64_t v = (int64_t)job->cols[begin + e] * dim;
            if (j == 0 && e + PREFETCH < length)  // the group's later rows find them cached
                prefetch_row(job->values, job->cols[begin + e + PREFETCH], dim, kind);
            const float weight =
                kind == KV_INT8 ? w[e] * job->value_scales[job->cols[begin + e]] : w[e];
            const v8 p = (v8){0} + weight;
            for (int64_t l = 0; l < lanes; ++l) acc[l] += p * load_kv(job->values, v + 8 * l, kind);
        }
        float *o = job->out + row * dim;
        for (int64_t l = 0; l < lanes; ++l) {
            const v8 normalised = acc[l] / total;
            memcpy(o + 8 * l, &normalised, sizeof normalised);
        }
        job->row_max[row] = top;
        job->denominators[row] = total;
    }
}

/* attend_group with the element kind a constant, so that its loads are one instruction each. */
static inline __attribute__((always_inline)) void attend_kind(const Job *job, int64_t g,
                                                              const int64_t dim) {
    if (job->kind == KV_FLOAT16)
        attend_group(job, g, dim, KV_FLOAT16);
    else if (job->kind == KV_INT8)
        attend_group(job, g, dim, KV_INT8);
    else if (job->kind == KV_BFLOAT16)
        attend_group(job, g, dim, KV_BFLOAT16);
    else
        attend_group(job, g, dim, KV_FLOAT32);
}

static void attend_groups(const Job *job) {
    for (int64_t g = job->first_group; g < job->end_group; ++g) {
        if (job->dim == 64)
            attend_kind(job, g, 64);
        else if (job->dim == 128)
            attend_kind(job, g, 128);
        else
            attend_kind(job, g, job->dim);
    }
}

/* q [rows, dim]; keys, values [cache_rows, dim] of `kind` (with KV_INT8, key_scales and
 * value_scales [cache_rows]; else unread); crow [rows + 1]; cols, outside [nnz] (outside:
 * 1 for entries beyond the context, which get zero weight). Rows come in groups of `group`
 * consecutive rows with the same entries. Writes out [rows, dim] (normalised), row_max and
 * denominators [rows], and weights [nnz] (each entry's exp(score - row max)). Groups are split
 * into `threads` contiguous parts of about equal entries. Returns 0; -1 if a limit is exceeded,
 * -2 if the pattern is malformed or reads outside the cache (nothing is written then: the
 * pattern is checked first, a pass over int32s that costs far less than the attention). */
int decode_attention(const float *q, const void *keys, const void *values, const int32_t *crow,
                     const int32_t *cols, const uint8_t *outside, int64_t rows, int64_t dim,
                     int64_t nnz, int64_t cache_rows, int64_t group, float scale, float *out,
                     float *row_max, float *denominators, float *weights, int64_t threads,
                     int kind, const float *key_scales, const float *value_scales) {
    if (group < 1 || group > MAX_GROUP || rows % group || dim % 8 || dim / 8 > MAX_LANES ||
        kind < KV_FLOAT32 || kind > KV_INT8 || (kind == KV_INT8 && !(key_scales && value_scales)))
        return -1;
    /* Without early exits, so that the compiler vectorises the passes. */
    int bad = crow[0] != 0 || crow[rows] != nnz, uneven = 0;
    for (int64_t r = 0; r < rows; ++r) {
        bad |= crow[r + 1] < crow[r];
        uneven |= crow[r + 1] - crow[r] != crow[r - r % group + 1] - crow[r - r % group];
    }
    /* As unsigned, a negative column is out of range too; 32-bit lanes, twice as many a vector. */
    const uint32_t limit = cache_rows > UINT32_MAX ? UINT32_MAX : (uint32_t)cache_rows;
    for (int64_t i = 0; i < nnz; ++i) bad |= (uint32_t)cols[i] >= limit;
    if (bad) return -2;
    if (uneven) return -1;
    const int64_t groups = rows / group;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > groups) threads = groups;
    if (threads < 1) threads = 1;
    Job jobs[MAX_THREADS];
    int64_t g = 0;
    for (int64_t t = 0; t < threads; ++t) {
        const int64_t target = nnz * (t + 1) / threads;
        int64_t end = g;
        while (end < groups && (t == threads - 1 || crow[end * group] < target)) ++end;
        jobs[t] = (Job){.q = q, .keys = keys, .values = values, .crow = crow, .cols = cols,
                        .key_scales = key_scales, .value_scales = value_scales,
                        .outside = outside, .dim = dim, .group = group, .kind = kind,
                        .scale = scale, .out = out, .row_max = row_max,
                        .denominators = denominators, .weights = weights, .first_group = g,
                        .end_group = end};
        g = end;
    }
#pragma omp parallel for schedule(static, 1) num_threads(threads)
    for (int64_t t = 0; t < threads; ++t) attend_groups(&jobs[t]);
    return 0;
}

static inline uint16_t to_bfloat16(float value) {  // round to nearest even, as torch does
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);  // NaN
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* Float to IEEE half, rounding to nearest even as torch does (and F16C), for hosts without F16C.
 * Subnormals by adding 0.5: the sum's last mantissa bits are then the value in units of 2^-24,
 * rounded by the FPU. */
static inline uint16_t float_to_half(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    const uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    uint32_t magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return sign | 0x7e00u;   // NaN
    if (magnitude >= 0x477ff000u) return sign | 0x7c00u;  // 65520 and above round to infinity
    if (magnitude < 0x38800000u) {                        // below 2^-14: subnormal or zero
        float shifted;
        memcpy(&shifted, &magnitude, sizeof shifted);
        shifted += 0.5f;
        uint32_t sum;
        memcpy(&sum, &shifted, sizeof sum);
        return sign | (uint16_t)(sum - 0x3f000000u);
    }
    magnitude += 0xc8000fffu + ((magnitude >> 13) & 1u);  // exponent rebiased, rounded to even
    return sign | (uint16_t)(magnitude >> 13);
}

/* `dim` floats into a cache row of `kind` starting at element `at` (the row's number times `dim`);
 * for KV_INT8, the row's scale into scales[at / dim]: its largest magnitude over 127, each element
 * divided by it and rounded to nearest even (as kv_cache.py's torch path does). */
static inline void store_kv(void *base, float *scales, int64_t at, const float *row, int64_t dim,
                            int kind) {
    if (kind == KV_INT8) {
        float largest = 0.0f;
        for (int64_t i = 0; i < dim; ++i) largest = fmaxf(largest, fabsf(row[i]));
        const float scale = largest / 127.0f, divisor = scale > 0.0f ? scale : 1.0f;
        int8_t *out = (int8_t *)base + at;
        for (int64_t i = 0; i < dim; ++i) out[i] = (int8_t)nearbyintf(row[i] / divisor);
        scales[at / dim] = scale;
        return;
    }
    if (kind == KV_FLOAT32) {
        memcpy((float *)base + at, row, dim * sizeof(float));
        return;
    }
    uint16_t *out = (uint16_t *)base + at;
    if (kind == KV_BFLOAT16) {
        for (int64_t i = 0; i < dim; ++i) out[i] = to_bfloat16(row[i]);
        return;
    }
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= dim; i += 8) {
        const __m128i packed = _mm256_cvtps_ph(_mm256_loadu_ps(row + i), _MM_FROUND_TO_NEAREST_INT);
        memcpy(out + i, &packed, sizeof packed);
    }
#endif
    for (; i < dim; ++i) out[i] = float_to_half(row[i]);
}

/* The new tokens' keys and values into their cache slots: key_cache and value_cache are
 * [kv_heads, slots, dim] of `kind` (with KV_INT8, key_scales and value_scales [kv_heads, slots];
 * else unread); keys and values [rows, kv_heads, dim] float32 with a row
 * stride of their own (views into the projection's output) and heads `dim` apart. One call
 * instead of a conversion and two indexed copies, which at batch 1 cost more to set up than to
 * run. Returns -1, writing nothing, if a slot is outside the cache or the kind unknown. */
int write_cache(void *key_cache, void *value_cache, const float *keys, const float *values,
                const int64_t *slots, int64_t rows, int64_t kv_heads, int64_t num_slots,
                int64_t dim, int64_t key_row_stride, int64_t value_row_stride, int kind,
                float *key_scales, float *value_scales) {
    if (kind < KV_FLOAT32 || kind > KV_INT8 || (kind == KV_INT8 && !(key_scales && value_scales)))
        return -1;
    for (int64_t r = 0; r < rows; ++r)
        if (slots[r] < 0 || slots[r] >= num_slots) return -1;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < kv_heads; ++h) {
            const int64_t at = (h * num_slots + slots[r]) * dim;
            store_kv(key_cache, key_scales, at, keys + r * key_row_stride + h * dim, dim, kind);
            store_kv(value_cache, value_scales, at, values + r * value_row_stride + h * dim, dim,
                     kind);
        }
    return 0;
}

static inline float widened(const void *residual, int residual_float, int64_t at) {
    if (residual_float) return ((const float *)residual)[at];
    const uint32_t bits = (uint32_t)((const uint16_t *)residual)[at] << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* x_out = x + residual (bfloat16 or float32, or none), then h = rms_norm(x_out) * weight, in
 * bfloat16 for torch's integer kernels or in float32 for the block kernels: the residual add,
 * the norm and the conversion, in one pass instead of three operations. `hidden` must be a
 * multiple of 8. */
void residual_rms_norm(const float *x, const void *residual, int residual_float,
                       const float *weight, int64_t rows, int64_t hidden, float eps, float *x_out,
                       void *h, int h_float) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *in = x + r * hidden;
        float *out = x_out + r * hidden;
        v8 squares = {0};
        for (int64_t i = 0; i < hidden; i += 8) {
            v8 value = load8(in + i);
            if (residual)
                for (int l = 0; l < 8; ++l)
                    value[l] += widened(residual, residual_float, r * hidden + i + l);
            memcpy(out + i, &value, sizeof value);
            squares += value * value;
        }
        const float scale = 1.0f / sqrtf(lane_sum(squares) / (float)hidden + eps);
        if (h_float) {
            float *target = (float *)h + r * hidden;
            for (int64_t i = 0; i < hidden; ++i) target[i] = out[i] * scale * weight[i];
        } else {
            uint16_t *target = (uint16_t *)h + r * hidden;
            for (int64_t i = 0; i < hidden; ++i) target[i] = to_bfloat16(out[i] * scale * weight[i]);
        }
    }
}
