/* The linear layer on weights kept in GGUF blocks (csrc/quant_blocks.h): y[m, n] = x[m, :] . w[n, :] (+ bias),
 * w given as n rows of k / block blocks each, as the file stores them.
 *
 * The activations are quantized once per call to int16 blocks (32 values per scale for the legacy types and
 * MXFP4, 256 for the k-quants, as ggml pairs them; int16 rather than ggml's int8: csrc/quant_blocks.h), then
 * every output is one weight row's integer block dots with one activation row. A decode step reads each
 * weight byte once (a 4.5-bit type reads 1/7 of fp32's bytes); the same arithmetic serves every batch size
 * below TILE_MIN_ROWS rows, so a decode row's output never depends on its batch.
 *
 * A call of TILE_MIN_ROWS rows or more (a prefill chunk) would decode every block again for each 4 rows; it
 * de-quantizes the weight instead, TILE_ROWS rows at a time per thread into fp32 panels that stay in cache,
 * and runs the fp32 panel kernel (csrc/panel_linear.c) over them, which reuses each weight value for 6-8 rows
 * in registers: its output is bit for bit the de-quantized fp32 model's. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "quant_blocks.h"

#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_max_threads(void) { return 1; }
static inline int omp_get_thread_num(void) { return 0; }
#endif

#include "projection.h"

enum { PARALLEL_MIN_MACS = 1 << 16 };
/* From TILE_MIN_ROWS rows on, de-quantized panels beat the integer dots (measured on AVX2, 2048-wide layers:
 * about equal at 32 rows, 1.3x at 64, 2x at 256); TILE_ROWS = two of panel_linear.c's 16-wide panels. */
enum { TILE_MIN_ROWS = 48, PANEL_WIDTH = 16, TILE_ROWS = 2 * PANEL_WIDTH };

const BlockFormat *block_format(int64_t type) {
    switch (type) {
    case GGML_Q8_0: return &FORMAT_Q8_0;
    case GGML_Q4_0: return &FORMAT_Q4_0;
    case GGML_Q4_1: return &FORMAT_Q4_1;
    case GGML_Q5_0: return &FORMAT_Q5_0;
    case GGML_Q5_1: return &FORMAT_Q5_1;
    case GGML_MXFP4: return &FORMAT_MXFP4;
    case GGML_Q4_K: return &FORMAT_Q4_K;
    case GGML_Q5_K: return &FORMAT_Q5_K;
    case GGML_Q6_K: return &FORMAT_Q6_K;
    default: return NULL;
    }
}

static float abs_max(const float *x, int64_t n) {
    float amax = 0.0f;
    for (int64_t i = 0; i < n; i++) { /* a compare, not fmaxf: it vectorizes (fmaxf is a libm call per value) */
        const float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    return amax;
}

/* q = round-half-even(x * (1 / d)), d = max |x| / ACT_MAX (all zeros: d = 0, q = 0). The AVX2 conversion
 * and nearbyintf both round half to even (the default rounding mode), so both paths give the same q. */
static void quantize_values(const float *x, int64_t n, float *d_out, int16_t *q) {
    float d = abs_max(x, n) / (float)ACT_MAX, inv = d != 0.0f ? 1.0f / d : 0.0f;
    if (!(inv <= FLT_MAX)) { /* max |x| below ~1e-34: 1 / d overflows; such a block is zeros to the layer */
        d = 0.0f;
        inv = 0.0f;
    }
    int64_t i = 0;
#ifdef __AVX2__
    const __m256 scale = _mm256_set1_ps(inv);
    for (; i + 16 <= n; i += 16) {
        const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), scale));
        const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), scale));
        /* packs works within 128-bit lanes: put the 16 values back in order */
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xd8);
        _mm256_storeu_si256((__m256i *)(q + i), packed);
    }
#endif
    for (; i < n; i++) { /* NaN -> INT16_MIN, as the AVX2 conversion and saturating pack give it */
        const float v = x[i] * inv;
        q[i] = v == v ? (int16_t)nearbyintf(v) : INT16_MIN;
    }
    *d_out = d;
}

void quantize_act32(const float *x, int64_t k, ActBlock32 *out) {
    for (int64_t b = 0; b < k / QK; b++) {
        quantize_values(x + b * QK, QK, &out[b].d, out[b].q);
        int32_t sum = 0;
        for (int i = 0; i < QK; i++)
            sum += out[b].q[i];
        out[b].qsum = sum;
    }
}

void quantize_act256(const float *x, int64_t k, ActBlock256 *out) {
    for (int64_t b = 0; b < k / QK_K; b++) {
        quantize_values(x + b * QK_K, QK_K, &out[b].d, out[b].q);
        for (int j = 0; j < QK_K / 16; j++) {
            int32_t sum = 0;
            for (int i = 0; i < 16; i++)
                sum += out[b].q[16 * j + i];
            out[b].bsums[j] = sum;
        }
    }
}

/* -1: not a block type this library has; 0: done */
int block_dequantize(int64_t type, const uint8_t *src, int64_t blocks, float *out) {
    const BlockFormat *f = block_format(type);
    if (f == NULL)
        return -1;
    /* in chunks across threads (a whole weight at load, or a checkpoint's) */
    const int64_t chunk = 64;
#pragma omp parallel for schedule(static) if (blocks * f->block >= PARALLEL_MIN_MACS)
    for (int64_t b = 0; b < blocks; b += chunk)
        f->dequantize(src + b * f->block_bytes, blocks - b < chunk ? blocks - b : chunk, out + b * f->block);
    return 0;
}

/* The activations of x [m, k] (row stride x_stride) as `f` pairs with: m rows of k / act_block blocks */
static void *quantize_rows(const BlockFormat *f, const float *x, int64_t m, int64_t x_stride, int64_t k,
                           size_t *row_bytes) {
    const int small = f->block == QK;
    *row_bytes = (size_t)(k / f->block) * (small ? sizeof(ActBlock32) : sizeof(ActBlock256));
    char *acts = malloc((size_t)m * *row_bytes);
    if (acts == NULL)
        return NULL;
#pragma omp parallel for schedule(static) if (m * k >= PARALLEL_MIN_MACS)
    for (int64_t i = 0; i < m; i++) {
        if (small)
            quantize_act32(x + i * x_stride, k, (ActBlock32 *)(acts + i * *row_bytes));
        else
            quantize_act256(x + i * x_stride, k, (ActBlock256 *)(acts + i * *row_bytes));
    }
    return acts;
}

/* Weight rows [0, rows) (rows <= TILE_ROWS) of row_bytes each de-quantized into fp32 panels [2, k, PANEL_WIDTH],
 * the layout of csrc/panel_linear.c (zeros past `rows`), CHUNK columns of a panel's rows at a time through
 * `scratch` [PANEL_WIDTH, CHUNK] (16 KB: the transpose stays in L1) */
enum { CHUNK = QK_K };
static void dequantize_panels(const BlockFormat *f, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t k,
                              float *restrict scratch, float *restrict panels) {
    for (int64_t p = 0; p * PANEL_WIDTH < rows; p++) {
        const int64_t count = rows - p * PANEL_WIDTH < PANEL_WIDTH ? rows - p * PANEL_WIDTH : PANEL_WIDTH;
        float *panel = panels + p * k * PANEL_WIDTH;
        memset(scratch + count * CHUNK, 0, sizeof(float) * (size_t)((PANEL_WIDTH - count) * CHUNK)); /* padding */
        for (int64_t c0 = 0; c0 < k; c0 += CHUNK) {
            const int64_t width = k - c0 < CHUNK ? k - c0 : CHUNK, skip = c0 / f->block * f->block_bytes;
            for (int64_t r = 0; r < count; r++)
                f->dequantize(w + (p * PANEL_WIDTH + r) * row_bytes + skip, width / f->block, scratch + r * CHUNK);
            for (int64_t c = 0; c < width; c++)
                for (int64_t r = 0; r < PANEL_WIDTH; r++)
                    panel[(c0 + c) * PANEL_WIDTH + r] = scratch[r * CHUNK + c];
        }
    }
}

/* block_linear_into for many rows: each thread de-quantizes a tile of TILE_ROWS weight rows into panels and
 * runs the fp32 panel kernel over all m rows (one thread each: the tiles are the parallel loop) */
static int tiled_linear(const BlockFormat *f, const float *x, int64_t m, int64_t x_stride, const uint8_t *w,
                        const float *bias, int64_t n, int64_t k, float *y, int64_t y_stride) {
    const int64_t row_bytes = k / f->block * f->block_bytes, tiles = (n + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t scratch = PANEL_WIDTH * CHUNK, panels = TILE_ROWS * k, outs = m * TILE_ROWS;
    const int64_t per_thread = scratch + panels + outs, threads = omp_get_max_threads();
    float *buffers = malloc((size_t)(threads * per_thread) * sizeof(float));
    if (buffers == NULL)
        return -3;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        float *mine = buffers + omp_get_thread_num() * per_thread, *tile = mine + scratch, *out = tile + panels;
        const int64_t j0 = t * TILE_ROWS, count = n - j0 < TILE_ROWS ? n - j0 : TILE_ROWS;
        dequantize_panels(f, w + j0 * row_bytes, row_bytes, count, k, mine, tile);
        f32_linear(x, m, x_stride, tile, bias != NULL ? bias + j0 : NULL, count, k, out);
        for (int64_t i = 0; i < m; i++)
            memcpy(y + i * y_stride + j0, out + i * count, (size_t)count * sizeof(float));
    }
    free(buffers);
    return 0;
}

/* y[i, j] (row stride y_stride) = x[i, :] . w[j, :] (+ bias[j]). -1: unknown type, -2: k not a multiple of
 * the block, -3: out of memory; 0: done */
int block_linear_into(const float *x, int64_t m, int64_t x_stride, const uint8_t *w, int64_t type, const float *bias,
                      int64_t n, int64_t k, float *y, int64_t y_stride) {
    const BlockFormat *f = block_format(type);
    if (f == NULL)
        return -1;
    if (k % f->block != 0)
        return -2;
    if (m >= TILE_MIN_ROWS)
        return tiled_linear(f, x, m, x_stride, w, bias, n, k, y, y_stride);
    size_t act_bytes;
    char *acts = quantize_rows(f, x, m, x_stride, k, &act_bytes);
    if (acts == NULL)
        return -3;
    const int64_t blocks = k / f->block, w_row_bytes = blocks * f->block_bytes;
    /* each weight row is read once, its blocks decoded once per DOT_ROWS activation rows */
#pragma omp parallel for schedule(static) if (m * n * k >= PARALLEL_MIN_MACS)
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *row = w + j * w_row_bytes;
        for (int64_t i = 0; i < m; i += DOT_ROWS) {
            const int64_t rows = m - i < DOT_ROWS ? m - i : DOT_ROWS;
            f->dot_rows(row, acts + i * act_bytes, act_bytes, rows, blocks, y + i * y_stride + j, y_stride);
        }
        if (bias != NULL)
            for (int64_t i = 0; i < m; i++)
                y[i * y_stride + j] += bias[j];
    }
    free(acts);
    return 0;
}

/* block_linear_into a contiguous y [m, n] */
int block_linear(const float *x, int64_t m, int64_t x_stride, const uint8_t *w, int64_t type, const float *bias,
                 int64_t n, int64_t k, float *y) {
    return block_linear_into(x, m, x_stride, w, type, bias, n, k, y, n);
}
