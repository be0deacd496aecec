"""The models' linear and embedding layers, shaped for tensor parallelism as vLLM's and SGLang's are,
on one rank for now: each layer holds its whole weight, packed once at load
(`kernels.ops.pack_linear_weight`: on the CPU the C kernel's panels, fp32 or int8).

Splitting a model over ranks is a change of these classes, not of the models:
- `ColumnParallelLinear` splits the output features, each fused part (q | k | v, gate | up) on its own;
  its output stays split, as the rank's attention heads or SiLU-and-mul and the row layer after them take it.
- `RowParallelLinear` splits the input features; the ranks' partial products are summed by an
  all-reduce, and the bias is added once.
- `VocabParallelEmbedding` splits the vocabulary; a rank embeds the ids in its rows, zeros for the others,
  and an all-reduce sums them.
- `ParallelLMHead` splits the vocabulary of the logits; the ranks' logits are gathered.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kernels.ops import LinearWeight, linear, pack_linear_weight


class _Linear:
    """x @ weight.T (+ bias) on the packed weight."""

    weight: LinearWeight
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class ColumnParallelLinear(_Linear):
    """The projections `parts` [out_i, in] (with `biases` [out_i]) fused along the output features."""

    def __init__(self, parts: Sequence[torch.Tensor], biases: Sequence[torch.Tensor] | None, quantization: str):
        self.weight = pack_linear_weight(torch.cat(list(parts), dim=0), quantization)
        self.bias = None if biases is None else torch.cat(list(biases), dim=0)


class RowParallelLinear(_Linear):
    """One projection [out, in] (with `bias` [out]) that takes a column layer's output."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, quantization: str):
        self.weight = pack_linear_weight(weight, quantization)
        self.bias = bias


class VocabParallelEmbedding:
    """Token ids -> rows of the embedding table [vocab, hidden]."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


class ParallelLMHead:
    """Hidden rows -> float32 logits over the vocabulary, from a weight [vocab, hidden] (the embedding
    table where the model ties them: a packed copy where packing applies)."""

    def __init__(self, weight: torch.Tensor, quantization: str):
        self.weight = pack_linear_weight(weight, quantization)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.weight).float()
