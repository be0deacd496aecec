"""The mixture-of-experts block of the model interface, beside the dense MLP (`layers.GatedMLP`):
`MoEConfig` (what a config.json says of it), `SparseMoeBlock` (router, experts, optional shared expert)
and `take_moe_block`, which loads one layer's block from either checkpoint layout:
- one tensor per expert: Qwen's `mlp.experts.{e}.gate_proj.weight` / `up_proj` / `down_proj` and router
  `mlp.gate.weight`, Mixtral's `block_sparse_moe.experts.{e}.w1` / `w3` / `w2` and `block_sparse_moe.gate`;
- transformers 5's fused tensors `mlp.experts.gate_up_proj` [experts, 2 I, hidden] and
  `mlp.experts.down_proj` [experts, hidden, I] (what `save_pretrained(save_original_format=False)` and our
  GGUF conversion write), router `mlp.gate.weight`.

Parallelism over the worker's ranks (`procs.worker.parallel`): by default every expert's intermediate
dimension is split as a dense MLP's is (as vLLM's FusedMoE); with `--enable-expert-parallel` each rank
holds whole experts, an even share of them (the expert map: rank r holds [r E/N, (r+1) E/N)). Attention is
tensor-parallel either way, so every rank holds every token's hidden state after it: the tokens are
dispatched to every rank for free, each runs the ones routed to its experts, and one all-reduce (a
reduce-scatter and an all-gather) combines the ranks' outputs, the shared expert's share included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from batchserve.kernels.moe import (
    ExpertActivation,
    Experts,
    NativeMoeBlock,
    SharedExpert,
    count_load,
    experts_forward,
    grouped_mm_runs,
    pack_experts,
    route,
)
from batchserve.kernels.ops import linear, pack_linear_weight
from batchserve.kernels.panel_linear import PanelWeight
from batchserve.procs.worker.models.layers import GatedMLP
from batchserve.procs.worker.models.weights import WeightTaker
from batchserve.procs.worker.parallel import TensorParallel
from batchserve.shared.model import ModelLoadError

# Router fields of other MoE families that this block does not implement, and the value that means
# "as this block does" (DeepSeek's grouped top-k and sigmoid scoring, GLM's scaling, ...).
UNSUPPORTED_ROUTER_FIELDS: dict[str, tuple[Any, ...]] = {
    "scoring_func": (None, "softmax"),
    "topk_method": (None, "greedy"),
    "n_group": (None, 1),
    "topk_group": (None, 1),
    "routed_scaling_factor": (None, 1, 1.0),
    "n_shared_experts": (None, 0),
    "first_k_dense_replace": (None, 0),
    "moe_layer_freq": (None, 1),
    "use_routing_bias": (None, False),
}


def num_experts(raw: dict[str, Any], default: int) -> int:
    """config.json's expert count, under either of transformers' names for it (its config classes map
    num_experts and num_local_experts to each other), else the architecture's `default`."""
    for key in ("num_experts", "num_local_experts"):
        if raw.get(key) is not None:
            return int(raw[key])
    return default


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool  # the top k weights divided by their sum
    sparse_layers: tuple[int, ...]  # the layers with this block; the others have the dense MLP
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    router_bias: bool = False
    activation: ExpertActivation = "silu"  # the experts' (gpt-oss: a ClampedSwiGLU)

    @classmethod
    def from_hf(
        cls,
        raw: dict[str, Any],
        where: str,
        *,
        num_layers: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        norm_topk_prob: bool,
        shared_expert_intermediate_size: int = 0,
        decoder_sparse_step: int = 1,
        mlp_only_layers: tuple[int, ...] = (),
    ) -> MoEConfig:
        """The block an architecture read from config.json `raw` (its own keys, its transformers defaults);
        ModelLoadError naming a router field of another family."""
        for field, fine in UNSUPPORTED_ROUTER_FIELDS.items():
            if raw.get(field) not in fine:
                raise ModelLoadError(
                    f"unsupported MoE router setting {field}={raw[field]!r} in {where} "
                    f"(this block routes by softmax over the experts, then the top k)"
                )
        if not 1 <= top_k <= num_experts:
            raise ModelLoadError(f"num_experts_per_tok {top_k} in {where} must be in [1, {num_experts}]")
        if decoder_sparse_step < 1:
            raise ModelLoadError(f"decoder_sparse_step {decoder_sparse_step} in {where} must be >= 1")
        sparse = tuple(
            i
            for i in range(num_layers)
            if i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0
        )
        return cls(
            num_experts=num_experts,
            top_k=top_k,
            intermediate_size=intermediate_size,
            norm_topk_prob=norm_topk_prob,
            sparse_layers=sparse,
            shared_expert_intermediate_size=shared_expert_intermediate_size,
        )


@dataclass(frozen=True)
class ExpertNames:
    """Where one layer's block lies in the one-tensor-per-expert layout, under `model.layers.{i}.`."""

    block: str  # "mlp." or Mixtral's "block_sparse_moe."
    gate: str  # each expert's projections: gate_proj / up_proj / down_proj, or Mixtral's w1 / w3 / w2
    up: str
    down: str


QWEN_EXPERTS = ExpertNames("mlp.", "gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERTS = ExpertNames("block_sparse_moe.", "w1", "w3", "w2")
FUSED_BLOCK = "mlp."  # transformers 5's module tree, whatever the architecture


class SparseMoeBlock:
    """Router, this rank's experts and (Qwen2-MoE) a shared expert gated by sigmoid(x . gate): the block's
    output, summed over the ranks. `load` [num_experts] counts the tokens routed to each expert."""

    def __init__(
        self,
        config: MoEConfig,
        router: torch.Tensor,
        router_bias: torch.Tensor | None,
        experts: Experts,
        shared: GatedMLP | None,
        shared_gate: torch.Tensor | None,
        tp: TensorParallel,
    ) -> None:
        gate_up = experts.gate_up  # tensors on CUDA (panels are the CPU's)
        if (
            router.device.type == "cuda"
            and isinstance(gate_up, torch.Tensor)
            and not grouped_mm_runs(router.device, gate_up.dtype)
        ):
            raise ModelLoadError(
                f"mixture-of-experts layers on CUDA run at bfloat16 (torch._grouped_mm, which CUDA "
                f"graphs capture; torch {torch.__version__}): serve with --dtype bfloat16"
            )
        self.config = config
        self.tp = tp
        self.experts = experts
        self.load = torch.zeros(config.num_experts, dtype=torch.int64, device=router.device)
        self.router = pack_linear_weight(router.float(), "none")  # logits in fp32, as transformers' softmax
        self.router_bias = router_bias
        self.shared = shared
        self.shared_gate = None if shared_gate is None else pack_linear_weight(shared_gate, "none")
        self.native = self._native()

    def _native(self) -> NativeMoeBlock | None:
        """The C kernel's block where every weight is panels (fp32 or int8 on the CPU)."""
        router, shared = self.router, None
        if not (self.experts.panels and self.experts.activation == "silu" and isinstance(router, PanelWeight)):
            return None
        if self.shared is not None:
            gate_up, down, gate = self.shared.gate_up.weight, self.shared.down.weight, self.shared_gate
            if not (
                isinstance(gate_up, PanelWeight) and isinstance(down, PanelWeight) and isinstance(gate, PanelWeight)
            ):
                return None
            shared = SharedExpert(gate_up, down, gate)
        return NativeMoeBlock(
            router,
            self.router_bias,
            self.experts,
            shared,
            top_k=self.config.top_k,
            renormalize=self.config.norm_topk_prob,
            load=self.load,
        )

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            out = self.native(h)
        else:
            logits = linear(h.float(), self.router, self.router_bias)
            weights, ids = route(logits, self.config.top_k, self.config.norm_topk_prob)
            count_load(self.load, ids)
            out = experts_forward(h, ids, weights, self.experts)
            if self.shared is not None:
                assert self.shared_gate is not None  # given with the shared expert (`take_moe_block`)
                out = out + torch.sigmoid(linear(h, self.shared_gate)) * self.shared(h)
        return self.tp.all_reduce(out)


def take_moe_block(
    take: WeightTaker, layer: str, names: ExpertNames, config: MoEConfig, hidden: int, tp: TensorParallel
) -> SparseMoeBlock:
    """Layer `layer`'s block (prefix `model.layers.{i}.`), this rank's share of it."""
    experts, inter = expert_shard(config, tp)
    if take.has(f"{layer}{FUSED_BLOCK}experts.gate_up_proj"):
        block = FUSED_BLOCK
        gate_up, down = _fused_experts(take, f"{layer}{block}experts.", config, hidden, experts, inter)
    else:
        block = names.block
        gate_up, down = _per_expert(take, f"{layer}{block}experts.", names, config, hidden, experts, inter)
    take.expect(f"{layer}{block}gate.weight", (config.num_experts, hidden))
    router = take(f"{layer}{block}gate.weight", dtype=torch.float32)
    router_bias = take(f"{layer}{block}gate.bias", dtype=torch.float32) if config.router_bias else None
    shared, shared_gate = None, None
    if config.shared_expert_intermediate_size:
        rows = tp.split(config.shared_expert_intermediate_size, "shared_expert_intermediate_size")
        prefix = f"{layer}{block}shared_expert."
        shared = GatedMLP(
            take.column([(prefix + "gate_proj", rows), (prefix + "up_proj", rows)], False),
            take.row(prefix + "down_proj", rows, False, tp, reduce=False),
        )
        shared_gate = take(f"{layer}{block}shared_expert_gate.weight")
    return SparseMoeBlock(
        config,
        router,
        router_bias,
        pack_experts(gate_up, down, None, None, first=experts.start, quantization=take.quantization),
        shared,
        shared_gate,
        tp,
    )


def expert_shard(config: MoEConfig, tp: TensorParallel) -> tuple[slice, slice]:
    """(this rank's experts, its rows of each one's intermediate dimension): whole experts with expert
    parallelism, else every expert's share of its intermediate size."""
    if tp.expert_parallel:
        return tp.split(config.num_experts, "num_experts"), slice(0, config.intermediate_size)
    return slice(0, config.num_experts), tp.split(config.intermediate_size, "the experts' intermediate size")


def _fused_experts(
    take: WeightTaker, prefix: str, config: MoEConfig, hidden: int, experts: slice, inter: slice
) -> tuple[torch.Tensor, torch.Tensor]:
    size, count = config.intermediate_size, config.num_experts
    take.expect(prefix + "gate_up_proj", (count, 2 * size, hidden))
    take.expect(prefix + "down_proj", (count, hidden, size))
    up = slice(size + inter.start, size + inter.stop)
    gate_rows, up_rows = take.parts(prefix + "gate_up_proj", [(experts, inter), (experts, up)])
    (down,) = take.parts(prefix + "down_proj", [(experts, slice(None), inter)])
    return torch.cat((gate_rows, up_rows), dim=1), down


def _per_expert(
    take: WeightTaker, prefix: str, names: ExpertNames, config: MoEConfig, hidden: int, experts: slice, inter: slice
) -> tuple[torch.Tensor, torch.Tensor]:
    size = config.intermediate_size
    gate_up, down = [], []
    for e in range(config.num_experts):
        expert = f"{prefix}{e}."
        for name, shape in ((names.gate, (size, hidden)), (names.up, (size, hidden)), (names.down, (hidden, size))):
            take.expect(f"{expert}{name}.weight", shape)
        if not experts.start <= e < experts.stop:  # another rank's expert
            for name in (names.gate, names.up, names.down):
                take.skip(f"{expert}{name}.weight")
            continue
        gate_up.append(
            torch.cat(
                (take(f"{expert}{names.gate}.weight", rows=inter), take(f"{expert}{names.up}.weight", rows=inter))
            )
        )
        down.append(take(f"{expert}{names.down}.weight", cols=inter))
    return torch.stack(gate_up), torch.stack(down)
