/* Weights kept in GGUF's quantized blocks (ggml's layouts, bit for bit as the file has them) and the two
 * things the CPU does with them: de-quantize blocks to fp32 (embedding rows, checks, tests), and dot weight
 * rows with activation rows quantized per block to int16 (every linear layer on such weights).
 *
 * Each block type's format (csrc/quant_legacy.c: Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 MXFP4; csrc/quant_kquants.c: Q4_K
 * Q5_K Q6_K) is a `BlockFormat`; csrc/quant_linear.c quantizes the activations, tiles and threads.
 *
 * Why int16 activations where ggml rounds them to int8: int8 per 32 values moves the default model's
 * (SmolLM2-135M, Q4_1) logits enough to change its top-1 token at 3.5 % of the positions of a fixed text
 * against the de-quantized fp32 model (and its answer to "What is the capital of France?"); int16 changes
 * none (measured: loadtests/results/quant_blocks_cpu.txt). An int16 x small-int dot is one madd per 16
 * pairs on AVX2 (vpdpwssd on AVX512-VNNI), twice the instructions of ggml's int8 maddubs.
 *
 * The dot's arithmetic is fixed: the integer products of each block (or sub-block) are summed exactly in
 * integers, then turned into floats in one order the same on every path (AVX2 or plain C), so a row's result
 * is bit for bit the same whatever the vector width and whatever rows share its call: a decode row's output
 * does not depend on its batch (calls of many rows, prefill chunks, take fp32 tiles: kernels/quant_blocks.py). */
#ifndef BATCHSERVE_QUANT_BLOCKS_H
#define BATCHSERVE_QUANT_BLOCKS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* GGUF's type ids (ggml_type) */
enum {
    GGML_Q4_0 = 2,
    GGML_Q4_1 = 3,
    GGML_Q5_0 = 6,
    GGML_Q5_1 = 7,
    GGML_Q8_0 = 8,
    GGML_Q4_K = 12,
    GGML_Q5_K = 13,
    GGML_Q6_K = 14,
    GGML_MXFP4 = 39,
};

enum { QK = 32, QK_K = 256 };

enum { ACT_MAX = 32767 }; /* |q| <= ACT_MAX: d = max |x| / ACT_MAX, q = round-half-even(x / d) */

/* An activation row quantized per 32 values (what the legacy types and MXFP4 pair with): x ~ d * q;
 * `qsum` = the sum of q (for the types with a per-block minimum: their min times d * qsum). */
typedef struct {
    float d;
    int32_t qsum;
    int16_t q[QK];
} ActBlock32;

/* An activation row quantized per 256 values (what the k-quants pair with): one d per 256 and the sums of
 * q over each 16 (`bsums`, for the k-quants' per-sub-block minimums). */
typedef struct {
    float d;
    int32_t bsums[QK_K / 16];
    int16_t q[QK_K];
} ActBlock256;

enum { DOT_ROWS = 4 }; /* activation rows one `dot_rows` call takes at most */

typedef struct {
    int64_t type;        /* GGUF type id */
    int64_t block;       /* weights per block: QK or QK_K */
    int64_t block_bytes; /* bytes per block in the file */
    /* fp32 values of `blocks` consecutive blocks, exactly as gguf-py's numpy `dequantize` computes them */
    void (*dequantize)(const uint8_t *src, int64_t blocks, float *out);
    /* out[r * out_stride] = the dot of weight row `w_row` with activation row r (ActBlock32s for block QK,
     * ActBlock256s for QK_K; row r at acts + r * act_row_bytes), r < rows <= DOT_ROWS: each block decoded
     * once for all the rows. Each row's result is the same bits whatever `rows` is (a row's arithmetic
     * never depends on the others'). */
    void (*dot_rows)(const uint8_t *w_row, const void *acts, size_t act_row_bytes, int64_t rows, int64_t blocks,
                     float *out, int64_t out_stride);
} BlockFormat;

/* The formats, one per file that defines them */
extern const BlockFormat FORMAT_Q8_0, FORMAT_Q4_0, FORMAT_Q4_1, FORMAT_Q5_0, FORMAT_Q5_1, FORMAT_MXFP4;
extern const BlockFormat FORMAT_Q4_K, FORMAT_Q5_K, FORMAT_Q6_K;

/* fp16 as stored in blocks (IEEE half, little-endian) to fp32: exact */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13); /* inf / nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        exp = 113;
        while (!(mant & 0x400)) {
            mant <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float read_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return half_to_float(h);
}

#endif
