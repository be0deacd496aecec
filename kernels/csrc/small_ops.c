/* The transformer layer's small fp32 ops in C, each one pass over memory instead of torch's chain of
 * small ops (and their dispatch): RMSNorm, rotary embedding, SiLU-and-mul, and the KV-pool write.
 * Same arithmetic as kernels/ops.py. Rows may be strided; within a row the data is contiguous.
 * Large inputs (prefill) are split over OpenMP threads by row; a decode batch's few rows are not
 * worth the fork. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec8.h"

/* Rotary embedding is bit-identical to torch's x * cos + rotate_half(x) * sin only when each
 * product is rounded before the sum: no fused multiply-add in this file (GCC; clang contracts only
 * within one expression, and the products below are separate statements). */
#pragma GCC optimize("fp-contract=off")

enum { PARALLEL_MIN_FLOATS = 1 << 15 };

/* out[r] = weight * (x[r] / sqrt(mean(x[r]^2) + eps)), like transformers' LlamaRMSNorm in fp32. */
void rms_norm(const float *x, int64_t rows, int64_t x_stride, const float *weight, int64_t dim, float eps, float *out) {
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

/* Rotate-half rotary embedding: out [rows, heads, head_dim] from x (heads and dims contiguous within
 * a row) and the row's cos/sin [rows, head_dim]. */
void rotary(const float *x, int64_t rows, int64_t x_stride, int64_t heads, int64_t head_dim, const float *cos,
            const float *sin, float *out) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (rows * heads * head_dim >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * head_dim, *s = sin + r * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + r * x_stride + h * head_dim;
            float *o = out + (r * heads + h) * head_dim;
            for (int64_t i = 0; i < half; i++) {
                const float first_cos = xh[i] * c[i], first_sin = xh[i + half] * s[i];
                const float second_cos = xh[i + half] * c[i + half], second_sin = xh[i] * s[i + half];
                o[i] = first_cos - first_sin;
                o[i + half] = second_cos + second_sin;
            }
        }
    }
}

/* out [rows, half] = silu(gate) * up for gate_up rows [gate (half) | up (half)]; silu(g) = g / (1 + e^-g). */
void silu_and_mul(const float *gate_up, int64_t rows, int64_t stride, int64_t half, float *out) {
#pragma omp parallel for schedule(static) if (rows * half >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * stride, *up = gate + half;
        float *o = out + r * half;
        int64_t i = 0;
        for (; i + 8 <= half; i += 8) {
            const vec8 g = load8(gate + i);
            store8(o + i, g / (splat8(1.0f) + exp8(-g)) * load8(up + i));
        }
        for (; i < half; i++) o[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

/* k_pool[locs[t]] = k[t] and v_pool[locs[t]] = v[t]: one token's kv heads are token_floats floats. */
void write_kv(float *k_pool, float *v_pool, int64_t token_floats, const int64_t *locs, int64_t tokens, const float *k,
              int64_t k_stride, const float *v, int64_t v_stride) {
    for (int64_t t = 0; t < tokens; t++) {
        memcpy(k_pool + locs[t] * token_floats, k + t * k_stride, sizeof(float) * token_floats);
        memcpy(v_pool + locs[t] * token_floats, v + t * v_stride, sizeof(float) * token_floats);
    }
}
