/* Decode attention straight from the paged KV pool, fp32, for the CPU.
 *
 * One query token per batch row attends to the row's first lens[row] cached tokens, found through
 * its page list, without gathering the pages into a padded copy first (the torch backend's way,
 * which moves every key and value twice). (row, kv head) pairs are split over OpenMP threads (rows
 * alone left one thread idle in a one-request step); each pair is computed the same way whichever
 * thread takes it, so the output does not depend on the batch. Linked against the
 * OpenMP runtime torch already loaded, the threads are torch's own.
 *
 * Per row and kv head, the query heads sharing that kv head are one "group": each key and value is
 * loaded once for the whole group. The group size and head_dim are compile-time constants in the
 * common cases (see attend_group), so accumulators live in registers; other shapes take a generic loop.
 *
 * Layouts (all contiguous except q's rows): q [batch, heads, head_dim] with row stride q_row_stride,
 * k_pool/v_pool [num_pages, page_size, kv_heads, head_dim], pages [batch, max_pages] int64,
 * lens [batch] int64 (1 <= lens[row] <= max_pages * page_size), out [batch, heads, head_dim].
 * window > 0: a row attends to its last `window` tokens only (a sliding-window layer); 0: to all.
 * softcap > 0: scaled scores become softcap * tanh(score / softcap) before the softmax (Gemma 2).
 * sinks [heads] or NULL: per query head a logit that joins the softmax's denominator and attends to nothing
 * (gpt-oss's learned attention sinks).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "softmax.h"
#include "vec8.h"

enum { MAX_GROUP = 8 }; /* largest group with a compile-time-specialised path */
/* Tokens ahead whose key (value) rows are prefetched: a row's tokens lie in pages scattered over the
 * pool, which the hardware prefetcher does not follow (loadtests/results/decode_attention_prefetch_cpu.txt). */
enum { PREFETCH_TOKENS = 8 };

/* always_inline: called, it counts as free of side effects and GCC drops the call. */
static inline __attribute__((always_inline)) void prefetch_floats(const float *p, int floats) {
    for (int line = 0; line < floats * (int)sizeof(float); line += 64) __builtin_prefetch((const char *)p + line);
}

/* One row, one kv head, any group size and head_dim: the plain loops. */
static void attend_group_generic(const float *q, const float *k_pool, const float *v_pool, const int64_t *tokens,
                                 int64_t len, int64_t group, int64_t head_dim, int64_t token_stride, float scale,
                                 float softcap, const float *sinks, float *scores, int64_t stride, float *out) {
    for (int64_t t = 0; t < len; t++) {
        const float *k = k_pool + tokens[t] * token_stride;
        for (int64_t g = 0; g < group; g++) {
            float s = 0.0f;
            for (int64_t d = 0; d < head_dim; d++) s += q[g * head_dim + d] * k[d];
            scores[g * stride + t] = s * scale;
        }
    }
    for (int64_t g = 0; g < group; g++) softmax(scores + g * stride, len, softcap, sinks ? sinks[g] : -INFINITY);
    memset(out, 0, sizeof(float) * group * head_dim);
    for (int64_t t = 0; t < len; t++) {
        const float *v = v_pool + tokens[t] * token_stride;
        for (int64_t g = 0; g < group; g++) {
            const float p = scores[g * stride + t];
            for (int64_t d = 0; d < head_dim; d++) out[g * head_dim + d] += p * v[d];
        }
    }
}

/* The same with GROUP and DIM (a multiple of 16) known at compile time: callers pass constants and
 * inlining specialises it. Scores keep two partial sums per head for more independent FMAs; values
 * accumulate a block of CHUNKS vectors per head over all tokens in registers. */
static inline __attribute__((always_inline)) void attend_group_fixed(
    const float *q, const float *k_pool, const float *v_pool, const int64_t *tokens, int64_t len, const int GROUP,
    const int DIM, int64_t token_stride, float scale, float softcap, const float *sinks, float *scores, int64_t stride,
    float *out) {
    for (int64_t t = 0; t < len; t++) {
        const float *k = k_pool + tokens[t] * token_stride;
        if (t + PREFETCH_TOKENS < len) prefetch_floats(k_pool + tokens[t + PREFETCH_TOKENS] * token_stride, DIM);
        for (int g = 0; g < GROUP; g++) {
            vec8 even = splat8(0.0f), odd = splat8(0.0f);
            for (int d = 0; d < DIM; d += 16) {
                even += load8(q + g * DIM + d) * load8(k + d);
                odd += load8(q + g * DIM + d + 8) * load8(k + d + 8);
            }
            scores[g * stride + t] = sum8(even + odd) * scale;
        }
    }
    for (int g = 0; g < GROUP; g++) softmax(scores + g * stride, len, softcap, sinks ? sinks[g] : -INFINITY);
    enum { REGISTERS = 12 };
    const int CHUNKS = GROUP * 4 <= REGISTERS ? 4 : GROUP * 2 <= REGISTERS ? 2 : 1;
    for (int d0 = 0; d0 < DIM; d0 += 8 * CHUNKS) {
        vec8 acc[MAX_GROUP][4]; /* fixed bounds so the compiler can keep the used part in registers */
        for (int g = 0; g < GROUP; g++)
            for (int c = 0; c < CHUNKS; c++) acc[g][c] = splat8(0.0f);
        for (int64_t t = 0; t < len; t++) {
            const float *v = v_pool + tokens[t] * token_stride + d0;
            if (t + PREFETCH_TOKENS < len) prefetch_floats(v_pool + tokens[t + PREFETCH_TOKENS] * token_stride + d0, 8 * CHUNKS);
            vec8 vt[4];
            for (int c = 0; c < CHUNKS; c++) vt[c] = load8(v + 8 * c);
            for (int g = 0; g < GROUP; g++) {
                const vec8 p = splat8(scores[g * stride + t]);
                for (int c = 0; c < CHUNKS; c++) acc[g][c] += p * vt[c];
            }
        }
        for (int g = 0; g < GROUP; g++)
            for (int c = 0; c < CHUNKS; c++) store8(out + g * DIM + d0 + 8 * c, acc[g][c]);
    }
}

#define FIXED_CASE(G, D)                                                                                        \
    case G:                                                                                                     \
        attend_group_fixed(q, k_pool, v_pool, tokens, len, G, D, token_stride, scale, softcap, sinks, scores, stride, out); \
        return

static void attend_group(const float *q, const float *k_pool, const float *v_pool, const int64_t *tokens,
                         int64_t len, int64_t group, int64_t head_dim, int64_t token_stride, float scale,
                         float softcap, const float *sinks, float *scores, int64_t stride, float *out) {
    if (head_dim == 64) {
        switch (group) {
            FIXED_CASE(1, 64); FIXED_CASE(2, 64); FIXED_CASE(3, 64); FIXED_CASE(4, 64);
            FIXED_CASE(5, 64); FIXED_CASE(6, 64); FIXED_CASE(7, 64); FIXED_CASE(8, 64);
        }
    } else if (head_dim == 128) {
        switch (group) {
            FIXED_CASE(1, 128); FIXED_CASE(2, 128); FIXED_CASE(3, 128); FIXED_CASE(4, 128);
            FIXED_CASE(5, 128); FIXED_CASE(6, 128); FIXED_CASE(7, 128); FIXED_CASE(8, 128);
        }
    }
    attend_group_generic(q, k_pool, v_pool, tokens, len, group, head_dim, token_stride, scale, softcap, sinks, scores,
                         stride, out);
}

/* Returns 0, or -1 when scratch memory could not be allocated (out is then incomplete). */
int paged_decode_attention(const float *q, int64_t q_row_stride, const float *k_pool, const float *v_pool,
                           const int64_t *pages, int64_t max_pages, const int64_t *lens, float *out, int64_t batch,
                           int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t page_size, float scale,
                           int64_t window, float softcap, const float *sinks) {
    const int64_t group = heads / kv_heads, token_stride = kv_heads * head_dim;
    const int64_t stride = max_pages * page_size; /* longest context */
    int failed = 0;
#pragma omp parallel
    {
        /* per thread: one score row per query head of a group, and the row's token positions in the pool */
        float *scores = malloc(sizeof(float) * group * stride);
        int64_t *tokens = malloc(sizeof(int64_t) * stride);
        if (scores == NULL || tokens == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        int64_t tokens_row = -1; /* the row whose token positions `tokens` holds */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < batch * kv_heads; item++) { /* (row, kv head): a lone row uses both threads */
            if (scores == NULL || tokens == NULL) continue;
            const int64_t row = item / kv_heads, kv_head = item % kv_heads;
            const int64_t first = window > 0 && lens[row] > window ? lens[row] - window : 0, len = lens[row] - first;
            if (row != tokens_row) {
                const int64_t *row_pages = pages + row * max_pages;
                for (int64_t t = 0; t < len; t++) {
                    const int64_t position = first + t;
                    tokens[t] = row_pages[position / page_size] * page_size + position % page_size;
                }
                tokens_row = row;
            }
            const int64_t first_head = kv_head * group;
            attend_group(q + row * q_row_stride + first_head * head_dim, k_pool + kv_head * head_dim,
                         v_pool + kv_head * head_dim, tokens, len, group, head_dim, token_stride, scale, softcap,
                         sinks ? sinks + first_head : NULL, scores, stride, out + (row * heads + first_head) * head_dim);
        }
        free(scores);
        free(tokens);
    }
    return failed ? -1 : 0;
}
