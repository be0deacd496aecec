/* A linear layer as the fused kernels call it: panel weights (csrc/panel_linear.c: fp32, or int8 with a scale
 * per output column) or GGUF blocks (csrc/quant_linear.c), and a bias (NULL: none). */
#ifndef BATCHSERVE_PROJECTION_H
#define BATCHSERVE_PROJECTION_H

#include <stdint.h>

void f32_linear(const float *x, int64_t m, int64_t x_stride, const float *packed, const float *bias, int64_t n,
                int64_t k_dim, float *y);
void int8_linear(const float *x, int64_t m, int64_t x_stride, const int8_t *packed, const float *scale,
                 const float *bias, int64_t n, int64_t k_dim, float *y);
int block_linear_into(const float *x, int64_t m, int64_t x_stride, const uint8_t *w, int64_t type, const float *bias,
                      int64_t n, int64_t k, float *y, int64_t y_stride);

typedef struct Projection {
    const void *packed;
    const float *scale; /* int8 panels' scales; NULL: fp32 panels or blocks */
    const float *bias;
    int64_t block_type; /* 0: panels; else the GGUF block type of `packed`, out_features rows of blocks */
    /* The blocks of the output rows after this part's `rows` (fused projections' next part, where it lies: a
     * GGUF file's k after q, in its own type); NULL: this part runs to out_features. The first part's bias
     * covers them all. */
    const struct Projection *next;
    int64_t rows;
} Projection;

/* y [rows, out_features] = x [rows, in] (row stride x_stride) through p, part by part. Returns 0, or -1 where
 * the blocks' activation scratch could not be allocated. */
static inline int project_blocks(const Projection *p, const float *x, int64_t rows, int64_t x_stride, int64_t in,
                                 int64_t out_features, float *y) {
    int64_t first = 0;
    for (const Projection *part = p; part != NULL; part = part->next) {
        const int64_t n = part->next != NULL ? part->rows : out_features - first;
        if (block_linear_into(x, rows, x_stride, (const uint8_t *)part->packed, part->block_type,
                              p->bias != NULL ? p->bias + first : NULL, n, in, y + first, out_features) != 0)
            return -1;
        first += n;
    }
    return 0;
}

/* y [rows, out_features] = x [rows, in] (row stride x_stride) through p; 0, or -1 (see project_blocks) */
static inline int project(const Projection *p, const float *x, int64_t rows, int64_t x_stride, int64_t in,
                          int64_t out_features, float *y) {
    if (p->block_type != 0)
        return project_blocks(p, x, rows, x_stride, in, out_features, y);
    if (p->scale != NULL)
        int8_linear(x, rows, x_stride, (const int8_t *)p->packed, p->scale, p->bias, out_features, in, y);
    else
        f32_linear(x, rows, x_stride, (const float *)p->packed, p->bias, out_features, in, y);
    return 0;
}

#endif
