/* Rotate-half rotary embedding in fp32, bit-identical to torch's x * cos + rotate_half(x) * sin:
 * each product is rounded before the sum, so no fused multiply-add in this file (GCC's pragma below;
 * clang contracts only within one expression, and the products are separate statements). */
#include <stdint.h>

#include "vec8.h"

#pragma GCC optimize("fp-contract=off")

/* Rotate-half rotary embedding: out [rows, heads, head_dim] from x (heads and dims contiguous within
 * a row) and the row's cos/sin [rows, head_dim]. */
void rotary(const float *restrict x, int64_t rows, int64_t x_stride, int64_t heads, int64_t head_dim,
            const float *restrict cos, const float *restrict sin, float *restrict out) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (rows * heads * head_dim >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * head_dim, *s = sin + r * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + r * x_stride + h * head_dim;
            float *o = out + (r * heads + h) * head_dim;
            int64_t i = 0;
            for (; i + 8 <= half; i += 8) {
                const vec8 first = load8(xh + i), second = load8(xh + i + half);
                const vec8 first_cos = first * load8(c + i), first_sin = second * load8(s + i);
                const vec8 second_cos = second * load8(c + i + half), second_sin = first * load8(s + i + half);
                store8(o + i, first_cos - first_sin);
                store8(o + i + half, second_cos + second_sin);
            }
            for (; i < half; i++) {
                const float first_cos = xh[i] * c[i], first_sin = xh[i + half] * s[i];
                const float second_cos = xh[i + half] * c[i + half], second_sin = xh[i] * s[i + half];
                o[i] = first_cos - first_sin;
                o[i + half] = second_cos + second_sin;
            }
        }
    }
}
