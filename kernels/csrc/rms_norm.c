/* RMSNorm in fp32 as transformers' LlamaRMSNorm computes it, in one pass per row over strided rows
 * (the sum of squares runs in its own order: a few ulp from torch's). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec8.h"

/* out = weight * (x / sqrt(mean(x^2) + eps)) for one row, like transformers' LlamaRMSNorm in fp32. */
static inline void norm_row(const float *restrict x, const float *restrict weight, int64_t dim, float eps,
                            float *restrict out) {
    vec8 squares = splat8(0.0f);
    int64_t d = 0;
    for (; d + 8 <= dim; d += 8) {
        const vec8 v = load8(x + d);
        squares += v * v;
    }
    float total = sum8(squares);
    for (; d < dim; d++) total += x[d] * x[d];
    const float inv_rms = 1.0f / sqrtf(total / (float)dim + eps);
    for (d = 0; d < dim; d++) out[d] = weight[d] * (x[d] * inv_rms);
}


/* The residual stream's step: x += residual (in place, rows of x contiguous [rows, dim]), then
 * out = RMSNorm(x). One pass instead of an add and a norm. */
void add_rms_norm(float *restrict x, const float *restrict residual, int64_t rows, int64_t dim,
                  const float *restrict weight, float eps, float *restrict out) {
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * dim;
        const float *res = residual + r * dim;
        for (int64_t d = 0; d < dim; d++) xr[d] += res[d];
        norm_row(xr, weight, dim, eps, out + r * dim);
    }
}

/* out [rows, groups * dim] (row stride out_stride) = RMSNorm of each run of `dim` floats of each row of x
 * (row stride x_stride), all runs by one weight [dim]: q/k norms per head (groups = heads, Qwen3) or over a
 * whole projection (groups = 1, OLMoE). */
void rms_norm_groups(const float *restrict x, int64_t rows, int64_t x_stride, int64_t groups, int64_t dim,
                     const float *restrict weight, float eps, float *restrict out, int64_t out_stride) {
#pragma omp parallel for schedule(static) if (rows * groups * dim >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++)
            norm_row(x + r * x_stride + g * dim, weight, dim, eps, out + r * out_stride + g * dim);
}

/* out [rows, dim] = RMSNorm of each (possibly strided) row of x. */
void rms_norm(const float *restrict x, int64_t rows, int64_t x_stride, const float *restrict weight, int64_t dim,
              float eps, float *restrict out) {
    rms_norm_groups(x, rows, x_stride, 1, dim, weight, eps, out, dim);
}
