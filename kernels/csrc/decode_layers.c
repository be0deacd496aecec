/* Every decoder layer of a decode-only step in one call: the same kernels, in the same order, on the
 * same data as the model's Python loop (procs/worker/models/llama.py), so the tokens are identical;
 * what goes away is the Python around a dozen small calls per layer, a large share of a small step.
 * Llama and Qwen2 layers (qkv bias) with panel weights (fp32 or int8). */
#include <stddef.h>
#include <stdint.h>

void f32_linear(const float *x, int64_t m, int64_t x_stride, const float *packed, const float *bias, int64_t n,
                int64_t k_dim, float *y);
void int8_linear(const float *x, int64_t m, int64_t x_stride, const int8_t *packed, const float *scale,
                 const float *bias, int64_t n, int64_t k_dim, float *y);
void add_rms_norm(float *x, const float *residual, int64_t rows, int64_t dim, const float *weight, float eps,
                  float *out);
void rotary(const float *x, int64_t rows, int64_t x_stride, int64_t heads, int64_t head_dim, const float *cos,
            const float *sin, float *out);
void write_kv(float *k_pool, float *v_pool, int64_t token_floats, const int64_t *locs, int64_t tokens, const float *k,
              int64_t k_stride, const float *v, int64_t v_stride);
int paged_decode_attention(const float *q, int64_t q_row_stride, const float *k_pool, const float *v_pool,
                           const int64_t *pages, int64_t max_pages, const int64_t *lens, float *out, int64_t batch,
                           int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t page_size, float scale);
void silu_and_mul(const float *gate_up, int64_t rows, int64_t stride, int64_t half, float *out);

/* One projection: packed panels, int8 scale (NULL: fp32 panels), bias (NULL: none). */
typedef struct {
    const void *packed;
    const float *scale;
    const float *bias;
} Projection;

/* One layer's weights and KV pool (layouts as kernels/panel_linear.py and kernels/kv_cache.py). */
typedef struct {
    Projection qkv, o, gate_up, down;
    const float *post_norm; /* post_attention_layernorm */
    const float *next_norm; /* the next layer's input_layernorm, or the final norm after the last layer */
    float *k_pool, *v_pool;
} DecodeLayer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, page_size, max_pages;
    float eps, scale;
} DecodeShape;

static void project(const Projection *p, const float *x, int64_t rows, int64_t in, int64_t out_features, float *y) {
    if (p->scale != NULL)
        int8_linear(x, rows, in, (const int8_t *)p->packed, p->scale, p->bias, out_features, in, y);
    else
        f32_linear(x, rows, in, (const float *)p->packed, p->bias, out_features, in, y);
}

/* h [rows, hidden]: the first layer's normed input; residual [rows, hidden]: the residual stream (the
 * embeddings). cos/sin [rows, head_dim]; locs [rows] KV slots; pages [rows, max_pages], lens [rows].
 * Scratch: qkv [rows, (heads + 2 kv_heads) head_dim], rot [rows, (heads + kv_heads) head_dim],
 * attn [rows, heads head_dim], tmp [rows, hidden], gate_up [rows, 2 intermediate], act [rows, intermediate].
 * On return h holds the final norm of every row. Returns 0, or -1 if attention ran out of memory. */
int decode_layers(const DecodeLayer *layers, int64_t num_layers, const DecodeShape *s, int64_t rows, float *h,
                  float *residual, const float *cos, const float *sin, const int64_t *locs, const int64_t *pages,
                  const int64_t *lens, float *qkv, float *rot, float *attn, float *tmp, float *gate_up, float *act) {
    const int64_t q_size = s->heads * s->head_dim, kv_size = s->kv_heads * s->head_dim;
    const int64_t qkv_width = q_size + 2 * kv_size, rot_width = q_size + kv_size;
    for (int64_t l = 0; l < num_layers; l++) {
        const DecodeLayer *layer = &layers[l];
        project(&layer->qkv, h, rows, s->hidden, qkv_width, qkv);
        rotary(qkv, rows, qkv_width, s->heads + s->kv_heads, s->head_dim, cos, sin, rot); /* q and k heads */
        write_kv(layer->k_pool, layer->v_pool, kv_size, locs, rows, rot + q_size, rot_width, qkv + rot_width,
                 qkv_width);
        if (paged_decode_attention(rot, rot_width, layer->k_pool, layer->v_pool, pages, s->max_pages, lens, attn, rows,
                                   s->heads, s->kv_heads, s->head_dim, s->page_size, s->scale) != 0)
            return -1;
        project(&layer->o, attn, rows, q_size, s->hidden, tmp);
        /* tmp += residual, h = norm(tmp); tmp is the residual stream from here (as `x` in ops.add_rms_norm) */
        add_rms_norm(tmp, residual, rows, s->hidden, layer->post_norm, s->eps, h);
        float *swap = residual;
        residual = tmp;
        tmp = swap;
        project(&layer->gate_up, h, rows, s->hidden, 2 * s->intermediate, gate_up);
        silu_and_mul(gate_up, rows, 2 * s->intermediate, s->intermediate, act);
        project(&layer->down, act, rows, s->intermediate, s->hidden, tmp);
        add_rms_norm(tmp, residual, rows, s->hidden, layer->next_norm, s->eps, h);
        swap = residual;
        residual = tmp;
        tmp = swap;
    }
    return 0;
}
