/* Row-wise argmax over fp32 logits with torch.argmax's answer: the first index of the largest value,
 * or of the first NaN when a row has one (torch ranks NaN above every number). torch's CPU argmax
 * runs on one thread; this one vectorises and splits rows over threads. */
#include <stdint.h>

#include "vec8.h"

static int64_t row_argmax(const float *x, int64_t n) {
    vec8 best = splat8(-__builtin_inff());
    ivec8 nan_seen = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const vec8 v = load8(x + i);
        best = select8(v > best, v, best);
        nan_seen |= (ivec8)(v != v);
    }
    float max = -__builtin_inff();
    for (int lane = 0; lane < 8; lane++) max = best[lane] > max ? best[lane] : max;
    int nan = 0;
    for (int lane = 0; lane < 8; lane++) nan |= nan_seen[lane] != 0;
    for (int64_t j = i; j < n; j++) {
        nan |= x[j] != x[j];
        max = x[j] > max ? x[j] : max;
    }
    /* second pass: the first position holding that value (or a NaN), 64 floats at a time (whether
     * any lane hit costs 8 extractions, so it is asked once per block) */
    int64_t j = 0;
    const vec8 target = splat8(max);
    for (; j + 64 <= n; j += 64) {
        ivec8 hit = {0};
        for (int v8 = 0; v8 < 8; v8++) {
            const vec8 v = load8(x + j + 8 * v8);
            hit |= nan ? (ivec8)(v != v) : (ivec8)(v == target);
        }
        int any = 0;
        for (int lane = 0; lane < 8; lane++) any |= hit[lane] != 0;
        if (any) break;
    }
    for (; j < n; j++)
        if (nan ? x[j] != x[j] : x[j] == max) return j;
    return 0; /* n == 0 (callers never ask) or every value -inf: index 0, as torch answers */
}

void argmax_rows(const float *x, int64_t rows, int64_t stride, int64_t n, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(x + r * stride, n);
}
