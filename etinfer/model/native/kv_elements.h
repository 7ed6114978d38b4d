/* Cache elements as the native kernels read them (kernels.c, block_sparse.c): eight at a time,
 * widened to float32 from the type the KV cache stores. */
#ifndef ETINFER_KV_ELEMENTS_H
#define ETINFER_KV_ELEMENTS_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef int8_t v8i8 __attribute__((vector_size(8)));

/* How the cache stores a key or value element (native_kernels.py's KV_KINDS): attention computes in
 * float32 whatever the storage, widening eight elements at a time as it loads them. An int8 row
 * (one token's key or value for one KV head) has a float32 scale of its own: element i is
 * row[i] * scale. Scores take the key's scale once per dot product, the weighted sum the value's
 * once per weight. */
enum { KV_FLOAT32 = 0, KV_FLOAT16 = 1, KV_BFLOAT16 = 2, KV_INT8 = 3 };

static inline v8 load8(const float *p) {
    v8 x;
    memcpy(&x, p, sizeof x);
    return x;
}

/* IEEE half to float, exactly (subnormals, infinities and NaN included), for hosts without F16C. */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1f;
    uint32_t mantissa = h & 0x3ffu, bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa) {  // subnormal: normalise
        int shift = 0;
        while (!(mantissa & 0x400u)) mantissa <<= 1, ++shift;
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((mantissa & 0x3ffu) << 13);
    } else {
        bits = sign;
    }
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* Eight elements of a cache row from element `at`, widened to float32. With AVX2 each widening
 * is one or two instructions, spelt out: compilers scalarise the generic form of the int8 one. */
static inline v8 load_kv(const void *base, int64_t at, const int kind) {
    if (kind == KV_FLOAT32) return load8((const float *)base + at);
#if defined(__AVX2__)
    if (kind == KV_INT8)
        return (v8)_mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)base + at))));
    if (kind == KV_BFLOAT16)
        return (v8)_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + at))),
            16);
#endif
    if (kind == KV_INT8) {
        v8i8 b;
        memcpy(&b, (const int8_t *)base + at, sizeof b);
        return __builtin_convertvector(b, v8);
    }
    v8u16 h;
    memcpy(&h, (const uint16_t *)base + at, sizeof h);
    if (kind == KV_BFLOAT16) return (v8)(__builtin_convertvector(h, v8i) << 16);
#if defined(__F16C__)
    __m128i packed;
    memcpy(&packed, &h, sizeof packed);
    return (v8)_mm256_cvtph_ps(packed);
#else
    v8 x;
    for (int i = 0; i < 8; ++i) x[i] = half_to_float(h[i]);
    return x;
#endif
}

static inline float lane_sum(v8 x) {
    return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
}

#endif
