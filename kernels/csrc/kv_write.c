/* The KV-pool write of a step's new keys and values, one memcpy per token instead of two torch
 * index_copy_ calls per layer. */
#include <stdint.h>
#include <string.h>

/* k_pool[locs[t]] = k[t] and v_pool[locs[t]] = v[t]: one token's kv heads are token_floats floats. */
void write_kv(float *k_pool, float *v_pool, int64_t token_floats, const int64_t *locs, int64_t tokens, const float *k,
              int64_t k_stride, const float *v, int64_t v_stride) {
    for (int64_t t = 0; t < tokens; t++) {
        memcpy(k_pool + locs[t] * token_floats, k + t * k_stride, sizeof(float) * token_floats);
        memcpy(v_pool + locs[t] * token_floats, v + t * v_stride, sizeof(float) * token_floats);
    }
}
