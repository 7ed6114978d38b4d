/* Vector arithmetic the native kernels share (kernels.c's scores and softmax, key_sketch.c's
 * scores and logs, decoder.c's activation). */
#ifndef ETINFER_VECTOR_MATH_H
#define ETINFER_VECTOR_MATH_H
#include "kv_elements.h"

static inline v8 blend(v8i mask, v8 yes, v8 no) {
    return (v8)((mask & (v8i)yes) | (~mask & (v8i)no));
}

/* exp(x) for x <= 0 (-inf included), within about 2 ulp of expf: x = n ln2 + r with |r| <= ln2/2,
 * exp(r) by Cephes' degree-7 expansion, 2^n put into the exponent bits. Below -87 the result
 * would leave float's normal range and is 0. */
static inline v8 exp8(v8 x) {
    const v8i underflow = x < -87.0f;
    x = blend(underflow, (v8){0}, x);
    const v8 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
    const v8 r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    v8 p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const v8i exponent = (__builtin_convertvector(n, v8i) + 127) << 23;
    return blend(underflow, (v8){0}, p * (v8)exponent);
}

/* log(x) for normal x > 0, within about 1 ulp of logf: x = m 2^e with m in [sqrt(1/2), sqrt(2)),
 * log(m) by Cephes' logf expansion (a block's log-sum-exp, eight blocks at a time). */
static inline v8 log8(v8 x) {
    const v8i bits = (v8i)x;
    v8i e = ((bits >> 23) & 0xff) - 126;                  // x = f 2^e with f in [0.5, 1)
    v8 m = (v8)((bits & 0x007fffff) | 0x3f000000);        // f
    const v8i small = m < 0.707106781186547524f;          // then 2f - 1 and e - 1
    e += small;
    m = m + blend(small, m, (v8){0}) - 1.0f;
    const v8 z = m * m;
    v8 y = 7.0376836292e-2f * m - 1.1514610310e-1f;
    y = y * m + 1.1676998740e-1f;
    y = y * m - 1.2420140846e-1f;
    y = y * m + 1.4249322787e-1f;
    y = y * m - 1.6668057665e-1f;
    y = y * m + 2.0000714765e-1f;
    y = y * m - 2.4999993993e-1f;
    y = y * m + 3.3333331174e-1f;
    const v8 n = __builtin_convertvector(e, v8);
    y = y * m * z - 2.12194440e-4f * n - 0.5f * z;
    return m + y + 0.693359375f * n;
}

/* A mask's lanes as bits, lane i at bit i. */
static inline unsigned lane_bits(v8i mask) {
#if defined(__AVX2__)
    return (unsigned)_mm256_movemask_ps((__m256)mask);
#else
    unsigned bits = 0;
    for (int i = 0; i < 8; ++i) bits |= (unsigned)(mask[i] & 1) << i;
    return bits;
#endif
}

#if defined(__clang__)  // the same two-vector shuffle, spelt as each compiler does
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

/* The sums of the lanes of a[0], ..., a[7], as the lanes of one vector (three rounds of
 * pairwise additions instead of eight separate horizontal sums). */
static inline v8 lane_sums(const v8 a[8]) {
    v8 t[4], u[2];
    for (int i = 0; i < 4; ++i)
        t[i] = SHUFFLE(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               SHUFFLE(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; ++i)
        u[i] = SHUFFLE(t[2 * i], t[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               SHUFFLE(t[2 * i], t[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUFFLE(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           SHUFFLE(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

#endif
