/* Structured output: -inf for every token a grammar does not allow, in place. The bitmask is
 * llguidance's: bit j of 32-bit word w set when token 32 * w + j is allowed. A word of all ones
 * (the common case inside a JSON string) costs nothing, a word of zeros one 32-float store, where
 * torch's masked_fill needs the mask unpacked to one bool per token first.
 * dead[r] = 1 when row r has no finite allowed score left (the caller decides what then). */
#include <stdint.h>

#include "vec8.h"

void apply_token_bitmask(float *scores, int64_t rows, int64_t stride, int64_t vocab, const int32_t *mask,
                         int64_t words, uint8_t *dead) {
    const float neg_inf = -__builtin_inff();
#pragma omp parallel for schedule(static) if (rows * vocab >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        float *row = scores + r * stride;
        const uint32_t *bits = (const uint32_t *)(mask + r * words);
        float best = neg_inf;
        for (int64_t w = 0; w < words && 32 * w < vocab; w++) {
            float *x = row + 32 * w;
            const int64_t n = vocab - 32 * w < 32 ? vocab - 32 * w : 32;
            const uint32_t word = bits[w];
            if (word == 0 && n == 32) {
                for (int j = 0; j < 32; j++) x[j] = neg_inf;
                continue;
            }
            if (n == 32) { /* branch-free, so it vectorises */
                for (int j = 0; j < 32; j++) {
                    const float v = ((word >> j) & 1u) ? x[j] : neg_inf;
                    x[j] = v;
                    best = v > best ? v : best;
                }
                continue;
            }
            for (int64_t j = 0; j < n; j++) {
                if ((word >> j) & 1u) best = x[j] > best ? x[j] : best;
                else x[j] = neg_inf;
            }
        }
        dead[r] = !(best > neg_inf);
    }
}
