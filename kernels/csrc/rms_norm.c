/* RMSNorm in fp32 as transformers' LlamaRMSNorm computes it, in one pass per row over strided rows
 * (the sum of squares runs in its own order: a few ulp from torch's). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec8.h"

/* out[r] = weight * (x[r] / sqrt(mean(x[r]^2) + eps)), like transformers' LlamaRMSNorm in fp32. */
void rms_norm(const float *restrict x, int64_t rows, int64_t x_stride, const float *restrict weight, int64_t dim,
              float eps, float *restrict out) {
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * dim;
        vec8 squares = splat8(0.0f);
        int64_t d = 0;
        for (; d + 8 <= dim; d += 8) {
            const vec8 v = load8(xr + d);
            squares += v * v;
        }
        float total = sum8(squares);
        for (; d < dim; d++) total += xr[d] * xr[d];
        const float inv_rms = 1.0f / sqrtf(total / (float)dim + eps);
        for (d = 0; d < dim; d++) o[d] = weight[d] * (xr[d] * inv_rms);
    }
}
