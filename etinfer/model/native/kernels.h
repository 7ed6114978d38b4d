/* The entry points of kernels.c, block_summaries.c and key_sketch.c that other native code calls
 * too (decoder.c runs a decode step's layers through them, so that a fused step computes what
 * the separate calls do). */
#ifndef ETINFER_KERNELS_H
#define ETINFER_KERNELS_H
#include "kv_elements.h"

int decode_attention(const float *q, const void *keys, const void *values, const int32_t *crow,
                     const int32_t *cols, const uint8_t *outside, int64_t rows, int64_t dim,
                     int64_t nnz, int64_t cache_rows, int64_t group, float scale, float *out,
                     float *row_max, float *denominators, float *weights, int64_t threads,
                     int kind, const float *key_scales, const float *value_scales);

int write_cache(void *key_cache, void *value_cache, const float *keys, const float *values,
                const int64_t *slots, int64_t rows, int64_t kv_heads, int64_t num_slots,
                int64_t dim, int64_t key_row_stride, int64_t value_row_stride, int kind,
                float *key_scales, float *value_scales);

void residual_rms_norm(const float *x, const void *residual, int residual_float,
                       const float *weight, int64_t rows, int64_t hidden, float eps, float *x_out,
                       void *h, int h_float);

void update_block_summaries(const void *keys, const void *values, const float *key_scales,
                            const float *value_scales, int kind, const int64_t *slots,
                            int64_t rows, int64_t kv_heads, int64_t num_slots, int64_t dim,
                            int64_t block_size, const int64_t *fresh, int64_t num_fresh,
                            void *bounds, int bound_kind, float *mass, float *value_sums,
                            float *moments);

void observe_block_mass(float *mass, const int32_t *crow, const int32_t *cols,
                        const float *weights, const float *denominators, int64_t rows,
                        int64_t block_size, int64_t group);

void project_queries(const float *q, const float *maps, int64_t seqs, int64_t kv_heads,
                     int64_t group, int64_t dim, int64_t rank, float *projected);

int sketch_token_pattern(const float *projected, const int8_t *codes, const float *code_scales,
                         const int64_t *tables, const int64_t *lens, int64_t seqs,
                         int64_t kv_heads, int64_t group, int64_t rank, int64_t width,
                         int64_t num_slots, int64_t block_size, float scale, float *kept,
                         int64_t threads, const int64_t *budgets, int64_t sink, int64_t recent,
                         int32_t *crow, int32_t *cols);

#endif
