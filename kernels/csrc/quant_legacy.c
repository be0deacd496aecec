/* ggml's 32-value block types (csrc/quant_blocks.h): Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and MXFP4, their
 * de-quantization (gguf-py's numpy formulas, bit for bit) and their dot with int16 activation rows.
 *
 * A block's dot starts from an exact integer sum isum = sum_i w_i * q_i over its 32 values (w_i the block's
 * integers: Q8_0 its signed byte, Q4_0 nibble - 8, Q5_0 5-bit value - 16, Q4_1/Q5_1 the unsigned value, MXFP4
 * twice its e2m1 value). |w_i| <= 128 and |q_i| <= 32767, so |isum| <= 32 * 128 * 32767 < 2^27: exact in
 * int32, as is every partial sum (the AVX2 path's sums of stored values u <= 128 too). Then, each product
 * and sum rounded on its own (no FMA in this file), for the row's blocks b = 0, 1, ... in order:
 *     term_b = (d_w * d_x) * (float)isum                                 (Q8_0, Q4_0, Q5_0, MXFP4)
 *     term_b = (d_w * d_x) * (float)isum + (m_w * d_x) * (float)qsum    (Q4_1, Q5_1: w = d_w * u + m_w)
 *     acc[b % 8] = acc[b % 8] + term_b                                   (acc[0..7] = +0 to begin with)
 *     dot = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
 * (float)isum is exact below 2^24 and rounds to nearest even above (cvtdq2ps and cvtsi2ss alike). MXFP4's d_w
 * is its e8m0 scale halved (its integers are doubled).
 *
 * AVX2: each weight block is widened once to 32 int16 lanes (its stored values u; the offset of Q4_0, Q5_0
 * and MXFP4 comes off as isum = sum u q - c * qsum) and multiplied with every activation row of the call
 * (vpmaddwd, or vpdpwssd where the CPU has AVX512-VNNI or AVX-VNNI). Eight blocks' 8-lane sums are reduced
 * together to one vector of their eight isums, whose terms are computed lane by lane and added to acc as one
 * float vector (lane i: block 8 g + i): no per-block horizontal sum, no chain of scalar adds. The plain C
 * path does the same float operations a lane at a time. The integer sums are exact on every path and a
 * row's arithmetic never involves another row, so a row's result is the same bits on every path (AVX2,
 * VNNI, plain C) and whatever rows share its call. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "quant_blocks.h"

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* GCC contracts a * b + c to an FMA across statements (and intrinsics) under -std=gnu11; clang only within
 * one expression unless told */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#define ALWAYS_INLINE inline __attribute__((always_inline))

enum { Q8_0_BYTES = 34, Q4_0_BYTES = 18, Q4_1_BYTES = 20, Q5_0_BYTES = 22, Q5_1_BYTES = 24, MXFP4_BYTES = 17 };

/* how far ahead of the block it decodes the AVX2 dot asks for weight bytes: a decode step streams the
 * weights from memory, and the hardware prefetcher alone leaves the loop waiting on some of them
 * (measured on 50 MB of Q4_0: 0 to 18 % more bytes per second than without; 2 to 64 KB ahead, into L1 or
 * L2, all alike) */
enum { PREFETCH_BYTES = 2048 };

/* MXFP4's e2m1 values, doubled (gguf-py's `kvalues`): index 8 is -0, here 0 */
static const int8_t E2M1_TWICE[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline float fp16(const uint8_t *p) {
#ifdef __F16C__
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h); /* exact, as half_to_float */
#else
    return read_half(p);
#endif
}

/* e8m0 scale 2^(e - 127), halved: ggml_e8m0_to_fp32_half (e < 2: the subnormals 2^-128, 2^-127) */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint32_t read_u32(const uint8_t *p) { /* Q5's high bits: a little-endian uint32 (as x86, arm64) */
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* ---- de-quantization: numpy's float32 operations, one rounding each, in its order ---- */

static void dequantize_q8_0(const uint8_t *restrict src, int64_t blocks, float *restrict out) {
    for (int64_t b = 0; b < blocks; b++, src += Q8_0_BYTES, out += QK) {
        const float d = fp16(src);
        for (int i = 0; i < QK; i++)
            out[i] = (float)(int8_t)src[2 + i] * d;
    }
}

static void dequantize_q4_0(const uint8_t *restrict src, int64_t blocks, float *restrict out) {
    for (int64_t b = 0; b < blocks; b++, src += Q4_0_BYTES, out += QK) {
        const float d = fp16(src);
        for (int j = 0; j < QK / 2; j++) {
            out[j] = d * (float)((src[2 + j] & 15) - 8);
            out[j + QK / 2] = d * (float)((src[2 + j] >> 4) - 8);
        }
    }
}

static void dequantize_q4_1(const uint8_t *restrict src, int64_t blocks, float *restrict out) {
    for (int64_t b = 0; b < blocks; b++, src += Q4_1_BYTES, out += QK) {
        const float d = fp16(src), m = fp16(src + 2);
        for (int j = 0; j < QK / 2; j++) {
            const float lo = d * (float)(src[4 + j] & 15), hi = d * (float)(src[4 + j] >> 4);
            out[j] = lo + m; /* (d * q) + m, as gguf-py: two roundings */
            out[j + QK / 2] = hi + m;
        }
    }
}

/* the 32 five-bit values of a Q5 block: nibbles `qs`, bit i of `qh` the fifth bit of value i */
static inline void q5_values(const uint8_t *qh_bytes, const uint8_t *qs, int32_t *u) {
    const uint32_t qh = read_u32(qh_bytes);
    for (int j = 0; j < QK / 2; j++) {
        u[j] = (qs[j] & 15) | (int32_t)((qh >> j) & 1) << 4;
        u[j + QK / 2] = (qs[j] >> 4) | (int32_t)((qh >> (j + QK / 2)) & 1) << 4;
    }
}

static void dequantize_q5_0(const uint8_t *restrict src, int64_t blocks, float *restrict out) {
    for (int64_t b = 0; b < blocks; b++, src += Q5_0_BYTES, out += QK) {
        const float d = fp16(src);
        int32_t u[QK];
        q5_values(src + 2, src + 6, u);
        for (int i = 0; i < QK; i++)
            out[i] = d * (float)(u[i] - 16);
    }
}

static void dequantize_q5_1(const uint8_t *restrict src, int64_t blocks, float *restrict out) {
    for (int64_t b = 0; b < blocks; b++, src += Q5_1_BYTES, out += QK) {
        const float d = fp16(src), m = fp16(src + 2);
        int32_t u[QK];
        q5_values(src + 4, src + 8, u);
        for (int i = 0; i < QK; i++) {
            const float du = d * (float)u[i];
            out[i] = du + m;
        }
    }
}

static void dequantize_mxfp4(const uint8_t *restrict src, int64_t blocks, float *restrict out) {
    for (int64_t b = 0; b < blocks; b++, src += MXFP4_BYTES, out += QK) {
        const float d = e8m0_half(src[0]);
        for (int j = 0; j < QK / 2; j++) {
            out[j] = d * (float)E2M1_TWICE[src[1 + j] & 15];
            out[j + QK / 2] = d * (float)E2M1_TWICE[src[1 + j] >> 4];
        }
    }
}

/* ---- the dots: the header's formula ---- */

/* How a type's block reads: its bytes, where its values start, the offset c of its stored values u
 * (w = u - c: isum = sum u q - c qsum), its scale and minimum */
typedef struct {
    int64_t bytes, values, offset;
    int scale_e8m0, has_min;
} Layout;

/* the blocks: fp16 d [fp16 m] [uint32 qh] then the values; MXFP4: an e8m0 byte then the nibbles */
static const Layout Q8_0 = {.bytes = Q8_0_BYTES, .values = 2};
static const Layout Q4_0 = {.bytes = Q4_0_BYTES, .values = 2, .offset = 8};
static const Layout Q4_1 = {.bytes = Q4_1_BYTES, .values = 4, .has_min = 1};
static const Layout Q5_0 = {.bytes = Q5_0_BYTES, .values = 6, .offset = 16};
static const Layout Q5_1 = {.bytes = Q5_1_BYTES, .values = 8, .has_min = 1};
static const Layout MXFP4 = {.bytes = MXFP4_BYTES, .values = 1, .offset = 12, .scale_e8m0 = 1};

static inline float block_scale(const uint8_t *w, const Layout l) {
    return l.scale_e8m0 ? e8m0_half(w[0]) : fp16(w);
}

static inline float block_min(const uint8_t *w, const Layout l) { return l.has_min ? fp16(w + 2) : 0.0f; }

/* one block's term from its sum of u * q: (d_w * d_x) * isum [+ (m_w * d_x) * qsum], each step rounded */
static inline float block_term(const uint8_t *w, const ActBlock32 *a, int32_t usum, const Layout l) {
    const float d = block_scale(w, l) * a->d, main = d * (float)(usum - (int32_t)l.offset * a->qsum);
    if (!l.has_min)
        return main;
    const float m = block_min(w, l) * a->d, low = m * (float)a->qsum;
    return main + low;
}

/* the eight accumulators to the dot, in the header's order */
static inline float reduce8(const float acc[8]) {
    const float s0 = acc[0] + acc[4], s1 = acc[1] + acc[5], s2 = acc[2] + acc[6], s3 = acc[3] + acc[7];
    const float t0 = s0 + s2, t1 = s1 + s3;
    return t0 + t1;
}

static inline const ActBlock32 *act_row(const void *acts, size_t row_bytes, int64_t r) {
    return (const ActBlock32 *)((const char *)acts + (size_t)r * row_bytes);
}

#ifdef __AVX2__

/* a block's 32 integers u as int16: values 0..15 and 16..31 */
typedef struct {
    __m256i lo, hi;
} Ints16;

static inline __m128i load128(const void *p) { return _mm_loadu_si128((const __m128i *)p); }
static inline __m256i load256(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

static inline Ints16 ints_q8_0(const uint8_t *w) {
    return (Ints16){_mm256_cvtepi8_epi16(load128(w + 2)), _mm256_cvtepi8_epi16(load128(w + 18))};
}

/* 16 bytes of nibbles: the low nibbles are values 0..15, the high ones 16..31 */
static inline Ints16 nibbles16(const uint8_t *qs) {
    const __m256i bytes = _mm256_cvtepu8_epi16(load128(qs));
    return (Ints16){_mm256_and_si256(bytes, _mm256_set1_epi16(15)), _mm256_srli_epi16(bytes, 4)};
}

static inline Ints16 ints_q4_0(const uint8_t *w) { return nibbles16(w + 2); }
static inline Ints16 ints_q4_1(const uint8_t *w) { return nibbles16(w + 4); }

/* Q5's fifth bits as 16 or 0: word i of the first vector bit i of qh, of the second bit 16 + i. Word i gets
 * qh's byte i / 8 as its high byte, keeps its bit k = i % 8 (2^(8 + k) or 0), and the high half of its
 * product with 2^(12 - k) is 16 or 0. */
static inline Ints16 fifth_bits(const uint8_t *qh) {
    const __m256i h = _mm256_set1_epi32((int32_t)read_u32(qh));
    const __m256i bit = _mm256_setr_epi16(1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12, 1 << 13, 1 << 14, 1 << 15, 1 << 8,
                                          1 << 9, 1 << 10, 1 << 11, 1 << 12, 1 << 13, 1 << 14, 1 << 15);
    const __m256i to16 = _mm256_setr_epi16(1 << 12, 1 << 11, 1 << 10, 1 << 9, 1 << 8, 1 << 7, 1 << 6, 1 << 5, 1 << 12,
                                           1 << 11, 1 << 10, 1 << 9, 1 << 8, 1 << 7, 1 << 6, 1 << 5);
    const __m256i byte[2] = {_mm256_set_m128i(_mm_set1_epi16(0x0180), _mm_set1_epi16(0x0080)),
                             _mm256_set_m128i(_mm_set1_epi16(0x0380), _mm_set1_epi16(0x0280))};
    __m256i v[2];
    for (int i = 0; i < 2; i++)
        v[i] = _mm256_mulhi_epu16(_mm256_and_si256(_mm256_shuffle_epi8(h, byte[i]), bit), to16);
    return (Ints16){v[0], v[1]};
}

static inline Ints16 q5_ints(const uint8_t *qh, const uint8_t *qs) {
    const Ints16 n = nibbles16(qs), high = fifth_bits(qh);
    return (Ints16){_mm256_or_si256(n.lo, high.lo), _mm256_or_si256(n.hi, high.hi)};
}

static inline Ints16 ints_q5_0(const uint8_t *w) { return q5_ints(w + 2, w + 6); }
static inline Ints16 ints_q5_1(const uint8_t *w) { return q5_ints(w + 4, w + 8); }

/* MXFP4: u = twice the e2m1 value + 12 (0..24), looked up by 15 - nibble (andnot), so that the high byte
 * of each index word, 0, looks up 0 (the value -12) */
static inline Ints16 ints_mxfp4(const uint8_t *w) {
    const __m256i table =
        _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 4, 6, 8, 9, 10, 11, 12, 24, 20, 18, 16, 15, 14, 13, 12));
    const __m256i bytes = _mm256_cvtepu8_epi16(load128(w + 1)), fifteen = _mm256_set1_epi16(15);
    return (Ints16){_mm256_shuffle_epi8(table, _mm256_andnot_si256(bytes, fifteen)),
                    _mm256_shuffle_epi8(table, _mm256_andnot_si256(_mm256_srli_epi16(bytes, 4), fifteen))};
}

typedef Ints16 Decode(const uint8_t *w);

/* sum u * q over the block as 8 int32 lanes (each lane 4 products; no overflow: see the header) */
static inline __m256i isum_lanes(const Ints16 u, const int16_t *q) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(_mm256_madd_epi16(u.lo, load256(q)), u.hi, load256(q + 16));
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(_mm256_madd_epi16(u.lo, load256(q)), u.hi, load256(q + 16));
#else
    return _mm256_add_epi32(_mm256_madd_epi16(u.lo, load256(q)), _mm256_madd_epi16(u.hi, load256(q + 16)));
#endif
}

static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
    return _mm_cvtsi128_si32(s);
}

/* Eight blocks' 8-lane sums reduced together (unpacks and adds, single micro-ops where phadd is several):
 * pair(a, b) = [a0+a2, b0+b2, a1+a3, b1+b3 | the same of lanes 4..7]; quad(pair(a, b), pair(c, d)) =
 * [a, b, c, d | a, b, c, d] summed over lanes 0..3 and 4..7; final(quad(0..3), quad(4..7)): lane i block i */
static inline __m256i fold_pair(__m256i a, __m256i b) {
    return _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
}
static inline __m256i fold_quad(__m256i ab, __m256i cd) {
    return _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
}
static inline __m256i fold_final(__m256i q0, __m256i q1) {
    return _mm256_add_epi32(_mm256_blend_epi32(q0, q1, 0xf0), _mm256_permute2x128_si256(q0, q1, 0x21));
}

/* the sums of u * q of eight blocks with R activation rows (x[r]: row r's eight blocks): lane i of sums[r]
 * is block i's; each block decoded once */
static ALWAYS_INLINE void group_sums(const uint8_t *w, const ActBlock32 *const x[], int R, int64_t bytes,
                                     Decode *decode, __m256i sums[]) {
    __m256i half[2][DOT_ROWS], pair[DOT_ROWS];
    for (int h = 0; h < 2; h++) { /* blocks 4 h .. 4 h + 3 */
        const int i = 4 * h;
        Ints16 u = decode(w + i * bytes), v = decode(w + (i + 1) * bytes);
        for (int r = 0; r < R; r++)
            pair[r] = fold_pair(isum_lanes(u, x[r][i].q), isum_lanes(v, x[r][i + 1].q));
        u = decode(w + (i + 2) * bytes), v = decode(w + (i + 3) * bytes);
        for (int r = 0; r < R; r++)
            half[h][r] = fold_quad(pair[r], fold_pair(isum_lanes(u, x[r][i + 2].q), isum_lanes(v, x[r][i + 3].q)));
    }
    for (int r = 0; r < R; r++)
        sums[r] = fold_final(half[0][r], half[1][r]);
}

/* the 16-bit (8-bit) values at p, p + s, ..., p + 7 s packed into one int64 per four (eight): gathered in
 * general-purpose registers, which the vector ports leave idle */
static inline __m128i gather_u16(const uint8_t *p, int64_t s) {
    uint64_t v[2] = {0, 0};
    for (int i = 0; i < 8; i++) {
        uint16_t h;
        memcpy(&h, p + i * s, sizeof h);
        uint64_t wide = h;
        __asm__("" : "+r"(wide)); /* keeps GCC from packing these in vector registers, shuffle by shuffle */
        v[i / 4] |= wide << (16 * (i % 4));
    }
    return _mm_set_epi64x((int64_t)v[1], (int64_t)v[0]);
}

static inline __m128i gather_u8(const uint8_t *p, int64_t s) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) {
        uint64_t wide = p[i * s];
        __asm__("" : "+r"(wide));
        v |= wide << (8 * i);
    }
    return _mm_cvtsi64_si128((int64_t)v);
}

/* the fp16 at p, p + s, ..., p + 7 s as floats (exact) */
static inline __m256 halves8(const uint8_t *p, int64_t s) {
#ifdef __F16C__
    return _mm256_cvtph_ps(gather_u16(p, s));
#else
    float f[8];
    for (int i = 0; i < 8; i++)
        f[i] = fp16(p + i * s);
    return _mm256_loadu_ps(f);
#endif
}

/* the e8m0 bytes at p, p + s, ..., p + 7 s as halved scales: e8m0_half lane by lane */
static inline __m256 e8m0_halves8(const uint8_t *p, int64_t s) {
    const __m256i e = _mm256_cvtepu8_epi32(gather_u8(p, s));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, small));
}

_Static_assert(offsetof(ActBlock32, d) == 0 && offsetof(ActBlock32, qsum) == 4, "d, qsum: an ActBlock32's 8 bytes");

/* eight activation blocks' d and qsum: the first 8 bytes of each, two blocks to a 128-bit load pair */
static inline void act_scales8(const ActBlock32 *a, __m256 *d, __m256i *qsum) {
    __m128 pairs[4];
    for (int i = 0; i < 4; i++) {
        double lo, hi; /* memcpy: the 8 bytes as one load, no aliasing through a double pointer */
        memcpy(&lo, &a[2 * i], sizeof lo);
        memcpy(&hi, &a[2 * i + 1], sizeof hi);
        pairs[i] = _mm_castpd_ps(_mm_setr_pd(lo, hi));
    }
    const __m256 x = _mm256_set_m128(pairs[2], pairs[0]), y = _mm256_set_m128(pairs[3], pairs[1]);
    *d = _mm256_shuffle_ps(x, y, _MM_SHUFFLE(2, 0, 2, 0));
    *qsum = _mm256_castps_si256(_mm256_shuffle_ps(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* eight blocks' terms, lane by lane the same operations as block_term, so the same bits */
static inline __m256 group_terms(__m256 d_w, __m256 m_w, const ActBlock32 *a, __m256i usum, const Layout l) {
    __m256 d_x;
    __m256i qsum;
    act_scales8(a, &d_x, &qsum);
    const __m256i isum = _mm256_sub_epi32(usum, _mm256_mullo_epi32(qsum, _mm256_set1_epi32((int32_t)l.offset)));
    const __m256 main = _mm256_mul_ps(_mm256_mul_ps(d_w, d_x), _mm256_cvtepi32_ps(isum));
    if (!l.has_min)
        return main;
    return _mm256_add_ps(main, _mm256_mul_ps(_mm256_mul_ps(m_w, d_x), _mm256_cvtepi32_ps(qsum)));
}

/* R (a constant once inlined) rows' dots: eight blocks at a time, then the rest one by one */
static ALWAYS_INLINE void rows_dot(const uint8_t *w, const void *acts, size_t row_bytes, int R, int64_t blocks,
                                  float *out, int64_t out_stride, const Layout l, Decode *decode) {
    const ActBlock32 *x[DOT_ROWS];
    __m256 acc[DOT_ROWS];
    for (int r = 0; r < R; r++)
        x[r] = act_row(acts, row_bytes, r), acc[r] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= blocks; b += 8, w += 8 * l.bytes) {
        const ActBlock32 *group[DOT_ROWS];
        __m256i sums[DOT_ROWS];
        for (int r = 0; r < R; r++)
            group[r] = x[r] + b;
        for (int64_t o = 0; o < 8 * l.bytes; o += 64)
            _mm_prefetch((const char *)w + PREFETCH_BYTES + o, _MM_HINT_T0);
        group_sums(w, group, R, l.bytes, decode, sums);
        const __m256 d_w = l.scale_e8m0 ? e8m0_halves8(w, l.bytes) : halves8(w, l.bytes);
        const __m256 m_w = l.has_min ? halves8(w + 2, l.bytes) : _mm256_setzero_ps();
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_add_ps(acc[r], group_terms(d_w, m_w, group[r], sums[r], l));
    }
    float lanes[DOT_ROWS][8];
    for (int r = 0; r < R; r++)
        _mm256_storeu_ps(lanes[r], acc[r]);
    for (; b < blocks; b++, w += l.bytes) {
        const Ints16 u = decode(w);
        for (int r = 0; r < R; r++)
            lanes[r][b % 8] += block_term(w, x[r] + b, hsum_i32(isum_lanes(u, x[r][b].q)), l);
    }
    for (int r = 0; r < R; r++)
        out[r * out_stride] = reduce8(lanes[r]);
}

/* `rows` made a constant: one loop per type and row count, its block code inside */
static ALWAYS_INLINE void dot_any(const uint8_t *w, const void *acts, size_t row_bytes, int64_t rows,
                                  int64_t blocks, float *out, int64_t out_stride, const Layout l, Decode *decode) {
    switch (rows) {
    case 1: rows_dot(w, acts, row_bytes, 1, blocks, out, out_stride, l, decode); break;
    case 2: rows_dot(w, acts, row_bytes, 2, blocks, out, out_stride, l, decode); break;
    case 3: rows_dot(w, acts, row_bytes, 3, blocks, out, out_stride, l, decode); break;
    default: rows_dot(w, acts, row_bytes, 4, blocks, out, out_stride, l, decode); break;
    }
}
#define DOT_ANY(layout, avx2, plain) dot_any(w, acts, row_bytes, rows, blocks, out, out_stride, layout, avx2)

#else /* plain C: the same sums and the same float operations, a block and a lane at a time */

/* a block's 32 stored values u */
static inline void ints_q8_0(const uint8_t *w, int32_t *u) {
    for (int i = 0; i < QK; i++)
        u[i] = (int8_t)w[2 + i];
}

static inline void nibbles32(const uint8_t *qs, int32_t *u) {
    for (int j = 0; j < QK / 2; j++)
        u[j] = qs[j] & 15, u[j + QK / 2] = qs[j] >> 4;
}

static inline void ints_q4_0(const uint8_t *w, int32_t *u) { nibbles32(w + 2, u); }
static inline void ints_q4_1(const uint8_t *w, int32_t *u) { nibbles32(w + 4, u); }
static inline void ints_q5_0(const uint8_t *w, int32_t *u) { q5_values(w + 2, w + 6, u); }
static inline void ints_q5_1(const uint8_t *w, int32_t *u) { q5_values(w + 4, w + 8, u); }

static inline void ints_mxfp4(const uint8_t *w, int32_t *u) {
    for (int j = 0; j < QK / 2; j++)
        u[j] = E2M1_TWICE[w[1 + j] & 15] + 12, u[j + QK / 2] = E2M1_TWICE[w[1 + j] >> 4] + 12;
}

typedef void Ints(const uint8_t *w, int32_t *u);

static ALWAYS_INLINE void dot_any(const uint8_t *w, const void *acts, size_t row_bytes, int64_t rows,
                                  int64_t blocks, float *out, int64_t out_stride, const Layout l, Ints *ints) {
    float lanes[DOT_ROWS][8] = {{0}};
    for (int64_t b = 0; b < blocks; b++, w += l.bytes) {
        int32_t u[QK];
        ints(w, u);
        for (int64_t r = 0; r < rows; r++) {
            const ActBlock32 *x = act_row(acts, row_bytes, r) + b;
            int32_t usum = 0;
            for (int i = 0; i < QK; i++)
                usum += u[i] * x->q[i];
            lanes[r][b % 8] += block_term(w, x, usum, l);
        }
    }
    for (int64_t r = 0; r < rows; r++)
        out[r * out_stride] = reduce8(lanes[r]);
}
#define DOT_ANY(layout, avx2, plain) dot_any(w, acts, row_bytes, rows, blocks, out, out_stride, layout, plain)
#endif

#define DOT_ROWS_ARGS                                                                                              \
    const uint8_t *w, const void *acts, size_t row_bytes, int64_t rows, int64_t blocks, float *out,                \
        int64_t out_stride
static void dot_q8_0(DOT_ROWS_ARGS) { DOT_ANY(Q8_0, ints_q8_0, ints_q8_0); }
static void dot_q4_0(DOT_ROWS_ARGS) { DOT_ANY(Q4_0, ints_q4_0, ints_q4_0); }
static void dot_q4_1(DOT_ROWS_ARGS) { DOT_ANY(Q4_1, ints_q4_1, ints_q4_1); }
static void dot_q5_0(DOT_ROWS_ARGS) { DOT_ANY(Q5_0, ints_q5_0, ints_q5_0); }
static void dot_q5_1(DOT_ROWS_ARGS) { DOT_ANY(Q5_1, ints_q5_1, ints_q5_1); }
static void dot_mxfp4(DOT_ROWS_ARGS) { DOT_ANY(MXFP4, ints_mxfp4, ints_mxfp4); }

const BlockFormat FORMAT_Q8_0 = {GGML_Q8_0, QK, Q8_0_BYTES, dequantize_q8_0, dot_q8_0};
const BlockFormat FORMAT_Q4_0 = {GGML_Q4_0, QK, Q4_0_BYTES, dequantize_q4_0, dot_q4_0};
const BlockFormat FORMAT_Q4_1 = {GGML_Q4_1, QK, Q4_1_BYTES, dequantize_q4_1, dot_q4_1};
const BlockFormat FORMAT_Q5_0 = {GGML_Q5_0, QK, Q5_0_BYTES, dequantize_q5_0, dot_q5_0};
const BlockFormat FORMAT_Q5_1 = {GGML_Q5_1, QK, Q5_1_BYTES, dequantize_q5_1, dot_q5_1};
const BlockFormat FORMAT_MXFP4 = {GGML_MXFP4, QK, MXFP4_BYTES, dequantize_mxfp4, dot_mxfp4};
