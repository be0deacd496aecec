/* Every decoder layer of a step in one call: the same kernels, in the same order, on the
 * same data as the model's Python loop (procs/worker/models/llama.py), so the tokens are identical;
 * what goes away is the Python around a dozen small calls per layer, a large share of a small step.
 * Llama-family layers with panel weights (fp32 or int8) or GGUF blocks: qkv bias, q/k norms per head or over the whole
 * projection, clipped q/k/v, and a dense MLP or a mixture of experts (csrc/moe.c); LoRA adapters' pairs added
 * to a projection's rows as procs/worker/lora/slots.py adds them (the same kernels, the same order). */
#include <stddef.h>
#include <stdint.h>

#include "moe.h"

void add_rms_norm(float *x, const float *residual, int64_t rows, int64_t dim, const float *weight, float eps,
                  float *out);
void rms_norm_groups(const float *x, int64_t rows, int64_t x_stride, int64_t groups, int64_t dim, const float *weight,
                     float eps, float *out, int64_t out_stride);
void rotary(const float *x, int64_t rows, int64_t x_stride, int64_t heads, int64_t head_dim, const float *cos,
            const float *sin, float *out);
void write_kv(float *k_pool, float *v_pool, int64_t token_floats, const int64_t *locs, int64_t tokens, const float *k,
              int64_t k_stride, const float *v, int64_t v_stride);
int paged_prefill_attention(const float *q, int64_t q_row_stride, const float *k_pool, const float *v_pool,
                            const int64_t *pages, int64_t prefix, int64_t length, float *out, int64_t out_row_stride,
                            int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t page_size, float scale,
                            int64_t window, float softcap, const float *sinks);
int paged_decode_attention(const float *q, int64_t q_row_stride, const float *k_pool, const float *v_pool,
                           const int64_t *pages, int64_t max_pages, const int64_t *lens, float *out, int64_t batch,
                           int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t page_size, float scale,
                           int64_t window, float softcap, const float *sinks);
void silu_and_mul(const float *gate_up, int64_t rows, int64_t stride, int64_t half, float *out);

/* A projection's LoRA pairs (procs/worker/lora/slots.py's LoraTarget): every adapter's A stacked [width, in] and B
 * [out, width] as fp32 panels, width = parts x the adapters' summed ranks; a.packed NULL: none. */
typedef struct {
    Projection a, b;
    int64_t width;
} LoraPair;

/* One layer's weights and KV pool (layouts as kernels/panel_linear.py and kernels/kv_cache.py). */
typedef struct {
    Projection qkv, o, gate_up, down; /* gate_up and down: the dense MLP, unused with `moe` */
    LoraPair lora_qkv, lora_o, lora_gate_up, lora_down;
    const MoeBlock *moe;              /* NULL: a dense MLP */
    const float *q_norm, *k_norm;     /* NULL: none; per head [head_dim], or [q_size] / [kv_size] (whole_qk_norm) */
    const float *post_norm;           /* post_attention_layernorm */
    const float *next_norm;           /* the next layer's input_layernorm, or the final norm after the last layer */
    float *k_pool, *v_pool;
    int64_t window; /* a sliding-window layer attends to its last `window` tokens; 0: all */
} DecodeLayer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, page_size, max_pages, whole_qk_norm;
    float eps, scale, clip_qkv; /* clip_qkv 0: none */
    /* The step's LoRA rows (NULL mask: none): each row's mask [rows, lora_total] is 1 on its adapter's stacked
     * columns; scratch lora_h [rows, the widest pair's width] and lora_out [rows, the widest output]. */
    const float *lora_mask;
    int64_t lora_total;
    float *lora_h, *lora_out;
    /* The step's prefill chunks, (first row, rows) by first row: a chunk's pages lie in order from its first
     * row's on (pages + first row * max_pages), and lens[row] - 1 is each row's position. The rows between
     * chunks are decode rows. */
    const int64_t *chunks;
    int64_t num_chunks;
} DecodeShape;

/* y [rows, out_features] += (x A^T * mask) B^T: each row's own adapter's term (procs/worker/lora/slots.py, add_to). */
static void add_lora(const LoraPair *l, const DecodeShape *s, const float *x, int64_t rows, int64_t x_stride,
                     int64_t in, int64_t out_features, float *y) {
    if (l->a.packed == NULL || s->lora_mask == NULL) return;
    const int64_t width = l->width, total = s->lora_total;
    project(&l->a, x, rows, x_stride, in, width, s->lora_h);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < width; j++) s->lora_h[r * width + j] *= s->lora_mask[r * total + j % total];
    project(&l->b, s->lora_h, rows, width, width, out_features, s->lora_out);
    for (int64_t i = 0; i < rows * out_features; i++) y[i] += s->lora_out[i];
}

static void clip(float *x, int64_t rows, int64_t stride, int64_t width, float limit) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < width; i++) {
            float *v = x + r * stride + i;
            *v = *v < -limit ? -limit : *v > limit ? limit : *v;
        }
}

/* q | k of qkv, normed (into `normed` [rows, q_size + kv_size]) and clipped as the layer asks, rotated into
 * rot; v clipped in place. */
static void rotated_qk(const DecodeLayer *layer, const DecodeShape *s, int64_t rows, float *qkv, const float *cos,
                       const float *sin, float *normed, float *rot) {
    const int64_t q_size = s->heads * s->head_dim, kv_size = s->kv_heads * s->head_dim;
    const int64_t qkv_width = q_size + 2 * kv_size, rot_width = q_size + kv_size;
    const float *qk = qkv;
    int64_t qk_stride = qkv_width;
    if (layer->q_norm != NULL) {
        const int64_t dim = s->whole_qk_norm ? 0 : s->head_dim;
        rms_norm_groups(qkv, rows, qkv_width, dim ? s->heads : 1, dim ? dim : q_size, layer->q_norm, s->eps, normed,
                        rot_width);
        rms_norm_groups(qkv + q_size, rows, qkv_width, dim ? s->kv_heads : 1, dim ? dim : kv_size, layer->k_norm,
                        s->eps, normed + q_size, rot_width);
        qk = normed;
        qk_stride = rot_width;
    }
    if (s->clip_qkv > 0) {
        clip((float *)qk, rows, qk_stride, rot_width, s->clip_qkv);
        clip(qkv + rot_width, rows, qkv_width, kv_size, s->clip_qkv);
    }
    rotary(qk, rows, qk_stride, s->heads + s->kv_heads, s->head_dim, cos, sin, rot); /* q and k heads */
}

/* Every row's attention into attn [rows, heads head_dim]: runs of decode rows one query each, chunks
 * blocked (csrc/paged_prefill_attention.c), both from the pool the layer just wrote. */
static int attend(const DecodeLayer *layer, const DecodeShape *s, int64_t rows, const float *rot, const int64_t *pages,
                  const int64_t *lens, float *attn) {
    const int64_t q_size = s->heads * s->head_dim, rot_width = q_size + s->kv_heads * s->head_dim;
    int64_t row = 0;
    for (int64_t c = 0; c <= s->num_chunks; c++) {
        const int64_t end = c < s->num_chunks ? s->chunks[2 * c] : rows;
        if (end > row && paged_decode_attention(rot + row * rot_width, rot_width, layer->k_pool, layer->v_pool,
                                                pages + row * s->max_pages, s->max_pages, lens + row,
                                                attn + row * q_size, end - row, s->heads, s->kv_heads, s->head_dim,
                                                s->page_size, s->scale, layer->window, 0.0f, NULL) != 0)
            return -1;
        if (c == s->num_chunks) break;
        const int64_t length = s->chunks[2 * c + 1];
        if (paged_prefill_attention(rot + end * rot_width, rot_width, layer->k_pool, layer->v_pool,
                                    pages + end * s->max_pages, lens[end] - 1, length, attn + end * q_size, q_size,
                                    s->heads, s->kv_heads, s->head_dim, s->page_size, s->scale, layer->window, 0.0f,
                                    NULL) != 0)
            return -1;
        row = end + length;
    }
    return 0;
}

/* h [rows, hidden]: the first layer's normed input; residual [rows, hidden]: the residual stream (the
 * embeddings). cos/sin [rows, head_dim]; locs [rows] KV slots; pages [rows, max_pages], lens [rows] (and
 * the chunks in `s`).
 * Scratch: qkv [rows, (heads + 2 kv_heads) head_dim], rot and normed [rows, (heads + kv_heads) head_dim],
 * attn [rows, heads head_dim], tmp [rows, hidden], gate_up [rows, 2 intermediate], act [rows, intermediate].
 * On return h holds the final norm of every row. Returns 0, or -1 if attention, a block-weight projection or an
 * MoE block ran out of memory. */
int decode_layers(const DecodeLayer *layers, int64_t num_layers, const DecodeShape *s, int64_t rows, float *h,
                  float *residual, const float *cos, const float *sin, const int64_t *locs, const int64_t *pages,
                  const int64_t *lens, float *qkv, float *rot, float *normed, float *attn, float *tmp, float *gate_up,
                  float *act) {
    const int64_t q_size = s->heads * s->head_dim, kv_size = s->kv_heads * s->head_dim;
    const int64_t qkv_width = q_size + 2 * kv_size, rot_width = q_size + kv_size;
    for (int64_t l = 0; l < num_layers; l++) {
        const DecodeLayer *layer = &layers[l];
        if (project(&layer->qkv, h, rows, s->hidden, s->hidden, qkv_width, qkv) != 0) return -1;
        add_lora(&layer->lora_qkv, s, h, rows, s->hidden, s->hidden, qkv_width, qkv);
        rotated_qk(layer, s, rows, qkv, cos, sin, normed, rot);
        write_kv(layer->k_pool, layer->v_pool, kv_size, locs, rows, rot + q_size, rot_width, qkv + rot_width,
                 qkv_width);
        if (attend(layer, s, rows, rot, pages, lens, attn) != 0) return -1;
        if (project(&layer->o, attn, rows, q_size, q_size, s->hidden, tmp) != 0) return -1;
        add_lora(&layer->lora_o, s, attn, rows, q_size, q_size, s->hidden, tmp);
        /* tmp += residual, h = norm(tmp); tmp is the residual stream from here (as `x` in ops.add_rms_norm) */
        add_rms_norm(tmp, residual, rows, s->hidden, layer->post_norm, s->eps, h);
        float *swap = residual;
        residual = tmp;
        tmp = swap;
        if (layer->moe != NULL) {
            if (moe_block(layer->moe, h, rows, s->hidden, tmp) != 0) return -1;
        } else {
            if (project(&layer->gate_up, h, rows, s->hidden, s->hidden, 2 * s->intermediate, gate_up) != 0) return -1;
            add_lora(&layer->lora_gate_up, s, h, rows, s->hidden, s->hidden, 2 * s->intermediate, gate_up);
            silu_and_mul(gate_up, rows, 2 * s->intermediate, s->intermediate, act);
            if (project(&layer->down, act, rows, s->intermediate, s->intermediate, s->hidden, tmp) != 0) return -1;
            add_lora(&layer->lora_down, s, act, rows, s->intermediate, s->intermediate, s->hidden, tmp);
        }
        add_rms_norm(tmp, residual, rows, s->hidden, layer->next_norm, s->eps, h);
        swap = residual;
        residual = tmp;
        tmp = swap;
    }
    return 0;
}
