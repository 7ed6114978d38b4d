/* A decode step's decoder layers in one call (model/native_decoder.py builds the tables): norm,
 * projections, rotation, cache write, attention, output projection, norm, gated MLP and both
 * residual adds, layer after layer, with no return to Python between them. Llama's layer, and
 * Gemma 3's: query and key norms, the attention and MLP outputs normed before their residual
 * adds, a GELU-tanh MLP, and sliding layers with their own angles and pattern. At batch 1 on
 * the default model the layers' own arithmetic is about 60 % of a step; the rest was some 80
 * torch and ctypes calls a layer, each a few microseconds of dispatch.
 *
 * Every stage is the same C the layer-by-layer path calls (kernels.c's norm, cache write and
 * attention; the block products of quant_linear.c / quant_float.c, reached through pointers
 * since they live in the library built only for x86-64-v3; rotate_heads and silu_mul below), in
 * the same order: a token's result is bit for bit the same whichever path its step took, which
 * greedy batching and recompute after preemption rest on. Each row is computed on its own.
 */
enum { SILU = 0, GELU_TANH = 1 };
#include "kernels.h"
#include "vector_math.h"

typedef int (*BlockLinear)(const void *parts, int64_t count, const float *x, int64_t rows,
                           int64_t k, float *y, int64_t threads, int64_t precise);
typedef int (*FloatLinear)(const void *parts, int64_t count, const float *x, int64_t rows,
                           int64_t k, float *y, int64_t threads);

/* One projection as quant_kernels.BlockProduct calls it: its part table and how it multiplies. */
typedef struct {
    const void *parts;
    int64_t count, precise, float_activations;
} Product;

typedef struct {
    Product qkv, o, gate_up, down;
    const float *qkv_bias;  // [(heads + 2 kv_heads) * head_dim], or NULL
    const float *q_norm, *k_norm;  // [head_dim] each head's RMS norm before rotation, or NULL
    const float *input_norm, *mlp_norm;  // [hidden]: before attention, before the MLP
    const float *attention_out_norm, *mlp_out_norm;  // [hidden] before the residual adds, or NULL
    void *key_cache, *value_cache;  // this layer's [kv_heads, slots, head_dim]
    float *key_scales, *value_scales;  // [kv_heads, slots] for an int8 cache, else NULL
    int64_t local;  // a sliding layer: the step's second angles and pattern
    /* Pruning's block summaries of this layer (block_summaries.c), or NULL where the cache keeps
     * none; `observed`: its attention's mass per block goes into `mass`. */
    void *key_bounds;
    float *mass, *value_sums, *key_moments;
    int64_t observed;
    /* A layer that keeps single tokens (control/key_sketch.py): its query map [kv_heads, head_dim,
     * sketch_rank] and the cache's low-rank copy of its keys (codes int8 in model/key_copy.py's
     * layout, their scales [kv_heads, slots]); else NULL. */
    const float *query_map;
    const int8_t *codes;
    const float *code_scales;
} Layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, num_slots, kv_kind, activation;
    int64_t block_size, bound_kind;  // the cache's blocks; the type its key bounds are kept in
    int64_t sketch_rank;  // of the key copy, where a layer keeps single tokens
    float eps, scale;
    BlockLinear block_linear;
    FloatLinear float_linear;
} Shape;

typedef struct {
    float *x;  // [rows, hidden], the residual stream, updated in place
    int64_t rows;
    const int64_t *slots;  // [rows]
    int64_t threads;
    float *work;  // decoder_work_floats() floats
    /* By kind of layer (whole-context, sliding): each row's angles [rows, head_dim / 2], and the
     * decode pattern (model/attention/pattern.py) with the threads attention shares it among. */
    const float *cos[2], *sin[2];
    const int32_t *crow[2], *cols[2];
    const uint8_t *outside[2];
    int64_t nnz[2], attention_threads[2];
    const int64_t *fresh;  // [num_fresh] blocks receiving their first token (their summaries reset)
    int64_t num_fresh;
    /* Single tokens, chosen by each layer that keeps them (its query_map) as the layer-by-layer
     * path chooses them (key_sketch.c): each row's block table [rows, width] and context, the
     * tokens it keeps (budgets, NULL: every layer reads the dense pattern this step), the sink's
     * and recent ones always among them. The pattern is rebuilt in token_crow [rows * heads + 1]
     * and token_cols [token_nnz] at each such layer (token_outside: token_nnz zeros), the queries
     * projected in `projected` [rows * heads * sketch_rank]; the l-th layer of the call writes the
     * share of each block it read, [rows, kv_heads, width], at kept + l * kept_stride. */
    const int64_t *tables, *lens, *budgets;
    int64_t width, sink, recent;
    int32_t *token_crow, *token_cols;
    const uint8_t *token_outside;
    int64_t token_nnz, token_threads;
    float *kept, *projected;
    int64_t kept_stride;
} Step;

/* Rotate the first `heads` heads of each row in place, Hugging Face's layout (a head's two halves
 * rotate as the pairs (x[i], x[i + half])): rows `row_stride` floats apart, cos and sin a row's
 * half-head angles. */
void rotate_heads(float *x, int64_t rows, int64_t heads, int64_t dim, int64_t row_stride,
                  const float *cos, const float *sin) {
    const int64_t half = dim / 2;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < heads; ++h) {
            float *first = x + r * row_stride + h * dim, *second = first + half;
            const float *c = cos + r * half, *s = sin + r * half;
            for (int64_t i = 0; i < half; ++i) {
                const float a = first[i], b = second[i];
                first[i] = a * c[i] - b * s[i];
                second[i] = b * c[i] + a * s[i];
            }
        }
}

/* RMS-norm each of the first `heads` heads of each row in place (rows `row_stride` floats apart),
 * times `weight` [dim]: kernels.c's norm, a head at a time. */
void norm_heads(float *x, int64_t rows, int64_t heads, int64_t dim, int64_t row_stride,
                const float *weight, float eps) {
    for (int64_t r = 0; r < rows; ++r) {
        float *row = x + r * row_stride;
        residual_rms_norm(row, NULL, 0, weight, heads, dim, eps, row, row, 1);
    }
}

/* exp8 holds for x <= 0 only: what follows takes it of minus a magnitude. */
static inline v8 sigmoid8(v8 x) {  // 1 / (1 + exp(-x))
    const v8i negative = x < 0.0f;
    const v8 e = exp8(blend(negative, x, -x));  // exp(-|x|)
    return blend(negative, e, (v8){1, 1, 1, 1, 1, 1, 1, 1}) / (1.0f + e);
}

/* out [rows, width] = act(gate) * up, where gate_up [rows, 2 width] holds each row's gate then
 * its up; act is SiLU, g sigmoid(g), or GELU's tanh form (torch's approximate="tanh"),
 * g (1 + tanh(u)) / 2 = g sigmoid(2u), without the cancellation of 1 + tanh(u) near -1. `width`
 * must be a multiple of 8. */
void gated_activation(const float *gate_up, int64_t rows, int64_t width, int64_t activation,
                      float *out) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *gate = gate_up + r * 2 * width, *up = gate + width;
        for (int64_t i = 0; i < width; i += 8) {
            const v8 g = load8(gate + i);
            const v8 u = 0.7978845608028654f * (g + 0.044715f * g * g * g);  // sqrt(2/pi) (...)
            const v8 a = g * sigmoid8(activation == GELU_TANH ? 2.0f * u : g);
            const v8 y = a * load8(up + i);
            memcpy(out + r * width + i, &y, sizeof y);
        }
    }
}

static int product(const Shape *s, const Product *p, const float *x, int64_t rows, int64_t k,
                   float *y, int64_t threads) {
    if (p->float_activations) return s->float_linear(p->parts, p->count, x, rows, k, y, threads);
    return s->block_linear(p->parts, p->count, x, rows, k, y, threads, p->precise);
}

/* Scratch floats a step of `rows` rows and `nnz` pattern entries (the larger pattern's) needs. */
int64_t decoder_work_floats(const Shape *s, int64_t rows, int64_t nnz) {
    const int64_t width = (s->heads + 2 * s->kv_heads) * s->head_dim, q = s->heads * s->head_dim;
    return rows * (2 * s->hidden + width + 2 * q + 3 * s->intermediate + 2 * s->heads) + nnz;
}

/* v [rows, hidden] RMS-normed in place (an output normed before its residual add). */
static void norm_rows(float *v, int64_t rows, const Shape *s, const float *weight) {
    residual_rms_norm(v, NULL, 0, weight, rows, s->hidden, s->eps, v, v, 1);
}

/* The single tokens layer l of the call reads (its queries in q [rows, heads * head_dim]) into the
 * step's token pattern: 0, or key_sketch.c's failure. */
static int choose_tokens_of(const Shape *s, const Layer *layer, int64_t l, const Step *step,
                            const float *q) {
    const int64_t rows = step->rows, group = s->heads / s->kv_heads, rank = s->sketch_rank;
    const int64_t pairs = rows * s->kv_heads;
    project_queries(q, layer->query_map, rows, s->kv_heads, group, s->head_dim, rank,
                    step->projected);
    const int total = sketch_token_pattern(
        step->projected, layer->codes, layer->code_scales, step->tables, step->lens, rows,
        s->kv_heads, group, rank, step->width, s->num_slots, s->block_size, s->scale,
        step->kept + l * step->kept_stride, step->threads < pairs ? step->threads : pairs,
        step->budgets, step->sink, step->recent, step->token_crow, step->token_cols);
    if (total < 0) return -total;
    return total == step->token_nnz ? 0 : 4;  // 4: not the entries the caller sized for
}

/* Layers [0, count) of `layers` over the step's rows (decode rows only, one token each). Returns
 * 0, or the first stage's nonzero status: 1000 + a product's, 2000 + the cache write's, 3000 +
 * attention's, 4000 + the choice of single tokens' (the layer is then half done: the caller
 * fails the step). */
int decode_layers(const Shape *s, const Layer *layers, int64_t count, const Step *step) {
    const int64_t rows = step->rows, hidden = s->hidden, dim = s->head_dim;
    const int64_t q_width = s->heads * dim, kv_width = s->kv_heads * dim;
    const int64_t width = q_width + 2 * kv_width, inter = s->intermediate;
    float *x = step->x, *h = step->work, *qkv = h + rows * hidden, *q = qkv + rows * width;
    float *attended = q + rows * q_width, *gate_up = attended + rows * q_width;
    float *act = gate_up + rows * 2 * inter, *proj = act + rows * inter;
    float *stats = proj + rows * hidden, *weights = stats + 2 * rows * s->heads;
    const int kind = (int)s->kv_kind;
    for (int64_t l = 0; l < count; ++l) {
        const Layer *layer = &layers[l];
        const int64_t at = layer->local != 0;
        residual_rms_norm(x, NULL, 0, layer->input_norm, rows, hidden, s->eps, x, h, 1);
        int status = product(s, &layer->qkv, h, rows, hidden, qkv, step->threads);
        if (status) return 1000 + status;
        if (layer->qkv_bias)
            for (int64_t r = 0; r < rows; ++r)
                for (int64_t i = 0; i < width; ++i) qkv[r * width + i] += layer->qkv_bias[i];
        if (layer->q_norm) {
            norm_heads(qkv, rows, s->heads, dim, width, layer->q_norm, s->eps);
            norm_heads(qkv + q_width, rows, s->kv_heads, dim, width, layer->k_norm, s->eps);
        }
        rotate_heads(qkv, rows, s->heads + s->kv_heads, dim, width, step->cos[at], step->sin[at]);
        status = write_cache(layer->key_cache, layer->value_cache, qkv + q_width,
                             qkv + q_width + kv_width, step->slots, rows, s->kv_heads,
                             s->num_slots, dim, width, width, kind, layer->key_scales,
                             layer->value_scales);
        if (status) return 2000 + status;
        if (layer->key_bounds)
            update_block_summaries(layer->key_cache, layer->value_cache, layer->key_scales,
                                   layer->value_scales, kind, step->slots, rows, s->kv_heads,
                                   s->num_slots, dim, s->block_size, step->fresh, step->num_fresh,
                                   layer->key_bounds, (int)s->bound_kind, layer->mass,
                                   layer->value_sums, layer->key_moments);
        for (int64_t r = 0; r < rows; ++r)
            memcpy(q + r * q_width, qkv + r * width, q_width * sizeof(float));
        const int32_t *crow = step->crow[at], *cols = step->cols[at];
        const uint8_t *outside = step->outside[at];
        int64_t nnz = step->nnz[at], attention_threads = step->attention_threads[at];
        if (layer->query_map && step->budgets) {
            status = choose_tokens_of(s, layer, l, step, q);
            if (status) return 4000 + status;
            crow = step->token_crow, cols = step->token_cols, outside = step->token_outside;
            nnz = step->token_nnz, attention_threads = step->token_threads;
        }
        status = decode_attention(q, layer->key_cache, layer->value_cache, crow, cols, outside,
                                  rows * s->heads, dim, nnz, s->kv_heads * s->num_slots,
                                  s->heads / s->kv_heads, s->scale, attended, stats,
                                  stats + rows * s->heads, weights, attention_threads, kind,
                                  layer->key_scales, layer->value_scales);
        if (status) return 3000 + status;
        if (layer->observed)
            observe_block_mass(layer->mass, crow, cols, weights,
                               stats + rows * s->heads, rows * s->heads, s->block_size,
                               s->heads / s->kv_heads);
        status = product(s, &layer->o, attended, rows, q_width, proj, step->threads);
        if (status) return 1000 + status;
        if (layer->attention_out_norm) norm_rows(proj, rows, s, layer->attention_out_norm);
        residual_rms_norm(x, proj, 1, layer->mlp_norm, rows, hidden, s->eps, x, h, 1);
        status = product(s, &layer->gate_up, h, rows, hidden, gate_up, step->threads);
        if (status) return 1000 + status;
        gated_activation(gate_up, rows, inter, s->activation, act);
        status = product(s, &layer->down, act, rows, inter, proj, step->threads);
        if (status) return 1000 + status;
        if (layer->mlp_out_norm) norm_rows(proj, rows, s, layer->mlp_out_norm);
        for (int64_t i = 0; i < rows * hidden; ++i) x[i] += proj[i];
    }
    return 0;
}
