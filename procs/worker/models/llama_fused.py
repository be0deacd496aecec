"""The Llama decoder's layers in the fused C decode call (`kernels.decode_layers`), which steps on the cpu
attention backend run every layer in where the layers allow it: same kernels, same tokens, no Python
between them. Whether a model's layers allow it (`fuses_decode_layers`), and the call over an attention
backend's KV pools (`fused_decode_layers`), each layer's tensors and its projections' LoRA pairs read
as the call wants them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from batchserve.kernels import native
from batchserve.kernels.attention import AttentionBackend
from batchserve.kernels.decode_layers import DecodeLayers, LayerTensors, LoraPair
from batchserve.kernels.panel_linear import PanelWeight
from batchserve.kernels.projection import ProjectedWeight
from batchserve.kernels.quant_blocks import BlockParts, BlockWeight
from batchserve.kernels.rope import RotaryTables
from batchserve.kernels.triton import enabled as triton_enabled
from batchserve.procs.worker.models.layers import ColumnParallelLinear, RowParallelLinear
from batchserve.procs.worker.models.moe import SparseMoeBlock
from batchserve.procs.worker.parallel import TensorParallel

if TYPE_CHECKING:
    from batchserve.procs.worker.models.llama import LayerWeights, LlamaConfig


def fuses_decode_layers(
    config: LlamaConfig, rope: RotaryTables, tp: TensorParallel, layers: list[LayerWeights]
) -> bool:
    """Whether the fused call can run this model's layers: panel or block weights, MoE blocks in C, one
    rank (the call has no all-reduce between layers), every dim of a head rotating, and none of the
    switches the call does not compute (GELU, sandwich norms, soft-capping, sinks, the sliding layers' own
    rope, an output gate, linear layers), and the Triton kernels not chosen (`kernels.triton`)."""
    plain = (
        config.hidden_act == "silu"
        and not config.sandwich_norms
        and not config.attn_softcap
        and not config.attn_sinks
        and config.local_rope is None
        and rope.rotary_dim == config.head_dim
        and not config.attn_output_gate
        and not config.linear_layers
    )
    c_call = native.available() and not triton_enabled()  # the Triton kernels, where chosen, run every layer
    return c_call and tp.world_size == 1 and plain and all(_in_c(layer) for layer in layers)


def fused_decode_layers(
    config: LlamaConfig,
    layers: list[LayerWeights],
    final_norm: torch.Tensor,
    intermediate: slice | None,
    attention: AttentionBackend,
) -> DecodeLayers:
    """The fused call over `layers` and `attention`'s KV pools (their LoRA pairs stacked as they are now);
    `intermediate` None: every layer is a mixture of experts."""
    cache = attention.kv_cache
    norms = [layer.input_norm for layer in layers[1:]] + [final_norm]
    windows = config.windows or (0,) * config.num_layers
    return DecodeLayers(
        [
            _layer_tensors(layer, next_norm, cache.k[i], cache.v[i], windows[i])
            for i, (layer, next_norm) in enumerate(zip(layers, norms))
        ],
        hidden=config.hidden_size,
        heads=config.num_heads,
        kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        intermediate=0 if intermediate is None else config.intermediate_size,  # 0: every layer MoE
        page_size=cache.page_size,
        eps=config.rms_norm_eps,
        scale=attention.scale,
        whole_qk_norm=config.qk_norm == "projection",
        clip_qkv=config.clip_qkv or 0.0,
    )


def _layer_tensors(
    layer: LayerWeights, next_norm: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, window: int
) -> LayerTensors:
    """What the fused decode call reads of a layer (`_in_c` said it can)."""
    mlp = layer.mlp
    moe = mlp.native if isinstance(mlp, SparseMoeBlock) else None
    gate_up: ColumnParallelLinear | None = None  # a mixture of experts runs as its block in the C kernel (`moe`)
    down: RowParallelLinear | None = None
    if not isinstance(mlp, SparseMoeBlock):
        gate_up, down = mlp.gate_up, mlp.down
    return LayerTensors(
        layer.qkv.weight,
        layer.qkv.bias,
        layer.o.weight,
        layer.o.bias,
        _panels(gate_up),
        None if gate_up is None else gate_up.bias,
        _panels(down),
        None if down is None else down.bias,
        moe,
        layer.q_norm,
        layer.k_norm,
        layer.post_norm,
        next_norm,
        k_pool,
        v_pool,
        window,
        tuple(_lora_pair(p) for p in (layer.qkv, layer.o, gate_up, down)),
    )


def _panels(projection: ColumnParallelLinear | RowParallelLinear | None) -> ProjectedWeight | None:
    """A projection's weight as the fused call reads it (None: no projection)."""
    if projection is None:
        return None
    assert isinstance(projection.weight, IN_C)  # `_in_c`: every projection of the call is in panels or blocks
    return projection.weight


def _lora_pair(projection: Any) -> LoraPair | None:
    """A projection's stacked LoRA pairs for the fused call (None: no adapter targets it)."""
    stack = (
        None if projection is None or projection.lora is None else projection.lora.stack(projection.weight.out_features)
    )
    return None if stack is None else LoraPair(*stack)


IN_C = (PanelWeight, BlockWeight, BlockParts)  # the weights the fused call's projections read


def _in_c(layer: LayerWeights) -> bool:
    """Whether the fused decode call can run this layer: panel or block projections, an MoE block in C."""
    projections = [layer.qkv, layer.o]
    if isinstance(layer.mlp, SparseMoeBlock):
        if layer.mlp.native is None:
            return False
    else:
        projections += [layer.mlp.gate_up, layer.mlp.down]
    return all(isinstance(p.weight, IN_C) for p in projections)
