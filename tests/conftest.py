"""Shared fixtures: tiny random-weight Hugging Face model folders built inside the test session."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# `python -m pytest` puts the checkout on sys.path, where its kernels/ and shared/ folders would shadow
# installed packages of those names (Hugging Face's `kernels`): batchserve is imported as installed.
REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != REPO]

# The CUDA path's Triton kernels run on CPU tensors under Triton's interpreter (tests/test_triton_*.py): it must
# be chosen before anything imports triton (torch may, lazily). Worker processes the tests start inherit it.
os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_VOCAB = 320


def write_tiny_tokenizer(out_dir: Path, vocab_size: int = TINY_VOCAB) -> None:
    """A WordLevel tokenizer over words `w0..wN` plus <unk>/<s>/</s>, with a simple chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(out_dir)


BYTE_CORPUS = [
    '{"name": "Ada", "age": 36, "ok": true}',
    "<tool_call>\n</tool_call>",
    "the quick brown fox jumps over the lazy dog",
]


def write_byte_tokenizer(out_dir: Path, vocab_size: int = TINY_VOCAB, *, thinking: bool = False) -> None:
    """A byte-level BPE (GPT-2 style, as the default model's) trained on a few lines, with <unk>/<s>/</s>
    at ids 0-2 and a ChatML-like template: what grammar-constrained decoding needs of a tokenizer
    (every text is spellable), at the tiny model's vocabulary size. `thinking`: <think> and </think>
    are tokens and the template thinks as Qwen3's does (enable_thinking=false closes the block in the prompt)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(BYTE_CORPUS * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
    )
    if thinking:
        tokenizer.add_tokens(["<think>", "</think>"])
        tokenizer.chat_template += (
            "{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
            "<think>\n\n</think>\n\n{% endif %}"
        )
    tokenizer.save_pretrained(out_dir)


MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "qwen3_next", "qwen3_5_moe")
HYBRID_ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")  # Gated DeltaNet beside full attention
ROUTER_SCALE = 10.0  # MoE routers' weights scaled up: clear winners, so fp32 rounding never flips a top-k


def build_tiny_model(
    out_dir: Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    with_tokenizer: bool | str = False,
    fused_experts: bool = False,
    **overrides: Any,
) -> Path:
    """Save a random-weight LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM / MistralForCausalLM /
    Phi3ForCausalLM / Gemma2ForCausalLM / Gemma3ForCausalLM, a Gemma3ForConditionalGeneration ("gemma3_mm": a
    one-layer vision tower beside the text model the overrides configure) or a mixture of experts
    (`MOE_ARCHS`, GptOssForCausalLM among them: 8 experts, top 2) (fp32) into out_dir. `fused_experts`: the
    experts in transformers 5's fused tensors (`save_original_format=False`) rather than one tensor per
    expert."""
    import torch
    import transformers

    classes = {
        "llama": "Llama",
        "qwen2": "Qwen2",
        "qwen3": "Qwen3",
        "mistral": "Mistral",
        "mixtral": "Mixtral",
        "qwen2_moe": "Qwen2Moe",
        "qwen3_moe": "Qwen3Moe",
        "olmoe": "Olmoe",
        "phi3": "Phi3",
        "gemma2": "Gemma2",
        "gemma3": "Gemma3",
        "gemma3_mm": "Gemma3",
        "gpt_oss": "GptOss",
        "qwen3_next": "Qwen3Next",
        "qwen3_5": "Qwen3_5",
        "qwen3_5_moe": "Qwen3_5Moe",
    }
    text_configs = ("gemma3", "gemma3_mm", "qwen3_5", "qwen3_5_moe")
    config_cls = getattr(transformers, classes[arch] + ("TextConfig" if arch in text_configs else "Config"))
    model_cls = getattr(transformers, classes[arch] + "ForCausalLM")
    fields: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch in ("qwen3", "qwen3_moe"):
        fields["head_dim"] = 16
    if arch in HYBRID_ARCHS:  # 3 linear layers, then a full one; 4 key heads of 8 serving 8 value heads of 8
        fields.update(
            num_hidden_layers=4,
            head_dim=16,
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
        )
    if arch in MOE_ARCHS:
        experts_key = "num_local_experts" if arch in ("mixtral", "gpt_oss") else "num_experts"
        fields.update(num_experts_per_tok=2, **{experts_key: 8})
        fields.update(
            dict(
                mixtral=dict(intermediate_size=48),
                olmoe=dict(intermediate_size=48),
                gpt_oss=dict(intermediate_size=32, head_dim=16),
                qwen2_moe=dict(moe_intermediate_size=32, shared_expert_intermediate_size=48),
                qwen3_moe=dict(moe_intermediate_size=32),
                qwen3_next=dict(moe_intermediate_size=32, shared_expert_intermediate_size=48),
                qwen3_5_moe=dict(moe_intermediate_size=32, shared_expert_intermediate_size=48),
            ).get(arch, {})
        )
    fields.update(overrides)
    torch.manual_seed(seed)
    config = config_cls(**fields)
    if arch == "gemma3_mm":
        vision = dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        )
        config = transformers.Gemma3Config(text_config=config.to_dict(), vision_config=vision, mm_tokens_per_image=4)
        model_cls = transformers.Gemma3ForConditionalGeneration
    model = model_cls(config).to(torch.float32).eval()
    zero_centred = arch in HYBRID_ARCHS
    with torch.no_grad():  # transformers initialises biases to 0 and norms to 1: make them matter
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.2)
            elif "norm" in name:  # (1 + w) norms (zero-centred, the hybrid models') about 1 as well
                param.normal_(0.0 if zero_centred and not name.endswith("linear_attn.norm.weight") else 1.0, 0.2)
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                param.mul_(ROUTER_SCALE)
            elif name.endswith("linear_attn.A_log"):  # decays of a trained model's order (transformers draws A up
                param.uniform_(-2.0, 0.5)  # to 16: a 64-token chunk's fp32 log-decay sum then loses digits)
            elif name.endswith("self_attn.sinks"):  # gpt-oss: sinks that take a real share of the weight
                param.normal_(0.0, 1.0)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, save_original_format=not fused_experts)
    if with_tokenizer in ("bytes", "thinking"):
        write_byte_tokenizer(out_dir, fields["vocab_size"], thinking=with_tokenizer == "thinking")
    elif with_tokenizer:
        write_tiny_tokenizer(out_dir, fields["vocab_size"])
    return out_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: `tiny_model_dir(arch="llama"|"qwen2"|"qwen3"|"mistral"|one of MOE_ARCHS,
    with_tokenizer=False|True|"bytes"|"thinking", seed=0, fused_experts=False, **config)` -> folder.

    Folders are built once per distinct argument set and shared across the session (treat them as read-only).
    """
    built: dict[str, Path] = {}

    def make(arch: str = "llama", **kwargs: Any) -> Path:
        key = json.dumps([arch, kwargs], sort_keys=True, default=str)
        if key not in built:
            built[key] = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **kwargs)
        return built[key]

    return make


@pytest.fixture(scope="session", autouse=True)
def state_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's state directory (stored responses' SQLite file): a fresh one, not the user's, for the
    servers the tests start and the processes they spawn (which inherit it)."""
    path = tmp_path_factory.mktemp("state")
    os.environ["XDG_STATE_HOME"] = str(path)
    os.environ.pop("STATE_DIRECTORY", None)
    return path


@pytest.fixture
def triton_on() -> Any:
    """For a test that turns the Triton kernels on (`ModelRunner(triton_kernels="on")`, process-wide): off after it."""
    yield
    import torch

    from batchserve.kernels import triton

    triton.select("off", torch.device("cpu"))
