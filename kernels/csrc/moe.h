/* The mixture-of-experts block of csrc/moe.c, as its callers (kernels/moe.py, csrc/decode_layers.c) see it. */
#ifndef BATCHSERVE_MOE_H
#define BATCHSERVE_MOE_H

#include <stdint.h>

#include "projection.h"

/* A projection per expert, stacked: expert e's panels start e * packed_stride bytes in, its int8 scale
 * e * scale_stride floats in (scale NULL: fp32), its bias e * bias_stride floats in (bias NULL: none). */
typedef struct {
    const void *packed;
    const float *scale;
    const float *bias;
    int64_t packed_stride, scale_stride, bias_stride;
} StackedProjection;

typedef struct {
    Projection router;                                   /* fp32 panels, num_experts outputs (+ bias) */
    StackedProjection gate_up, down;                     /* this rank's experts: gate | up [2I, H], down [H, I] */
    Projection shared_gate_up, shared_down, shared_gate; /* shared_gate_up.packed NULL: no shared expert */
    int64_t *load;                                       /* [num_experts] tokens routed to each, added to; or NULL */
    int64_t num_experts, first, count, top_k, renormalize, hidden, intermediate, shared_intermediate;
} MoeBlock;

int moe_block(const MoeBlock *m, const float *x, int64_t rows, int64_t x_stride, float *out);

#endif
