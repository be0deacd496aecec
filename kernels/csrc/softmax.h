/* The attention kernels' softmax over one query's scores (kernels/csrc/paged_*_attention.c). */
#ifndef BATCHSERVE_SOFTMAX_H
#define BATCHSERVE_SOFTMAX_H

#include <math.h>
#include <stdint.h>

#include "vec8.h"

/* In place: scores[0:len] become softmax probabilities (soft-capped first when softcap > 0), over the
 * scores and a `sink` logit (-INFINITY: none) whose share of the total is dropped. */
static inline void softmax(float *scores, int64_t len, float softcap, float sink) {
    if (softcap > 0.0f)
        for (int64_t t = 0; t < len; t++) scores[t] = tanhf(scores[t] / softcap) * softcap;
    /* the max 8 lanes at a time (a scalar chain waits on each compare); any order gives the same max */
    vec8 maxes = splat8(sink);
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) {
        const vec8 s = load8(scores + t);
        maxes = select8(s > maxes, s, maxes);
    }
    float max = sink, total = 0.0f;
    for (int lane = 0; lane < 8; lane++) max = maxes[lane] > max ? maxes[lane] : max;
    for (; t < len; t++) max = scores[t] > max ? scores[t] : max;
    t = 0;
    vec8 totals = splat8(0.0f);
    for (; t + 8 <= len; t += 8) {
        const vec8 e = exp8(load8(scores + t) - splat8(max));
        store8(scores + t, e);
        totals += e;
    }
    total = sum8(totals) + (sink > -INFINITY ? expf(sink - max) : 0.0f);
    for (; t < len; t++) {
        scores[t] = expf(scores[t] - max);
        total += scores[t];
    }
    const float inv = 1.0f / total;
    for (t = 0; t < len; t++) scores[t] *= inv;
}

#endif
