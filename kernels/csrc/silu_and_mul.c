/* SiLU(gate) * up in fp32 for a fused gate|up projection output, in one pass, with the vectorised
 * exp of vec8.h (within ~2 ulp of expf, as torch's own vectorised exp is). */
#include <math.h>
#include <stdint.h>

#include "vec8.h"

/* out [rows, half] = silu(gate) * up for gate_up rows [gate (half) | up (half)]; silu(g) = g / (1 + e^-g). */
void silu_and_mul(const float *restrict gate_up, int64_t rows, int64_t stride, int64_t half, float *restrict out) {
#pragma omp parallel for schedule(static) if (rows * half >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * stride, *up = gate + half;
        float *o = out + r * half;
        int64_t i = 0;
        for (; i + 8 <= half; i += 8) {
            const vec8 g = load8(gate + i);
            /* where e^-g overflows, torch's g / (1 + inf) is -0 (NaN for -inf): g * 0 gives both, where
             * exp8's clamp would leave a tiny nonzero */
            const vec8 silu = select8(g < splat8(-EXP_MAX_ARG), g * splat8(0.0f), g / (splat8(1.0f) + exp8(-g)));
            store8(o + i, silu * load8(up + i));
        }
        for (; i < half; i++) o[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}
