"""The models' linear and embedding layers, split over the worker's tensor-parallel ranks
(`procs.worker.parallel.TensorParallel`) as Megatron-LM, vLLM and SGLang split them. Each layer holds
this rank's shard, cut by the loader (`procs.worker.models.weights.WeightTaker`) and packed once
(`kernels.ops.pack_linear_weight`: on the CPU the C kernel's panels, fp32 or int8):
- `ColumnParallelLinear` holds this rank's output features of each fused part (q | k | v, gate | up);
  its output stays split, as the rank's attention heads or SiLU-and-mul and the row layer after them take it.
- `RowParallelLinear` holds this rank's input features; the ranks' partial products are summed by one
  all-reduce, and the bias is added once, after it.
- `GatedMLP`: gate | up, SiLU-and-mul, down, of a dense layer or a shared expert.
- `VocabParallelEmbedding` holds rows [start, start + rows) of the vocabulary; a rank embeds the ids
  in its rows, zeros for the others, and an all-reduce sums them.
- `ParallelLMHead` holds the same vocabulary rows of the logits (the embedding's own shard where the
  model ties them); the ranks' logits are gathered, every rank getting all of them.
Vocabulary-parallel rather than replicated: the two vocab-sized tables are each a rank's share of the
memory, as the rest of the model, and each rank reads only its share of the LM head in a decode step.
With one rank every collective is the identity.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from batchserve.kernels.ops import GATED_ACTIVATIONS, LinearWeight, linear, pack_linear_parts, pack_linear_weight
from batchserve.kernels.quant_blocks import BlockWeight
from batchserve.procs.worker.parallel import TensorParallel


class _Linear:
    """x @ weight.T (+ bias) on the packed weight; with `lora` (`procs.worker.lora.slots.LoraTarget`), the step's
    adapters' rows get their LoRA pairs added."""

    weight: LinearWeight
    bias: torch.Tensor | None
    lora: Any = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight, self.bias)
        return out if self.lora is None or not self.lora.slots.active else self.lora.add_to(x, out)


class ColumnParallelLinear(_Linear):
    """The projections `parts` [out_i / ranks, in] (with `biases`) fused along the output features."""

    def __init__(
        self, parts: Sequence[torch.Tensor | BlockWeight], biases: Sequence[torch.Tensor] | None, quantization: str
    ):
        self.weight = pack_linear_parts(parts, quantization)
        self.bias = None if biases is None else torch.cat(list(biases), dim=0)


class RowParallelLinear(_Linear):
    """One projection's input columns [out, in / ranks] (the whole `bias` [out]), summed over the ranks;
    with `reduce` False this rank's partial product alone, which its caller sums (an MoE block sums its
    experts' and its shared expert's partial outputs in one all-reduce)."""

    def __init__(
        self,
        weight: torch.Tensor | BlockWeight,
        bias: torch.Tensor | None,
        quantization: str,
        tp: TensorParallel,
        *,
        reduce: bool = True,
    ):
        self.weight = pack_linear_weight(weight, quantization)
        self.bias = bias
        self.tp = tp
        self.reduce = reduce

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1 or not self.reduce:
            return super().__call__(x)
        out = linear(x, self.weight)
        if self.lora is not None and self.lora.slots.active:  # this rank's share of the LoRA term, summed below
            out = self.lora.add_to(x, out)
        out = self.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias


class GatedMLP:
    """down(act(gate) * up), act SiLU or GELU-tanh (`GATED_ACTIVATIONS`): a dense layer's MLP, or a mixture
    of experts' shared expert."""

    def __init__(self, gate_up: ColumnParallelLinear, down: RowParallelLinear, act: str = "silu"):
        self.gate_up = gate_up
        self.down = down
        self.act = act
        self._act_and_mul = GATED_ACTIVATIONS[act]

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(self._act_and_mul(self.gate_up(h)))


class VocabParallelEmbedding:
    """Token ids -> rows of the embedding table, from this rank's rows [start, start + rows) of it."""

    def __init__(
        self, weight: torch.Tensor | BlockWeight, start: int, tp: TensorParallel, dtype: torch.dtype = torch.float32
    ):
        self.weight = weight
        self.start = start
        self.tp = tp
        self.dtype = dtype  # a table kept in blocks gives fp32 rows: the model's type

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self._rows(ids)
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = self._rows(local.clamp(0, self.weight.shape[0] - 1))
        return self.tp.all_reduce(rows * mine.unsqueeze(-1).to(rows.dtype))

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.rows(ids).to(self.dtype) if isinstance(self.weight, BlockWeight) else self.weight[ids]


class ParallelLMHead:
    """Hidden rows -> float32 logits over the vocabulary, from this rank's rows [vocab shard, hidden] of
    the weight (the embedding table where the model ties them: a packed copy where packing applies)."""

    def __init__(self, weight: torch.Tensor | BlockWeight, vocab_size: int, quantization: str, tp: TensorParallel):
        self.weight = pack_linear_weight(weight, quantization, head=True)
        self.vocab_size = vocab_size
        self.tp = tp

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight).float()
        if self.tp.world_size == 1:
            return logits
        return self.tp.all_gather_last(logits)[:, : self.vocab_size]  # the last shard's padding dropped
