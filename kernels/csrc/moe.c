/* A mixture-of-experts block in one call: the router, softmax over the experts and top-k (renormalised or
 * not), the chosen experts' gated MLPs on the tokens grouped by expert (each expert's rows as one panel
 * matmul, so a step reads only the experts its tokens chose), the weighted sum per token, and a shared
 * expert with its sigmoid gate (Qwen2-MoE). The same call serves the model's per-layer Python loop and the
 * fused decode layers (csrc/decode_layers.c), so both give the same tokens.
 *
 * Each token's output adds its experts' contributions in top-k order, whatever else shares its step: a
 * request's output does not depend on the batch it runs in. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moe.h"
#include "vec8.h"

void silu_and_mul(const float *gate_up, int64_t rows, int64_t stride, int64_t half, float *out);

static Projection expert(const StackedProjection *s, int64_t e) {
    Projection p = {(const char *)s->packed + e * s->packed_stride, s->scale ? s->scale + e * s->scale_stride : NULL,
                    s->bias ? s->bias + e * s->bias_stride : NULL, 0, NULL, 0};
    return p;
}

/* softmax over one row's router logits (as torch: exp(l - max) / sum), then the top_k largest in order
 * (ties: the lower expert), renormalised to sum 1 when asked. `probs` is scratch [num_experts]. */
static void route_row(const float *logits, int64_t num_experts, int64_t top_k, int64_t renormalize, float *probs,
                      int64_t *ids, float *weights) {
    float max = logits[0];
    for (int64_t e = 1; e < num_experts; e++) max = logits[e] > max ? logits[e] : max;
    float total = 0.0f;
    for (int64_t e = 0; e < num_experts; e++) total += probs[e] = expf(logits[e] - max);
    for (int64_t e = 0; e < num_experts; e++) probs[e] /= total;
    float chosen = 0.0f;
    for (int64_t j = 0; j < top_k; j++) {
        int64_t best = 0;
        for (int64_t e = 1; e < num_experts; e++) best = probs[e] > probs[best] ? e : best;
        ids[j] = best;
        chosen += weights[j] = probs[best];
        probs[best] = -1.0f; /* taken: below every probability */
    }
    if (renormalize)
        for (int64_t j = 0; j < top_k; j++) weights[j] /= chosen;
}

/* out += sigmoid(gate(x)) * shared_mlp(x) */
static int add_shared_expert(const MoeBlock *m, const float *x, int64_t rows, int64_t x_stride, float *out) {
    const int64_t hidden = m->hidden, inter = m->shared_intermediate;
    float *gate_up = malloc(sizeof(float) * rows * 2 * inter), *act = malloc(sizeof(float) * rows * inter);
    float *y = malloc(sizeof(float) * rows * hidden), *gate = malloc(sizeof(float) * rows);
    const int ok = gate_up && act && y && gate;
    if (ok) {
        project(&m->shared_gate_up, x, rows, x_stride, hidden, 2 * inter, gate_up);
        silu_and_mul(gate_up, rows, 2 * inter, inter, act);
        project(&m->shared_down, act, rows, inter, inter, hidden, y);
        project(&m->shared_gate, x, rows, x_stride, hidden, 1, gate);
        for (int64_t r = 0; r < rows; r++) {
            const float g = 1.0f / (1.0f + expf(-gate[r]));
            for (int64_t d = 0; d < hidden; d++) out[r * hidden + d] += g * y[r * hidden + d];
        }
    }
    free(gate_up);
    free(act);
    free(y);
    free(gate);
    return ok ? 0 : -1;
}

typedef struct {
    float *logits, *probs, *weights, *xs, *gate_up, *act, *ys;
    int64_t *ids, *order, *slot, *starts, *cursor;
} Scratch;

static void free_scratch(Scratch *s) {
    free(s->logits), free(s->probs), free(s->weights), free(s->xs), free(s->gate_up), free(s->act), free(s->ys);
    free(s->ids), free(s->order), free(s->slot), free(s->starts), free(s->cursor);
}

static int alloc_scratch(const MoeBlock *m, int64_t rows, Scratch *s) {
    const int64_t pairs = rows * m->top_k;
    s->logits = malloc(sizeof(float) * rows * m->num_experts);
    s->probs = malloc(sizeof(float) * m->num_experts);
    s->weights = malloc(sizeof(float) * pairs);
    s->xs = malloc(sizeof(float) * pairs * m->hidden);
    s->gate_up = malloc(sizeof(float) * pairs * 2 * m->intermediate);
    s->act = malloc(sizeof(float) * pairs * m->intermediate);
    s->ys = malloc(sizeof(float) * pairs * m->hidden);
    s->ids = malloc(sizeof(int64_t) * pairs);
    s->order = malloc(sizeof(int64_t) * pairs);
    s->slot = malloc(sizeof(int64_t) * pairs);
    s->starts = calloc((size_t)m->count + 1, sizeof(int64_t));
    s->cursor = malloc(sizeof(int64_t) * (m->count + 1));
    return s->logits && s->probs && s->weights && s->xs && s->gate_up && s->act && s->ys && s->ids && s->order &&
           s->slot && s->starts && s->cursor ? 0 : -1;
}

/* Group the (token, choice) pairs by this rank's expert: order[starts[e] ..] lists expert e's pairs in
 * token order, slot[p] is pair p's place in that list (-1: another rank's expert). */
static void group_by_expert(const MoeBlock *m, int64_t pairs, Scratch *s) {
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t e = s->ids[p] - m->first;
        if (e >= 0 && e < m->count) s->starts[e + 1]++;
    }
    for (int64_t e = 0; e < m->count; e++) s->starts[e + 1] += s->starts[e];
    for (int64_t e = 0; e < m->count; e++) s->cursor[e] = s->starts[e];
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t e = s->ids[p] - m->first;
        s->slot[p] = e >= 0 && e < m->count ? s->cursor[e]++ : -1;
        if (s->slot[p] >= 0) s->order[s->slot[p]] = p;
    }
}

/* x [rows, hidden] (row stride x_stride) -> out [rows, hidden] (contiguous): this rank's share of the
 * block's output (the ranks' shares add up to it). Returns 0, or -1 if its scratch memory ran out. */
int moe_block(const MoeBlock *m, const float *x, int64_t rows, int64_t x_stride, float *out) {
    const int64_t k = m->top_k, hidden = m->hidden, inter = m->intermediate, pairs = rows * k;
    Scratch s;
    if (alloc_scratch(m, rows, &s) != 0) {
        free_scratch(&s);
        return -1;
    }
    project(&m->router, x, rows, x_stride, hidden, m->num_experts, s.logits);
    for (int64_t r = 0; r < rows; r++)
        route_row(s.logits + r * m->num_experts, m->num_experts, k, m->renormalize, s.probs, s.ids + r * k,
                  s.weights + r * k);
    if (m->load)
        for (int64_t p = 0; p < pairs; p++) m->load[s.ids[p]]++;
    group_by_expert(m, pairs, &s);
    for (int64_t q = 0; q < s.starts[m->count]; q++)
        memcpy(s.xs + q * hidden, x + (s.order[q] / k) * x_stride, sizeof(float) * hidden);
    for (int64_t e = 0; e < m->count; e++) {
        const int64_t first = s.starts[e], n = s.starts[e + 1] - first;
        if (n == 0) continue;
        const Projection gate_up = expert(&m->gate_up, e), down = expert(&m->down, e);
        project(&gate_up, s.xs + first * hidden, n, hidden, hidden, 2 * inter, s.gate_up + first * 2 * inter);
        silu_and_mul(s.gate_up + first * 2 * inter, n, 2 * inter, inter, s.act + first * inter);
        project(&down, s.act + first * inter, n, inter, inter, hidden, s.ys + first * hidden);
    }
#pragma omp parallel for schedule(static) if (rows * hidden >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        float *o = out + r * hidden;
        memset(o, 0, sizeof(float) * hidden);
        for (int64_t j = 0; j < k; j++) {
            const int64_t q = s.slot[r * k + j];
            if (q < 0) continue;
            const float w = s.weights[r * k + j], *y = s.ys + q * hidden;
            for (int64_t d = 0; d < hidden; d++) o[d] += w * y[d];
        }
    }
    free_scratch(&s);
    return m->shared_gate_up.packed ? add_shared_expert(m, x, rows, x_stride, out) : 0;
}
