/* 8-float vectors for the C kernels: GCC/Clang vector extensions, compiled to AVX2 where
 * -march=native has it (and to narrower instructions elsewhere), with the few helpers the kernels share. */
#ifndef BATCHSERVE_VEC8_H
#define BATCHSERVE_VEC8_H

#include <stdint.h>
#include <string.h>

typedef float vec8 __attribute__((vector_size(32)));
typedef int32_t ivec8 __attribute__((vector_size(32))); /* comparisons of vec8 give -1 (true) / 0 lanes */

static inline vec8 load8(const float *p) {
    vec8 v;
    memcpy(&v, p, sizeof v); /* an unaligned load */
    return v;
}

static inline void store8(float *p, vec8 v) { memcpy(p, &v, sizeof v); }

static inline vec8 splat8(float x) { return (vec8){x, x, x, x, x, x, x, x}; }

/* Rows below this many floats run on one thread: a decode batch is not worth the fork. */
enum { PARALLEL_MIN_FLOATS = 1 << 15 };

static inline float sum8(vec8 v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }

/* ln(FLT_MAX): the largest x whose e^x is a finite float. */
#define EXP_MAX_ARG 88.7228391f

/* mask ? a : b, lane by lane (C has no vector ?:). */
static inline vec8 select8(ivec8 mask, vec8 a, vec8 b) {
    ivec8 ia, ib;
    memcpy(&ia, &a, sizeof a);
    memcpy(&ib, &b, sizeof b);
    const ivec8 picked = (ia & mask) | (ib & ~mask);
    vec8 out;
    memcpy(&out, &picked, sizeof out);
    return out;
}

/* e^x within ~2 ulp of expf for x in [-87, 88.72] (clamped outside: e^x under/overflows there anyway):
 * x = n ln2 + r with |r| <= ln2/2, e^r by Cephes' degree-6 polynomial, 2^n built in the exponent bits. */
static inline vec8 exp8(vec8 x) {
    x = select8(x < splat8(-87.0f), splat8(-87.0f), x);
    x = select8(x > splat8(EXP_MAX_ARG), splat8(EXP_MAX_ARG), x);
    const vec8 t = x * splat8(1.44269504088896341f) + splat8(0.5f);
    ivec8 n_int = __builtin_convertvector(t, ivec8); /* truncation toward zero ... */
    n_int += (ivec8)(__builtin_convertvector(n_int, vec8) > t); /* ... made floor: n = round(x / ln2) */
    const vec8 n = __builtin_convertvector(n_int, vec8);
    const vec8 r = (x - n * splat8(0.693359375f)) + n * splat8(2.12194440e-4f); /* ln2 in two parts */
    vec8 p = splat8(1.9875691500e-4f);
    p = p * r + splat8(1.3981999507e-3f);
    p = p * r + splat8(8.3334519073e-3f);
    p = p * r + splat8(4.1665795894e-2f);
    p = p * r + splat8(1.6666665459e-1f);
    p = p * r + splat8(5.0000001201e-1f);
    p = p * r * r + r + splat8(1.0f);
    /* 2^n in two factors: n reaches 128 near the top, one past the largest normal exponent */
    const ivec8 half_n = n_int >> 1;
    const ivec8 bits_a = (half_n + 127) << 23, bits_b = (n_int - half_n + 127) << 23;
    vec8 two_a, two_b;
    memcpy(&two_a, &bits_a, sizeof two_a);
    memcpy(&two_b, &bits_b, sizeof two_b);
    return p * two_a * two_b;
}

#endif
