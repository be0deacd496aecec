/* The CPU linear layer: y[m, n] = sum_k x[m, k] * w[k, n] (* scale[n]) (+ bias[n]), fp32 activations and
 * accumulation, on weights packed at load in panels of PANEL output columns: panel p holds
 * w[k, PANEL p .. PANEL p + PANEL - 1] for k = 0 .. K-1, PANEL weights per k (N padded with zero
 * columns). Weights are fp32, or int8 with one fp32 scale per output column (`--quantization int8`).
 *
 * A block of up to ROWS tokens reads a panel once: each k loads PANEL weights (widened to fp32 for
 * int8) and does ROWS x PANEL FMAs into registers. A decode step reads every weight once, so it runs
 * at memory speed, where oneDNN's packed sgemm (the path before this kernel) did not; int8 reads a
 * quarter of the bytes. Measured: loadtests/results/panel_linear_cpu.txt.
 *
 * Every y[m, n] is one FMA chain over k in order, whatever the batch: a request's output does not
 * depend on which others share its step. (fbgemm's dynamic int8, tried first for int8, rounds the
 * activations with one scale for the whole batch, which ruined the default model's perplexity.) */
#include <stdint.h>
#include <string.h>

#include "vec8.h"

enum { PANEL = 16, WIDE = 6, PARALLEL_MIN_MACS = 1 << 16 };
#ifdef __AVX512F__
#define ROWS 8 /* tokens a block reads a panel for: 8 rows x 2 panels of 16-float vectors is 16 of 32 registers */
#else
#define ROWS 6 /* 6 rows x 2 halves of 8 floats is 12 of 16 registers */
#endif

#ifdef _OPENMP
#include <omp.h>
static inline int64_t max_threads(void) { return omp_get_max_threads(); }
#else
static inline int64_t max_threads(void) { return 1; }
#endif

#ifdef __AVX2__
#include <immintrin.h>
static inline vec8 widen8(const int8_t *p) { /* vpmovsxbd + vcvtdq2ps; GCC's generic conversion goes byte by byte */
    return (vec8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#else
typedef int8_t i8x8 __attribute__((vector_size(8)));
static inline vec8 widen8(const int8_t *p) {
    i8x8 v;
    memcpy(&v, p, sizeof v);
    return __builtin_convertvector(__builtin_convertvector(v, ivec8), vec8);
}
#endif

/* 8 weights of a panel row as fp32: int8 ones widened (`quantized`, a compile-time constant at each call) */
static inline __attribute__((always_inline)) vec8 weights8(const void *panel, int64_t index, const int quantized) {
    return quantized ? widen8((const int8_t *)panel + index) : load8((const float *)panel + index);
}

/* A panel's row of PANEL weights in registers. Where the CPU has AVX-512 it is one 16-float vector, twice
 * the FMAs per instruction of two 8-float halves: a batch of rows (prefill, a mixed step) is compute-bound
 * and ran at half the speed of oneDNN's AVX-512 sgemm on 8-float halves (loadtests/results/panel_linear_cpu.txt).
 * Each lane is the same FMA chain over k either way, so the outputs are bit for bit the same. */
#ifdef __AVX512F__
typedef float panel_vec __attribute__((vector_size(64)));
static inline panel_vec load_panel(const float *p) {
    panel_vec v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline panel_vec splat_panel(float x) { return (panel_vec){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
static inline panel_vec widen_panel(const int8_t *p) {
    return (panel_vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#else
typedef vec8 panel_vec;
static inline panel_vec load_panel(const float *p) { return load8(p); }
static inline panel_vec splat_panel(float x) { return splat8(x); }
static inline panel_vec widen_panel(const int8_t *p) { return widen8(p); }
#endif
enum { LANES = sizeof(panel_vec) / sizeof(float), VECS = PANEL / LANES }; /* vectors per panel row */

static inline __attribute__((always_inline)) panel_vec panel_weights(const void *panel, int64_t index,
                                                                      const int quantized) {
    return quantized ? widen_panel((const int8_t *)panel + index) : load_panel((const float *)panel + index);
}

/* rows (1..ROWS) tokens x `panels` (1..2) adjacent panels. Compile-time `rows`, `panels` and `quantized`
 * at each call keep acc in registers. Two panels for one or two rows give the FMA chains (4 cycles each)
 * enough independent work to reach memory speed; every output is still one chain over k in order. */
static inline __attribute__((always_inline)) void panel_block(const float *x, int64_t x_stride, const int rows,
                                                              const int panels, const int quantized,
                                                              const void *panel, int64_t k_dim, const float *scale,
                                                              const float *bias, float *y, int64_t y_stride,
                                                              int64_t cols) {
    panel_vec acc[ROWS][2 * VECS];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < VECS * panels; j++) acc[r][j] = splat_panel(0.0f);
    for (int64_t k = 0; k < k_dim; k++) {
        panel_vec w[2 * VECS];
        for (int j = 0; j < panels; j++)
            for (int v = 0; v < VECS; v++)
                w[VECS * j + v] = panel_weights(panel, j * k_dim * PANEL + k * PANEL + LANES * v, quantized);
        for (int r = 0; r < rows; r++) {
            const panel_vec xk = splat_panel(x[r * x_stride + k]);
            for (int j = 0; j < VECS * panels; j++) acc[r][j] += xk * w[j];
        }
    }
    for (int r = 0; r < rows; r++) {
        float out[2 * PANEL] = {0};
        for (int j = 0; j < VECS * panels; j++) {
            const panel_vec v = quantized ? acc[r][j] * load_panel(scale + LANES * j) : acc[r][j];
            memcpy(out + LANES * j, &v, sizeof v);
        }
        float *row = y + r * y_stride;
        if (bias)
            for (int64_t c = 0; c < cols; c++) row[c] = out[c] + bias[c];
        else
            memcpy(row, out, (size_t)cols * sizeof(float));
    }
}

/* One token x `panels` (1..WIDE) adjacent panels: a lone row has one FMA chain per 8 outputs, so it takes
 * the most panels at once, to keep enough independent chains in flight
 * (loadtests/results/panel_linear_one_row_cpu.txt). */
static inline __attribute__((always_inline)) void row_block(const float *x, const int panels, const int quantized,
                                                            const void *panel, int64_t k_dim, const float *scale,
                                                            const float *bias, float *y, int64_t cols) {
    vec8 acc[2 * WIDE];
    for (int j = 0; j < 2 * panels; j++) acc[j] = splat8(0.0f);
    for (int64_t k = 0; k < k_dim; k++) {
        const vec8 xk = splat8(x[k]);
        for (int j = 0; j < panels; j++) {
            acc[2 * j] += xk * weights8(panel, j * k_dim * PANEL + k * PANEL, quantized);
            acc[2 * j + 1] += xk * weights8(panel, j * k_dim * PANEL + k * PANEL + 8, quantized);
        }
    }
    float out[WIDE * PANEL] = {0};
    for (int j = 0; j < 2 * panels; j++) store8(out + 8 * j, quantized ? acc[j] * load8(scale + 8 * j) : acc[j]);
    if (bias)
        for (int64_t c = 0; c < cols; c++) y[c] = out[c] + bias[c];
    else
        memcpy(y, out, (size_t)cols * sizeof(float));
}

#define BLOCK(rows, panels)                                                                                 \
    panel_block(x + r * x_stride, x_stride, rows, panels, quantized, (const char *)packed + p0 * panel_bytes, \
                k_dim, s, b, y + r * n + col, n, cols)

/* A single token (a decode step of one request): each thread takes one contiguous range of panels (an
 * even split) and walks it WIDE panels at a time. */
static inline __attribute__((always_inline)) void single_row(const float *x, const void *packed, const int quantized,
                                                             const float *scale, const float *bias, int64_t n,
                                                             int64_t k_dim, float *y) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    const int64_t panel_bytes = k_dim * PANEL * (quantized ? 1 : (int64_t)sizeof(float));
    const int parallel = n * k_dim >= PARALLEL_MIN_MACS;
    const int64_t threads = parallel ? max_threads() : 1;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t t = 0; t < threads; t++) {
        const int64_t end = panels * (t + 1) / threads;
        for (int64_t p0 = panels * t / threads; p0 < end;) {
            const int64_t count = end - p0 < WIDE ? end - p0 : WIDE;
            const int64_t col = p0 * PANEL, cols = n - col < count * PANEL ? n - col : count * PANEL;
            const float *s = quantized ? scale + col : NULL, *b = bias ? bias + col : NULL;
            const void *panel = (const char *)packed + p0 * panel_bytes;
            switch (count) { /* compile-time widths */
                case 6: row_block(x, 6, quantized, panel, k_dim, s, b, y + col, cols); break;
                case 5: row_block(x, 5, quantized, panel, k_dim, s, b, y + col, cols); break;
                case 4: row_block(x, 4, quantized, panel, k_dim, s, b, y + col, cols); break;
                case 3: row_block(x, 3, quantized, panel, k_dim, s, b, y + col, cols); break;
                case 2: row_block(x, 2, quantized, panel, k_dim, s, b, y + col, cols); break;
                default: row_block(x, 1, quantized, panel, k_dim, s, b, y + col, cols); break;
            }
            p0 += count;
        }
    }
}

/* Every row through `panels` (1..2) panels from `first`, ROWS rows at a time across them (16-float vectors):
 * 8 rows x 2 panels is 16 accumulators, and each k's 16 FMAs need 2 weight loads and 8 broadcasts, where a
 * block of one panel needs 9 loads for 8 FMAs and waits on the load ports. (Four 8-float halves a row
 * would not fit the registers: there it is one panel a block, below.) */
static inline __attribute__((always_inline)) void row_blocks(const float *x, int64_t m, int64_t x_stride,
                                                             const void *packed, const int quantized,
                                                             const float *scale, const float *bias, int64_t n,
                                                             int64_t k_dim, float *y, int64_t first, const int panels) {
    const int64_t panel_bytes = k_dim * PANEL * (quantized ? 1 : (int64_t)sizeof(float));
    const int64_t p0 = first, col = first * PANEL, cols = n - col < panels * PANEL ? n - col : panels * PANEL;
    const float *s = quantized ? scale + col : NULL, *b = bias ? bias + col : NULL;
    int64_t r = 0;
    for (; r + ROWS <= m; r += ROWS) BLOCK(ROWS, panels);
    switch (m - r) {
        case 1: BLOCK(1, panels); break;
        case 2: BLOCK(2, panels); break;
        case 3: BLOCK(3, panels); break;
        case 4: BLOCK(4, panels); break;
        case 5: BLOCK(5, panels); break;
#if ROWS > 6
        case 6: BLOCK(6, panels); break;
        case 7: BLOCK(7, panels); break;
#endif
        default: break;
    }
}

/* x [m, k_dim] (row stride x_stride), packed [panels, k_dim, PANEL], scale [panels * PANEL] (int8 only),
 * bias [n] or NULL, y [m, n] contiguous. Threads split the output columns in pairs of panels. */
static inline __attribute__((always_inline)) void panel_linear(const float *x, int64_t m, int64_t x_stride,
                                                               const void *packed, const int quantized,
                                                               const float *scale, const float *bias, int64_t n,
                                                               int64_t k_dim, float *y) {
    const int64_t panels = (n + PANEL - 1) / PANEL, pairs = (panels + 1) / 2;
    const int64_t panel_bytes = k_dim * PANEL * (quantized ? 1 : (int64_t)sizeof(float));
#pragma omp parallel for schedule(static) if (m * n * k_dim >= PARALLEL_MIN_MACS)
    for (int64_t pair = 0; pair < pairs; pair++) {
        const int64_t first = 2 * pair, count = panels - first < 2 ? panels - first : 2;
        if (VECS == 1) { /* 16-float vectors: a block of rows spans both panels (row_blocks) */
            if (count == 2)
                row_blocks(x, m, x_stride, packed, quantized, scale, bias, n, k_dim, y, first, 2);
            else
                row_blocks(x, m, x_stride, packed, quantized, scale, bias, n, k_dim, y, first, 1);
            continue;
        }
        for (int64_t p0 = first; p0 < first + count; p0++) { /* 8-float halves: blocks of ROWS (down to 3) rows, one panel */
            const int64_t col = p0 * PANEL, cols = n - col < PANEL ? n - col : PANEL;
            const float *s = quantized ? scale + col : NULL, *b = bias ? bias + col : NULL;
            int64_t r = 0;
            for (; r + ROWS <= m; r += ROWS) BLOCK(ROWS, 1);
            switch (m - r) {
                case 3: BLOCK(3, 1); break;
                case 4: BLOCK(4, 1); break;
                case 5: BLOCK(5, 1); break;
                default: break;
            }
        }
        const int64_t r = m - m % ROWS; /* the last one or two rows: both panels at once */
        if (m - r == 0 || m - r >= 3) continue;
        const int64_t p0 = first, col = first * PANEL, cols = n - col < count * PANEL ? n - col : count * PANEL;
        const float *s = quantized ? scale + col : NULL, *b = bias ? bias + col : NULL;
        if (count == 2) {
            if (m - r == 1) BLOCK(1, 2); else BLOCK(2, 2);
        } else {
            if (m - r == 1) BLOCK(1, 1); else BLOCK(2, 1);
        }
    }
}

/* One row on its own path (not inlined into the batched one, whose code it would otherwise perturb). */
static __attribute__((noinline)) void f32_single_row(const float *x, const float *packed, const float *bias,
                                                     int64_t n, int64_t k_dim, float *y) {
    single_row(x, packed, 0, NULL, bias, n, k_dim, y);
}

static __attribute__((noinline)) void int8_single_row(const float *x, const int8_t *packed, const float *scale,
                                                      const float *bias, int64_t n, int64_t k_dim, float *y) {
    single_row(x, packed, 1, scale, bias, n, k_dim, y);
}

void f32_linear(const float *x, int64_t m, int64_t x_stride, const float *packed, const float *bias, int64_t n,
                int64_t k_dim, float *y) {
    if (m == 1)
        f32_single_row(x, packed, bias, n, k_dim, y);
    else
        panel_linear(x, m, x_stride, packed, 0, NULL, bias, n, k_dim, y);
}

void int8_linear(const float *x, int64_t m, int64_t x_stride, const int8_t *packed, const float *scale,
                 const float *bias, int64_t n, int64_t k_dim, float *y) {
    if (m == 1)
        int8_single_row(x, packed, scale, bias, n, k_dim, y);
    else
        panel_linear(x, m, x_stride, packed, 1, scale, bias, n, k_dim, y);
}
