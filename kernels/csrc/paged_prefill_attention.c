/* Prefill attention straight from the paged KV pool, fp32, for the CPU: a chunk of `length` query rows of one
 * sequence, at positions prefix .. prefix + length - 1, attends causally (or within a sliding window) to the
 * sequence's tokens through its page list. The chunk's own keys and values are in the pool already (written
 * before attending, as for decode rows), so a chunk after a prefix reads its prefix in place: nothing is
 * gathered into a padded copy, and the fused decoder call (csrc/decode_layers.c) runs mixed steps too.
 *
 * Blocked like a matrix product, not row by row as decode attention: per kv head the chunk's keys are
 * transposed once into [head_dim][positions], so a block of up to QUERIES query vectors (rows x the query
 * heads of one kv head) scores KEYS keys per vector FMA, each key read once for the whole block. Then each
 * vector's softmax over its own keys (csrc/softmax.h), and values added up in blocks of VALUE_QUERIES vectors.
 * Every score is one FMA chain over head_dim and every output one chain over the keys in order, whichever
 * block and thread compute it, so a chunk's output depends only on the chunk.
 *
 * Layouts: q [length, heads, head_dim] with row stride q_row_stride; k_pool/v_pool [num_pages, page_size,
 * kv_heads, head_dim]; pages [max_pages] int64, the sequence's pages (prefix + length <= max_pages *
 * page_size); out [length, heads, head_dim] with row stride out_row_stride. window > 0: a query attends to its
 * last `window` positions only; softcap > 0 and sinks [heads] (or NULL) as in paged_decode_attention. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "softmax.h"

/* Vectors of KEYS floats; blocks sized so the accumulators fill most of the registers (32 with AVX-512, else
 * 16). Each lane computes the same chains either way: the outputs are the same bits on both. */
#ifdef __AVX512F__
typedef float vec __attribute__((vector_size(64)));
enum { KEYS = 16, QUERIES = 24, VALUE_QUERIES = 12 };
static inline vec splat(float x) { return (vec){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
#else
typedef float vec __attribute__((vector_size(32)));
enum { KEYS = 8, QUERIES = 12, VALUE_QUERIES = 3 };
static inline vec splat(float x) { return (vec){x, x, x, x, x, x, x, x}; }
#endif
enum { VALUE_DIMS = 32, VALUE_VECS = VALUE_DIMS / KEYS }; /* values are added up VALUE_DIMS dims at a time */

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }

/* scores[v][0 : KEYS tiles) = scale * queries[v] . keys_t[:, tile]: COUNT (a constant at the fast call) vectors. */
static inline __attribute__((always_inline)) void block_scores(const float *queries, const int count, const int dim,
                                                               const float *keys_t, int64_t pad, int64_t tiles,
                                                               float scale, float *scores) {
    for (int64_t tile = 0; tile < tiles; tile++) {
        vec acc[QUERIES];
#pragma GCC unroll 24
        for (int v = 0; v < count; v++) acc[v] = splat(0.0f);
        for (int d = 0; d < dim; d++) {
            const vec keys = load(keys_t + d * pad + tile * KEYS);
#pragma GCC unroll 24 /* the accumulators stay in registers only when unrolled whole */
            for (int v = 0; v < count; v++) acc[v] += splat(queries[v * dim + d]) * keys;
        }
#pragma GCC unroll 24
        for (int v = 0; v < count; v++) store(scores + v * pad + tile * KEYS, acc[v] * splat(scale));
    }
}

/* out[v][d0 : d0 + VALUE_DIMS) = sum over the span's keys of probs[v][t] * value(t), for COUNT vectors. */
static inline __attribute__((always_inline)) void block_values(const float *probs, int64_t pad, const int count,
                                                               const float *v_pool, const int64_t *tokens, int64_t span,
                                                               int64_t token_stride, int64_t d0, float *const *outs) {
    vec acc[VALUE_QUERIES][VALUE_VECS];
#pragma GCC unroll 12
    for (int v = 0; v < count; v++)
        for (int c = 0; c < VALUE_VECS; c++) acc[v][c] = splat(0.0f);
    for (int64_t t = 0; t < span; t++) {
        const float *value = v_pool + tokens[t] * token_stride + d0;
        vec values[VALUE_VECS];
        for (int c = 0; c < VALUE_VECS; c++) values[c] = load(value + KEYS * c);
#pragma GCC unroll 12
        for (int v = 0; v < count; v++) {
            const vec p = splat(probs[v * pad + t]);
            for (int c = 0; c < VALUE_VECS; c++) acc[v][c] += p * values[c];
        }
    }
#pragma GCC unroll 12
    for (int v = 0; v < count; v++)
        for (int c = 0; c < VALUE_VECS; c++) store(outs[v] + d0 + KEYS * c, acc[v][c]);
}

/* The same for dims [d0, dim) past the last whole VALUE_DIMS (a head_dim not a multiple of it), one by one. */
static void tail_values(const float *probs, int64_t pad, int count, const float *v_pool, const int64_t *tokens,
                        int64_t span, int64_t token_stride, int64_t d0, int64_t dim, float *const *outs) {
    for (int v = 0; v < count; v++)
        for (int64_t d = d0; d < dim; d++) {
            float acc = 0.0f;
            for (int64_t t = 0; t < span; t++) /* fmaf: one fused chain as in the vector path, on every build */
                acc = fmaf(probs[v * pad + t], v_pool[tokens[t] * token_stride + d], acc);
            outs[v][d] = acc;
        }
}

typedef struct {
    const float *q, *v_pool, *sinks;
    float *out;
    const int64_t *tokens; /* pool slot of each position from `first` */
    int64_t q_row_stride, out_row_stride, prefix, length, heads, kv_heads, head_dim, first, pad, window;
    float scale, softcap;
} Chunk;

/* One block: query vectors [v0, v0 + count) of kv head `kv_head` (vector v = row * group + query head in the
 * group), with scratch for their queries [QUERIES, head_dim] and scores [QUERIES, pad]. */
static void attend_block(const Chunk *c, const float *keys_t, int64_t kv_head, int64_t v0, int count, float *queries,
                         float *scores) {
    const int64_t group = c->heads / c->kv_heads, dim = c->head_dim;
    const int64_t last_row = (v0 + count - 1) / group, first_row = v0 / group;
    const int64_t lo = c->window > 0 && c->prefix + first_row + 1 > c->window ? c->prefix + first_row + 1 - c->window : 0;
    const int64_t start = lo - c->first, span = c->prefix + last_row + 1 - lo; /* the block's keys, from `start` */
    for (int v = 0; v < count; v++) {
        const int64_t row = (v0 + v) / group, head = kv_head * group + (v0 + v) % group;
        memcpy(queries + v * dim, c->q + row * c->q_row_stride + head * dim, sizeof(float) * dim);
    }
    /* keys_t starts at a multiple of KEYS positions before `start`: score tiles read from there */
    const int64_t skew = start % KEYS, tile0 = start - skew;
    const float *keys = keys_t + tile0;
    const int64_t all_tiles = (skew + span + KEYS - 1) / KEYS;
    if (count == QUERIES && dim == 64)
        block_scores(queries, QUERIES, 64, keys, c->pad, all_tiles, c->scale, scores);
    else if (count == QUERIES && dim == 128)
        block_scores(queries, QUERIES, 128, keys, c->pad, all_tiles, c->scale, scores);
    else
        block_scores(queries, count, (int)dim, keys, c->pad, all_tiles, c->scale, scores);
    float *outs[QUERIES];
    for (int v = 0; v < count; v++) {
        const int64_t row = (v0 + v) / group, head = kv_head * group + (v0 + v) % group;
        const int64_t position = c->prefix + row;
        const int64_t from = c->window > 0 && position + 1 > c->window ? position + 1 - c->window : 0;
        float *probs = scores + v * c->pad + skew; /* this block's span from `lo` */
        const int64_t own = from - lo, len = position + 1 - from;
        softmax(probs + own, len, c->softcap, c->sinks ? c->sinks[head] : -INFINITY);
        for (int64_t t = 0; t < own; t++) probs[t] = 0.0f;
        for (int64_t t = own + len; t < span; t++) probs[t] = 0.0f;
        outs[v] = c->out + row * c->out_row_stride + head * dim;
    }
    const int64_t *tokens = c->tokens + start;
    const float *v_pool = c->v_pool + kv_head * dim;
    const int64_t token_stride = c->kv_heads * dim;
    int64_t d0 = 0;
    for (; d0 + VALUE_DIMS <= dim; d0 += VALUE_DIMS)
        for (int v = 0; v < count; v += VALUE_QUERIES) {
            const float *probs = scores + v * c->pad + skew;
            if (count - v >= VALUE_QUERIES)
                block_values(probs, c->pad, VALUE_QUERIES, v_pool, tokens, span, token_stride, d0, outs + v);
            else
                block_values(probs, c->pad, count - v, v_pool, tokens, span, token_stride, d0, outs + v);
        }
    if (d0 < dim) tail_values(scores + skew, c->pad, count, v_pool, tokens, span, token_stride, d0, dim, outs);
}

/* Returns 0, or -1 when scratch memory could not be allocated (out is then incomplete). */
int paged_prefill_attention(const float *q, int64_t q_row_stride, const float *k_pool, const float *v_pool,
                            const int64_t *pages, int64_t prefix, int64_t length, float *out, int64_t out_row_stride,
                            int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t page_size, float scale,
                            int64_t window, float softcap, const float *sinks) {
    const int64_t first = window > 0 && prefix + 1 > window ? prefix + 1 - window : 0; /* the first row's first key */
    const int64_t first_tile = first - first % KEYS, positions = prefix + length - first_tile;
    const int64_t pad = (positions + KEYS - 1) / KEYS * KEYS, token_stride = kv_heads * head_dim;
    int64_t *tokens = malloc(sizeof(int64_t) * pad);
    float *keys_t = malloc(sizeof(float) * kv_heads * head_dim * pad); /* [kv head][dim][position] */
    if (tokens == NULL || keys_t == NULL) {
        free(tokens);
        free(keys_t);
        return -1;
    }
    for (int64_t t = 0; t < positions; t++) {
        const int64_t position = first_tile + t;
        tokens[t] = pages[position / page_size] * page_size + position % page_size;
    }
    /* a tile of KEYS positions at a time: each row of keys_t gets KEYS adjacent floats from keys in L1 */
#pragma omp parallel for schedule(static) if (positions * token_stride >= PARALLEL_MIN_FLOATS)
    for (int64_t tile = 0; tile < pad / KEYS; tile++) {
        const int64_t t0 = tile * KEYS, count = positions - t0 < KEYS ? positions - t0 : KEYS;
        const float *keys[KEYS];
        for (int64_t t = 0; t < count; t++) keys[t] = k_pool + tokens[t0 + t] * token_stride;
        for (int64_t i = 0; i < token_stride; i++) {
            float *row = keys_t + i * pad + t0;
            for (int64_t t = 0; t < count; t++) row[t] = keys[t][i];
        }
    }
    const Chunk chunk = {q, v_pool, sinks, out, tokens, q_row_stride, out_row_stride, prefix, length, heads, kv_heads,
                         head_dim, first_tile, pad, window, scale, softcap};
    const int64_t vectors = length * (heads / kv_heads), blocks = (vectors + QUERIES - 1) / QUERIES;
    int failed = 0;
#pragma omp parallel if (vectors * positions >= PARALLEL_MIN_FLOATS)
    {
        float *queries = malloc(sizeof(float) * QUERIES * head_dim);
        float *scores = malloc(sizeof(float) * QUERIES * pad);
        if (queries == NULL || scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        /* later blocks see more keys (causal): dynamic, so both threads finish together */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < kv_heads * blocks; item++) {
            if (queries == NULL || scores == NULL) continue;
            const int64_t kv_head = item % kv_heads, v0 = item / kv_heads * QUERIES;
            const int count = vectors - v0 < QUERIES ? (int)(vectors - v0) : QUERIES;
            attend_block(&chunk, keys_t + kv_head * head_dim * pad, kv_head, v0, count, queries, scores);
        }
        free(queries);
        free(scores);
    }
    free(tokens);
    free(keys_t);
    return failed ? -1 : 0;
}
