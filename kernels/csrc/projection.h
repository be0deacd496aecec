/* A linear layer on panel weights (csrc/panel_linear.c), as the fused kernels call it: packed panels, an int8
 * scale per output column (NULL: fp32 panels) and a bias (NULL: none). */
#ifndef BATCHSERVE_PROJECTION_H
#define BATCHSERVE_PROJECTION_H

#include <stdint.h>

void f32_linear(const float *x, int64_t m, int64_t x_stride, const float *packed, const float *bias, int64_t n,
                int64_t k_dim, float *y);
void int8_linear(const float *x, int64_t m, int64_t x_stride, const int8_t *packed, const float *scale,
                 const float *bias, int64_t n, int64_t k_dim, float *y);

typedef struct {
    const void *packed;
    const float *scale;
    const float *bias;
} Projection;

/* y [rows, out_features] = x [rows, in] (row stride x_stride) through p */
static inline void project(const Projection *p, const float *x, int64_t rows, int64_t x_stride, int64_t in,
                           int64_t out_features, float *y) {
    if (p->scale != NULL)
        int8_linear(x, rows, x_stride, (const int8_t *)p->packed, p->scale, p->bias, out_features, in, y);
    else
        f32_linear(x, rows, x_stride, (const float *)p->packed, p->bias, out_features, in, y);
}

#endif
