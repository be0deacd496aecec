/* One token of each decode row through Gated DeltaNet's delta rule, in place on the rows' states in the
 * pool: per (row, value head) the state S [dk, dv] is read twice and written once, where the torch form
 * (kernels/gated_delta.py, transformers' arithmetic) gathers the states, makes a dozen passes over them and
 * scatters them back. q and k are L2-normed here (eps 1e-6, as flash-linear-attention), q scaled by
 * dk^-0.5; the state decays by exp(g), takes beta * (v - S^T k) along k, and is read by q. */
#include <math.h>
#include <stdint.h>

static float inv_norm(const float *x, int64_t n) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    return 1.0f / sqrtf(sum + 1e-6f);
}

/* mixed [rows, stride]: q (key_heads * dk) | k (key_heads * dk) | v (value_heads * dv) of each row;
 * g and beta [rows, value_heads]; pool [slots, value_heads, dk, dv]; out [rows, value_heads, dv].
 * Each key head serves value_heads / key_heads consecutive value heads. */
void gated_delta_decode(const float *restrict mixed, int64_t rows, int64_t stride, const float *restrict g,
                        const float *restrict beta, float *restrict pool, const int64_t *restrict slots,
                        int64_t key_heads, int64_t value_heads, int64_t dk, int64_t dv, float *restrict out) {
    const int64_t group = value_heads / key_heads, key_size = key_heads * dk;
    const float scale = 1.0f / sqrtf((float)dk);
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t h = 0; h < value_heads; h++) {
            const float *q = mixed + r * stride + (h / group) * dk, *k = q + key_size;
            const float *v = mixed + r * stride + 2 * key_size + h * dv;
            float qn[dk], kn[dk], remembered[dv], delta[dv], o[dv];
            const float qs = inv_norm(q, dk), ks = inv_norm(k, dk);
            for (int64_t i = 0; i < dk; i++) {
                qn[i] = q[i] * qs * scale;
                kn[i] = k[i] * ks;
            }
            float *state = pool + (slots[r] * value_heads + h) * dk * dv;
            const float decay = expf(g[r * value_heads + h]), b = beta[r * value_heads + h];
            for (int64_t j = 0; j < dv; j++) remembered[j] = 0.0f, o[j] = 0.0f;
            for (int64_t i = 0; i < dk; i++) {
                const float *row = state + i * dv;
                for (int64_t j = 0; j < dv; j++) remembered[j] += kn[i] * row[j];
            }
            for (int64_t j = 0; j < dv; j++) delta[j] = (v[j] - decay * remembered[j]) * b;
            for (int64_t i = 0; i < dk; i++) {
                float *row = state + i * dv;
                for (int64_t j = 0; j < dv; j++) {
                    row[j] = decay * row[j] + kn[i] * delta[j];
                    o[j] += qn[i] * row[j];
                }
            }
            float *dst = out + (r * value_heads + h) * dv;
            for (int64_t j = 0; j < dv; j++) dst[j] = o[j];
        }
    }
}

/* One input of each row through the depthwise causal convolution and SiLU, in place on the rows' windows:
 * x [rows, x_stride] (its first `channels`), weight [channels, width + 1], pool [slots, channels, width]
 * (the last `width` inputs, oldest first), out [rows, channels]. The sum runs oldest input first, as
 * F.conv1d's does. */
void causal_conv1d_decode(const float *restrict x, int64_t rows, int64_t x_stride, const float *restrict weight,
                          int64_t channels, int64_t width, float *restrict pool, const int64_t *restrict slots,
                          float *restrict out) {
#pragma omp parallel for schedule(static) if (rows * channels >= 4096)
    for (int64_t r = 0; r < rows; r++) {
        const float *in = x + r * x_stride;
        float *window = pool + slots[r] * channels * width, *dst = out + r * channels;
        for (int64_t c = 0; c < channels; c++) {
            float *w = window + c * width;
            const float *taps = weight + c * (width + 1);
            float sum = 0.0f;
            for (int64_t t = 0; t < width; t++) sum += taps[t] * w[t];
            sum += taps[width] * in[c];
            for (int64_t t = 0; t + 1 < width; t++) w[t] = w[t + 1];
            if (width) w[width - 1] = in[c];
            dst[c] = sum / (1.0f + expf(-sum));
        }
    }
}
