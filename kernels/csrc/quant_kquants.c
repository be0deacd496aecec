/* ggml's k-quants Q4_K, Q5_K and Q6_K (csrc/quant_blocks.h): 256 weights per block in sub-blocks with their
 * own scales, bit for bit as a GGUF file stores them.
 *
 *   Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc[8] and mins m[8], 128 bytes of nibbles;
 *                     sub-block j (32 weights) is d*sc[j] * q - dmin*m[j], q = 0..15.
 *   Q5_K (176 bytes): as Q4_K with 32 bytes of fifth bits before the nibbles: q = 0..31.
 *   Q6_K (210 bytes): 128 bytes of low nibbles, 64 of high 2-bit pairs, int8 scales[16], fp16 d;
 *                     sub-block j (16 weights) is d*scales[j] * (q - 32), q = 0..63.
 *
 * The dot of a weight row with an activation row (ActBlock256s: x ~ dx * qx, |qx| <= 32767), per block:
 *   Q4_K, Q5_K: isum = sum_i w_i * qx_i, w_i = sc_j(i) * q_i                  (int64, exact: < 2^34)
 *               msum = sum_j m_j * (bsums[2j] + bsums[2j+1])                   (int32, exact: < 63*256*32767 < 2^29)
 *               term = (dx*d) * float(isum) - (dx*dmin) * float(msum)
 *   Q6_K:       isum = sum_i w_i * qx_i, w_i = scales_j(i) * (q_i - 32)        (int64, exact: < 2^35)
 *               term = (dx*d) * float(isum)                                   (the -32 is in w: no bsums)
 * and out = acc after acc = acc + term over the blocks in order from acc = 0. float(.) rounds the exact integer
 * once, each * - + rounds once (to nearest even), nothing is fused into an FMA: the same float operations in
 * the same order on every path, so a row's result is the same bits on AVX2, VNNI and plain C, whatever rows
 * share its call.
 *
 * The weights are decoded once per block to int16 w_i (|w| <= 63*15 = 945, 63*31 = 1953, 128*32 = 4096) and
 * multiplied with each activation row, AVX2 by madd (VNNI: dpwssd) into int32 lanes. A lane sums 32 products
 * of a Q4_K / Q5_K block (<= 32*945*32767 < 2^30, 32*1953*32767 = 2047806432 < 2^31) or 16 of a Q6_K half-block
 * (one accumulator per half: <= 16*4096*32767 = 2147418112 < 2^31), exact; the lanes are then summed exactly as
 * doubles (integers < 2^53) and rounded once to float: float(isum), what the plain path's int64 sum converts to.
 * msum's lanes hold bsums[i] * m + bsums[i+8] * m' (< 2^26 each): their int32 sum is exact. The horizontal sums
 * and float steps are done for 4 (row, block) pairs at once: 4 blocks of one row, 2 of two rows, or one block
 * of 3 or 4 rows. */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <stdint.h>
#include <string.h>

#include "quant_blocks.h"

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* read_half in one instruction where the CPU converts fp16: the same float (a NaN comes out quiet, which the
 * dot's first product makes it anyway; de-quantization keeps read_half, whose NaNs are numpy's bits) */
static inline float fast_half(const uint8_t *p) {
#ifdef __F16C__
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
#else
    return read_half(p);
#endif
}

/* byte offsets inside the blocks (read byte-wise: a file's blocks need not be aligned) */
enum {
    Q4_K_BYTES = 144, Q4_K_SCALES = 4, Q4_K_QS = 16,
    Q5_K_BYTES = 176, Q5_K_SCALES = 4, Q5_K_QH = 16, Q5_K_QS = 48,
    Q6_K_BYTES = 210, Q6_K_QL = 0, Q6_K_QH = 128, Q6_K_SCALES = 192, Q6_K_D = 208,
};

/* Q4_K / Q5_K's 12 scale bytes to sc[0..7] (the bytes of *sc, low first) and m[0..7] (of *mins), as ggml
 * unpacks them: bytes 0-3 hold sc[0..3] in their low 6 bits and bits 4-5 of sc[4..7] on top, bytes 4-7 the
 * same for the mins, bytes 8-11 the low nibbles of sc[4..7] (low) and m[4..7] (high). */
static inline void unpack_scales(const uint8_t *packed, uint64_t *sc, uint64_t *mins) {
    uint32_t w[3];
    for (int i = 0; i < 3; i++)
        memcpy(&w[i], packed + 4 * i, 4);
    const uint32_t sc_high = (w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4);
    const uint32_t m_high = ((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4);
    *sc = (w[0] & 0x3f3f3f3fu) | (uint64_t)sc_high << 32;
    *mins = (w[1] & 0x3f3f3f3fu) | (uint64_t)m_high << 32;
}

static inline int byte_of(uint64_t v, int j) { return (int)(v >> (8 * j) & 0xff); }

/* ---- de-quantization: numpy's float32 steps, one rounding each: (d*sc) * q - (dmin*m) ---- */

static void scale_sub_block(const uint8_t q[32], float scale, float min, float *out) {
    for (int i = 0; i < 32; i++)
        out[i] = scale * (float)q[i] - min;
}

/* q of Q4_K / Q5_K sub-block j (qh NULL for Q4_K): nibble j%2 of the 32 bytes j/2, fifth bit j of qh */
static inline void sub_block_q(const uint8_t *qs, const uint8_t *qh, int j, uint8_t q[32]) {
    const uint8_t *bytes = qs + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    for (int i = 0; i < 32; i++)
        q[i] = (uint8_t)(((bytes[i] >> shift) & 0x0f) | (qh != NULL ? ((qh[i] >> j) & 1) << 4 : 0));
}

static void dequantize_q45_k(const uint8_t *restrict src, int64_t blocks, float *restrict out, int64_t bytes,
                             int64_t qh_at, int64_t qs_at) {
    for (int64_t b = 0; b < blocks; b++, src += bytes, out += QK_K) {
        const float d = read_half(src), dmin = read_half(src + 2);
        uint64_t sc, mins;
        uint8_t q[32];
        unpack_scales(src + Q4_K_SCALES, &sc, &mins);
        for (int j = 0; j < 8; j++) {
            sub_block_q(src + qs_at, qh_at ? src + qh_at : NULL, j, q);
            scale_sub_block(q, d * (float)byte_of(sc, j), dmin * (float)byte_of(mins, j), out + 32 * j);
        }
    }
}

static void dequantize_q4_k(const uint8_t *restrict src, int64_t blocks, float *restrict out) {
    dequantize_q45_k(src, blocks, out, Q4_K_BYTES, 0, Q4_K_QS);
}

static void dequantize_q5_k(const uint8_t *restrict src, int64_t blocks, float *restrict out) {
    dequantize_q45_k(src, blocks, out, Q5_K_BYTES, Q5_K_QH, Q5_K_QS);
}

/* Q6_K's q (0..63) of values 32p .. 32p+31 of half h (p = 0..3): the low nibbles of ql bytes 32(p%2)..
 * (p < 2) or their high nibbles (p >= 2), and bits 2p, 2p+1 of the half's 32 qh bytes */
static inline void q6_part(const uint8_t *block, int h, int p, uint8_t q[32]) {
    const uint8_t *ql = block + Q6_K_QL + 64 * h + 32 * (p % 2), *qh = block + Q6_K_QH + 32 * h;
    const int shift = 4 * (p / 2);
    for (int i = 0; i < 32; i++)
        q[i] = (uint8_t)(((ql[i] >> shift) & 0x0f) | ((qh[i] >> (2 * p)) & 3) << 4);
}

static void dequantize_q6_k(const uint8_t *restrict src, int64_t blocks, float *restrict out) {
    for (int64_t b = 0; b < blocks; b++, src += Q6_K_BYTES, out += QK_K) {
        const float d = read_half(src + Q6_K_D);
        const int8_t *scales = (const int8_t *)(src + Q6_K_SCALES);
        uint8_t q[32];
        for (int part = 0; part < 8; part++) {
            q6_part(src, part / 4, part % 4, q);
            for (int half = 0; half < 2; half++) {
                const float scale = d * (float)scales[2 * part + half];
                float *o = out + 32 * part + 16 * half;
                for (int i = 0; i < 16; i++)
                    o[i] = scale * (float)((int)q[16 * half + i] - 32);
            }
        }
    }
}

/* which k-quant: 4, 5 or 6 (Q4_K, Q5_K, Q6_K); a constant wherever it is tested */
static inline int64_t kind_bytes(int kind) { return kind == 4 ? Q4_K_BYTES : kind == 5 ? Q5_K_BYTES : Q6_K_BYTES; }

/* ---- the dots, AVX2: each block's weights decoded 16 at a time to int16 and dotted with every row ---- */
#ifdef __AVX2__

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* acc + the pairwise sums of w * x: exact while the lanes stay in int32 (the bounds above) */
ALWAYS_INLINE __m256i dot16(__m256i acc, __m256i w, const int16_t *x) {
    const __m256i xs = _mm256_loadu_si256((const __m256i *)x);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, w, xs);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, w, xs);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, xs));
#endif
}

/* 16 bytes at p zero-extended to 16 int16 lanes */
ALWAYS_INLINE __m256i load_u8x16(const uint8_t *p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)); }

/* v (bytes in int16 lanes) shifted so that bit j is at bit 4 (the bits around it are masked after) */
ALWAYS_INLINE __m256i bit_to4(__m256i v, int j) { return j <= 4 ? _mm256_slli_epi16(v, 4 - j) : _mm256_srli_epi16(v, j - 4); }

/* pairs[j] = the int16 scale j in both halves of 32 bits, from 8 scales as bytes (unsigned or signed) */
ALWAYS_INLINE void scale_pairs(__m128i bytes, const int is_signed, uint32_t pairs[8]) {
    __m256i v = is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
    if (is_signed)
        v = _mm256_and_si256(v, _mm256_set1_epi32(0xffff));
    _mm256_storeu_si256((__m256i *)pairs, _mm256_or_si256(v, _mm256_slli_epi32(v, 16)));
}

/* 16 int16 lanes of scale j from scale_pairs: a broadcast load, no shuffle */
ALWAYS_INLINE __m256i scale16(const uint32_t *pairs, int j) {
    return _mm256_castps_si256(_mm256_broadcast_ss((const float *)(const void *)(pairs + j)));
}

/* 8 int32 lanes -> 4 doubles, their sums in pairs (exact) */
ALWAYS_INLINE __m256d lanes_pd(__m256i v) {
    return _mm256_add_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(v)),
                         _mm256_cvtepi32_pd(_mm256_extracti128_si256(v, 1)));
}

/* [sum v[0], sum v[1], sum v[2], sum v[3]] each summed exactly (integers < 2^53), rounded once to float */
ALWAYS_INLINE __m128 totals_pd(const __m256d v[4]) {
    const __m256d h01 = _mm256_hadd_pd(v[0], v[1]), h23 = _mm256_hadd_pd(v[2], v[3]);
    return _mm256_cvtpd_ps(_mm256_add_pd(_mm256_permute2f128_pd(h01, h23, 0x20),
                                         _mm256_permute2f128_pd(h01, h23, 0x31)));
}

/* [sum v[0], .., sum v[3]] of int32 lanes whose absolute sums fit int32, converted to float */
ALWAYS_INLINE __m128 totals_i32(const __m256i v[4]) {
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    return _mm_cvtepi32_ps(_mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}

/* The sums of 4 (row, block) pairs ("slots": the rows of a group's first block, then of its second ..)
 * waiting for their float step, taken 4 at once: a row's blocks share the horizontal sums' cost */
typedef struct {
    __m256d isum[4]; /* 4 exact partial sums of isum */
    __m256i mins[4]; /* the 8 int32 lanes of msum (Q4_K, Q5_K) */
    float dx[4], d[4], dmin[4];
} Slots;

ALWAYS_INLINE void clear_slots(Slots *s) {
    for (int i = 0; i < 4; i++) {
        s->isum[i] = _mm256_setzero_pd();
        s->mins[i] = _mm256_setzero_si256();
        s->dx[i] = s->d[i] = s->dmin[i] = 0.0f;
    }
}

/* acc + the slots' terms (dx*d) * isum - (dx*dmin) * msum (Q6_K: (dx*d) * isum): row r in lane r, `blocks`
 * blocks of `rows` rows in block order (the lanes past `rows` hold nothing a row reads) */
ALWAYS_INLINE __m128 add_slots(__m128 acc, const Slots *s, const int rows, const int blocks, const int kind) {
    const __m128 dx = _mm_setr_ps(s->dx[0], s->dx[1], s->dx[2], s->dx[3]);
    const __m128 d = _mm_setr_ps(s->d[0], s->d[1], s->d[2], s->d[3]);
    __m128 t = _mm_mul_ps(_mm_mul_ps(dx, d), totals_pd(s->isum));
    if (kind != 6) {
        const __m128 dmin = _mm_setr_ps(s->dmin[0], s->dmin[1], s->dmin[2], s->dmin[3]);
        t = _mm_sub_ps(t, _mm_mul_ps(_mm_mul_ps(dx, dmin), totals_i32(s->mins)));
    }
    for (int i = 0; i < blocks; i++) {
        acc = rows == 1 ? _mm_add_ss(acc, t) : _mm_add_ps(acc, t);
        t = rows == 1 ? _mm_shuffle_ps(t, t, 0x39) : _mm_movehl_ps(t, t);
    }
    return acc;
}

/* sums[r] = the int32 lanes of isum = sum_i (sc_j(i) * q_i) * qx_i of a Q4_K / Q5_K block, 32 per lane */
ALWAYS_INLINE void q45_isums(const uint8_t *block, const int kind, uint64_t sc, const ActBlock256 *const a[DOT_ROWS],
                             const int rows, __m256i sums[DOT_ROWS]) {
    const uint8_t *qs = block + (kind == 5 ? Q5_K_QS : Q4_K_QS), *qh = block + Q5_K_QH;
    uint32_t pairs[8];
    scale_pairs(_mm_cvtsi64_si128((long long)sc), 0, pairs);
    const __m256i nibble = _mm256_set1_epi16(0x0f), bit4 = _mm256_set1_epi16(0x10);
#pragma GCC unroll 2
    for (int t = 0; t < 2; t++) { /* values 16t .. 16t+15 of each sub-block */
        const __m256i high = kind == 5 ? load_u8x16(qh + 16 * t) : _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) { /* sub-blocks 2c (low nibbles) and 2c+1 (high) */
            const __m256i v = load_u8x16(qs + 32 * c + 16 * t);
            __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_srli_epi16(v, 4);
            if (kind == 5) { /* fifth bits: bit 2c (2c+1) of each qh byte */
                lo = _mm256_or_si256(lo, _mm256_and_si256(bit_to4(high, 2 * c), bit4));
                hi = _mm256_or_si256(hi, _mm256_and_si256(bit_to4(high, 2 * c + 1), bit4));
            }
            lo = _mm256_mullo_epi16(lo, scale16(pairs, 2 * c));
            hi = _mm256_mullo_epi16(hi, scale16(pairs, 2 * c + 1));
            for (int r = 0; r < rows; r++)
                sums[r] = dot16(dot16(sums[r], lo, a[r]->q + 64 * c + 16 * t), hi, a[r]->q + 64 * c + 32 + 16 * t);
        }
    }
}

/* sums[r] = the int32 lanes of half h of a Q6_K block's isum: sum_i (scales_j(i) * (q_i - 32)) * qx_i, 16 per
 * lane (pairs: the block's scale_pairs) */
ALWAYS_INLINE void q6_isums(const uint8_t *block, int h, const uint32_t *pairs, const ActBlock256 *const a[DOT_ROWS],
                            const int rows, __m256i sums[DOT_ROWS]) {
    const __m256i nibble = _mm256_set1_epi16(0x0f), two = _mm256_set1_epi16(0x30), off = _mm256_set1_epi16(32);
#pragma GCC unroll 2
    for (int t = 0; t < 2; t++) { /* values 16t .. 16t+15 of each 32 */
        const __m256i qh = load_u8x16(block + Q6_K_QH + 32 * h + 16 * t);
        const __m256i l[2] = {load_u8x16(block + Q6_K_QL + 64 * h + 16 * t),
                              load_u8x16(block + Q6_K_QL + 64 * h + 32 + 16 * t)};
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) { /* values 32p + 16t .. of the half: sub-block 8h + 2p + t */
            const __m256i low = p < 2 ? _mm256_and_si256(l[p], nibble) : _mm256_srli_epi16(l[p - 2], 4);
            const __m256i q = _mm256_or_si256(low, _mm256_and_si256(bit_to4(qh, 2 * p), two));
            const __m256i wq = _mm256_mullo_epi16(_mm256_sub_epi16(q, off), scale16(pairs, 8 * h + 2 * p + t));
            for (int r = 0; r < rows; r++)
                sums[r] = dot16(sums[r], wq, a[r]->q + 128 * h + 32 * p + 16 * t);
        }
    }
}

/* a block's slots base .. base + rows - 1 */
ALWAYS_INLINE void block_slots(const uint8_t *w, const int kind, const ActBlock256 *const a[DOT_ROWS],
                               const int rows, Slots *s, int base) {
    uint64_t sc = 0, m = 0;
    uint32_t pairs[16];
    if (kind == 6) {
        scale_pairs(_mm_loadl_epi64((const __m128i *)(w + Q6_K_SCALES)), 1, pairs);
        scale_pairs(_mm_loadl_epi64((const __m128i *)(w + Q6_K_SCALES + 8)), 1, pairs + 8);
    } else {
        unpack_scales(w + Q4_K_SCALES, &sc, &m);
    }
    for (int h = 0; h < (kind == 6 ? 2 : 1); h++) { /* Q6_K: one int32 accumulator per half */
        __m256i sums[DOT_ROWS];
        for (int r = 0; r < DOT_ROWS; r++)
            sums[r] = _mm256_setzero_si256();
        if (kind == 6)
            q6_isums(w, h, pairs, a, rows, sums);
        else
            q45_isums(w, kind, sc, a, rows, sums);
        for (int r = 0; r < rows; r++)
            s->isum[base + r] = _mm256_add_pd(s->isum[base + r], lanes_pd(sums[r]));
    }
    /* msum's lanes: bsums[0..7] * (m0 m0 m1 m1 .. m3 m3) + bsums[8..15] * (m4 m4 .. m7 m7) */
    const __m128i m2 = _mm_unpacklo_epi8(_mm_cvtsi64_si128((long long)m), _mm_cvtsi64_si128((long long)m));
    const __m256i m_lo = _mm256_cvtepu8_epi32(m2), m_hi = _mm256_cvtepu8_epi32(_mm_srli_si128(m2, 8));
    const float d = fast_half(kind == 6 ? w + Q6_K_D : w), dmin = kind == 6 ? 0.0f : fast_half(w + 2);
    for (int r = 0; r < rows; r++) {
        const __m256i *bsums = (const __m256i *)a[r]->bsums;
        if (kind != 6)
            s->mins[base + r] = _mm256_add_epi32(_mm256_mullo_epi32(_mm256_loadu_si256(bsums), m_lo),
                                                 _mm256_mullo_epi32(_mm256_loadu_si256(bsums + 1), m_hi));
        s->dx[base + r] = a[r]->d;
        s->d[base + r] = d;
        s->dmin[base + r] = dmin;
    }
}

/* acc + the terms of blocks b .. b + blocks - 1 (blocks * rows <= 4) */
ALWAYS_INLINE __m128 add_group(__m128 acc, const uint8_t *w, const char *acts, size_t act_bytes, const int rows,
                               const int blocks, int64_t b, const int kind) {
    Slots s;
    clear_slots(&s);
#pragma GCC unroll 4
    for (int i = 0; i < blocks; i++) {
        const ActBlock256 *a[DOT_ROWS];
        for (int r = 0; r < rows; r++)
            a[r] = (const ActBlock256 *)(acts + (size_t)r * act_bytes) + b + i;
        block_slots(w + i * kind_bytes(kind), kind, a, rows, &s, i * rows);
    }
    return add_slots(acc, &s, rows, blocks, kind);
}

ALWAYS_INLINE void dot_rows_of(const uint8_t *w, const char *acts, size_t act_bytes, const int rows, int64_t blocks,
                               float *out, int64_t stride, const int kind) {
    const int group = DOT_ROWS / rows; /* blocks per group: 4 slots */
    __m128 acc = _mm_setzero_ps();
    int64_t b = 0;
    for (; b + group <= blocks; b += group)
        acc = add_group(acc, w + b * kind_bytes(kind), acts, act_bytes, rows, group, b, kind);
    for (; b < blocks; b++)
        acc = add_group(acc, w + b * kind_bytes(kind), acts, act_bytes, rows, 1, b, kind);
    float o[DOT_ROWS];
    _mm_storeu_ps(o, acc);
    for (int r = 0; r < rows; r++)
        out[r * stride] = o[r];
}

/* rows a constant in each call: the loops over them unroll and their sums stay in registers */
ALWAYS_INLINE void dot_kind(const uint8_t *w, const void *acts, size_t act_bytes, int64_t rows, int64_t blocks,
                            float *out, int64_t stride, const int kind) {
    switch (rows) {
    case 1: dot_rows_of(w, acts, act_bytes, 1, blocks, out, stride, kind); break;
    case 2: dot_rows_of(w, acts, act_bytes, 2, blocks, out, stride, kind); break;
    case 3: dot_rows_of(w, acts, act_bytes, 3, blocks, out, stride, kind); break;
    default: dot_rows_of(w, acts, act_bytes, 4, blocks, out, stride, kind); break;
    }
}

#else /* ---- the dots, plain C: each block decoded once to int16 w_i, the same integers and float steps ---- */

/* a block's w_i: sc_j(i) * q_i (Q4_K, Q5_K) or scales_j(i) * (q_i - 32) (Q6_K) */
static void block_weights(const uint8_t *block, int kind, uint64_t sc, int16_t *w) {
    uint8_t q[32];
    for (int j = 0; j < 8; j++) {
        if (kind == 6)
            q6_part(block, j / 4, j % 4, q);
        else
            sub_block_q(block + (kind == 5 ? Q5_K_QS : Q4_K_QS), kind == 5 ? block + Q5_K_QH : NULL, j, q);
        for (int i = 0; i < 32; i++)
            w[32 * j + i] = (int16_t)(kind == 6 ? ((const int8_t *)block)[Q6_K_SCALES + 2 * j + i / 16] * (q[i] - 32)
                                                : byte_of(sc, j) * q[i]);
    }
}

static inline void dot_kind(const uint8_t *w, const void *acts, size_t act_bytes, int64_t rows, int64_t blocks,
                            float *out, int64_t stride, int kind) {
    float acc[DOT_ROWS] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t b = 0; b < blocks; b++, w += kind_bytes(kind)) {
        const float d = fast_half(kind == 6 ? w + Q6_K_D : w), dmin = kind == 6 ? 0.0f : fast_half(w + 2);
        uint64_t sc = 0, mins = 0;
        if (kind != 6)
            unpack_scales(w + Q4_K_SCALES, &sc, &mins);
        int16_t wq[QK_K];
        block_weights(w, kind, sc, wq);
        for (int64_t r = 0; r < rows; r++) {
            const ActBlock256 *a = (const ActBlock256 *)((const char *)acts + r * act_bytes) + b;
            int64_t isum = 0; /* exact: |isum| < 2^35 */
            int32_t msum = 0; /* exact: |msum| < 2^29 */
            for (int i = 0; i < QK_K; i++)
                isum += (int32_t)wq[i] * a->q[i];
            for (int j = 0; j < 8; j++)
                msum += byte_of(mins, j) * (a->bsums[2 * j] + a->bsums[2 * j + 1]);
            const float high = (a->d * d) * (float)isum;
            acc[r] = acc[r] + (kind == 6 ? high : high - (a->d * dmin) * (float)msum);
        }
    }
    for (int64_t r = 0; r < rows; r++)
        out[r * stride] = acc[r];
}

#endif

static void dot_q4_k(const uint8_t *w, const void *acts, size_t act_bytes, int64_t rows, int64_t blocks, float *out,
                     int64_t stride) {
    dot_kind(w, acts, act_bytes, rows, blocks, out, stride, 4);
}

static void dot_q5_k(const uint8_t *w, const void *acts, size_t act_bytes, int64_t rows, int64_t blocks, float *out,
                     int64_t stride) {
    dot_kind(w, acts, act_bytes, rows, blocks, out, stride, 5);
}

static void dot_q6_k(const uint8_t *w, const void *acts, size_t act_bytes, int64_t rows, int64_t blocks, float *out,
                     int64_t stride) {
    dot_kind(w, acts, act_bytes, rows, blocks, out, stride, 6);
}

const BlockFormat FORMAT_Q4_K = {GGML_Q4_K, QK_K, Q4_K_BYTES, dequantize_q4_k, dot_q4_k};
const BlockFormat FORMAT_Q5_K = {GGML_Q5_K, QK_K, Q5_K_BYTES, dequantize_q5_k, dot_q5_k};
const BlockFormat FORMAT_Q6_K = {GGML_Q6_K, QK_K, Q6_K_BYTES, dequantize_q6_k, dot_q6_k};
