"""GGUF files of tiny models, written as llama.cpp's converter lays out llama, qwen2moe and qwen3moe (tensor
names, the llama family's interleaved q / k rows, stacked experts, metadata, a gpt2-style tokenizer), from a
tiny Hugging Face folder saved with fused experts and the byte-level tokenizer (`conftest.build_tiny_model`).
`write_llama_gguf` stores the 2-D weights in a GGUF block type (in shards too): gguf-py quantizes the legacy
types and MXFP4, `kquant_blocks` the k-quants."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file

LAYER_NAMES = {  # Hugging Face name under model.layers.{i}. -> llama.cpp's under blk.{i}.
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
}


def write_moe_gguf(model_dir: Path, out: Path) -> Path:
    config = json.loads((model_dir / "config.json").read_text())
    arch = {"Qwen2MoeForCausalLM": "qwen2moe", "Qwen3MoeForCausalLM": "qwen3moe"}[config["architectures"][0]]
    writer = _writer(out, arch, config)
    writer.add_expert_count(config["num_experts"] if "num_experts" in config else config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    _add_tokenizer(writer, model_dir, config["vocab_size"])
    for name, tensor in _tensors(load_file(str(model_dir / "model.safetensors"))):
        writer.add_tensor(name, np.ascontiguousarray(tensor, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def write_llama_gguf(
    model_dir: Path, out: Path, block_type: Callable[[str], str] | str = "F32", shard_tensors: int = 0
) -> Path:
    """A Llama folder as llama.cpp's converter writes it; `block_type`: the GGUF type of each 2-D weight (by
    its GGUF name; a name: all of them), the norms staying F32 as llama-quantize leaves them. `shard_tensors`
    > 0: split into shards of that many tensors, as `gguf-split` does (OUT-00001-of-0000N.gguf ..., the
    first one returned)."""
    config = json.loads((model_dir / "config.json").read_text())
    writer = _writer(out, "llama", config, shard_tensors)
    _add_tokenizer(writer, model_dir, config["vocab_size"])
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for name, tensor in _tensors(load_file(str(model_dir / "model.safetensors"))):
        kind = block_type(name) if callable(block_type) else block_type
        part = name.split(".")[-2]
        if part in heads:
            tensor = _rope_interleave(tensor, heads[part])
        _add(writer, name, np.ascontiguousarray(tensor, dtype=np.float32), kind if tensor.ndim == 2 else "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out.with_name(f"{out.stem}-00001-of-{len(writer.tensors):05d}.gguf") if len(writer.tensors) > 1 else out


def _writer(out: Path, arch: str, config: dict[str, Any], shard_tensors: int = 0) -> Any:
    """A GGUF writer with the decoder's metadata every architecture here shares."""
    import gguf

    writer = gguf.GGUFWriter(str(out), arch, split_max_tensors=shard_tensors)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    return writer


def _rope_interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q / k row order (its `LlamaModel.permute`)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add(writer: Any, name: str, tensor: np.ndarray, kind: str) -> None:
    import gguf
    from kquant_blocks import quantize_kquant_rows

    if kind == "F32":
        writer.add_tensor(name, tensor)
        return
    qtype = gguf.GGMLQuantizationType[kind]
    blocks = quantize_kquant_rows(tensor, kind) if kind.endswith("_K") else gguf.quants.quantize(tensor, qtype)
    writer.add_tensor(name, blocks, raw_dtype=qtype)


def _tensors(weights: dict[str, np.ndarray]):
    yield "token_embd.weight", weights.pop("model.embed_tokens.weight")
    yield "output_norm.weight", weights.pop("model.norm.weight")
    if "lm_head.weight" in weights:
        yield "output.weight", weights.pop("lm_head.weight")
    for name, tensor in sorted(weights.items()):
        _, _, layer, rest = name.split(".", 3)
        if rest == "mlp.experts.gate_up_proj":  # llama.cpp keeps gate and up apart
            half = tensor.shape[1] // 2
            yield f"blk.{layer}.ffn_gate_exps.weight", tensor[:, :half]
            yield f"blk.{layer}.ffn_up_exps.weight", tensor[:, half:]
        elif rest == "mlp.shared_expert_gate.weight":
            yield f"blk.{layer}.ffn_gate_inp_shexp.weight", tensor[0]  # a vector in llama.cpp's files
        else:
            yield f"blk.{layer}.{LAYER_NAMES[rest]}", tensor


def _add_tokenizer(writer, model_dir: Path, vocab_size: int) -> None:
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    for added in tokenizer.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]  # as llama.cpp pads to the model's rows
    special = {added["content"] for added in tokenizer.get("added_tokens", []) if added.get("special")}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [3 if token in special else 4 if token.startswith("[PAD") else 1 for token in tokens]
    )  # 1: normal, 3: control, 4: user-defined
    merges = tokenizer["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(vocab["<s>"])
    writer.add_eos_token_id(vocab["</s>"])
    writer.add_unk_token_id(vocab["<unk>"])
    chat = json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template")
    if chat:
        writer.add_chat_template(chat)
