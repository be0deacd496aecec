"""Multi-LoRA on hybrid linear-attention models (issues 45 and 47): adapters of Qwen3.5's full layers'
attention (q_proj's pairs split as its weights are: the query's rows and the output gate's) and of every
layer's MLP; on Qwen3.5-MoE and Qwen3-Next, of the attention alone. Greedy tokens equal PEFT's, adapters
mixed with base rows in one batch, across chunked prefill; an adapter saved from a multimodal checkpoint's
text model (tensors under `model.language_model.`) loads as the same adapter."""

from __future__ import annotations

import pytest
import torch
from test_lora_engine import PROMPTS, engine_for
from test_lora_worker import ADAPTERS, NEW_TOKENS, make_adapter, peft_greedy
from test_model_equivalence import transformers_greedy

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def prompt_ids(base) -> list[list[int]]:
    """PROMPTS as the tiny tokenizer.json splits them (transformers maps qwen3_5_moe's tokenizer to Qwen3.5's
    own class, which knows none of its words): the engine is given the ids."""
    from tokenizers import Tokenizer

    return [Tokenizer.from_file(str(base / "tokenizer.json")).encode(p).ids for p in PROMPTS]


def expected_tokens(base, folders: dict) -> dict[str, list[list[int]]]:
    ids = prompt_ids(base)
    expected = {
        "base": transformers_greedy(base, ids, NEW_TOKENS),
        **{name: peft_greedy(base, folder, ids) for name, folder in folders.items()},
    }
    assert all(expected[name] != expected["base"] for name in folders)  # the adapters matter
    return expected


def generate(base, engine, jobs: list[tuple[int, int]]) -> list[list[int]]:
    """Greedy token ids of (prompt index, adapter) jobs, run together."""
    from batchserve.procs.engine import request

    ids = prompt_ids(base)
    return [
        c.token_ids
        for c in engine.generate(
            [
                request(
                    f"r{i}",
                    prompt_token_ids=ids[p],
                    adapter=adapter,
                    sampling={"temperature": 0},
                    stop={"max_tokens": NEW_TOKENS, "ignore_eos": True},
                )
                for i, (p, adapter) in enumerate(jobs)
            ]
        )
    ]


@pytest.fixture(scope="module")
def qwen3_5(tiny_model_dir, tmp_path_factory):
    base = tiny_model_dir("qwen3_5", with_tokenizer=True)
    folders = {
        name: make_adapter(base, tmp_path_factory.mktemp(f"lora-{name}"), seed, **config)
        for seed, (name, config) in enumerate(ADAPTERS.items())
    }
    return base, folders, expected_tokens(base, folders)


@pytest.mark.parametrize("prefill_budget", [2048, 8], ids=["whole-prompts", "chunked-prefill"])
def test_adapters_on_a_hybrid_model_mixed_with_the_base_equal_peft(qwen3_5, prefill_budget):
    """Two adapters (all seven projections with rsLoRA; q, v and down) beside base rows in the same steps;
    with a budget of 8 each prompt's state and its adapter's rows run across chunks."""
    base, folders, expected = qwen3_5
    names = ["base", "a", "b"]
    jobs = [(0, 1), (1, 0), (2, 2), (1, 1), (0, 2), (2, 0)]
    got = generate(base, engine_for(base, folders, prefill_budget=prefill_budget), jobs)
    assert got == [expected[names[adapter]][p] for p, adapter in jobs]


def test_adapters_on_a_hybrid_model_shard_under_tensor_parallelism(qwen3_5):
    """--tensor-parallel-size 2: the gate's pairs are cut as the query's (its heads' rows on each rank)."""
    base, folders, expected = qwen3_5
    names = ["base", "a", "b"]
    jobs = [(0, 1), (1, 0), (2, 2)]
    engine = engine_for(base, folders, tensor_parallel_size=2)
    try:
        assert generate(base, engine, jobs) == [expected[names[adapter]][p] for p, adapter in jobs]
    finally:
        engine.close()


def test_an_adapter_of_a_multimodal_checkpoints_text_model_loads_as_the_same(qwen3_5, tmp_path):
    """Qwen3.5's released checkpoints are `Qwen3_5ForConditionalGeneration`: PEFT names their decoder's pairs
    `base_model.model.model.language_model.layers.*`, which load as the text model's."""
    from safetensors.torch import load_file, save_file

    base, folders, expected = qwen3_5
    renamed = tmp_path / "multimodal"
    renamed.mkdir()
    (renamed / "adapter_config.json").write_text((folders["a"] / "adapter_config.json").read_text())
    tensors = load_file(folders["a"] / "adapter_model.safetensors")
    save_file(
        {k.replace("model.model.layers.", "model.model.language_model.layers."): v for k, v in tensors.items()},
        renamed / "adapter_model.safetensors",
    )
    assert generate(base, engine_for(base, {"a": renamed}), [(0, 1), (1, 0)]) == [expected["a"][0], expected["base"][1]]


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next"])
def test_attention_adapters_on_a_hybrid_mixture_of_experts_equal_peft(tiny_model_dir, tmp_path, arch):
    base = tiny_model_dir(arch, with_tokenizer=True)
    folders = {"a": make_adapter(base, tmp_path / "a", 3, r=4, lora_alpha=8, target_modules=ATTENTION)}
    expected = expected_tokens(base, folders)
    got = generate(base, engine_for(base, folders), [(0, 1), (1, 0), (2, 1)])
    assert got == [expected["a"][0], expected["base"][1], expected["a"][2]]


def test_the_gated_query_split_keeps_each_heads_query_then_gate():
    from batchserve.procs.worker.models.qwen3_next import split_query_gate

    rows = torch.arange(2 * 2 * 3).reshape(2 * 2 * 3, 1)  # 2 heads of head_dim 3: q0 g0 q1 g1
    query, gate = split_query_gate(rows, 3)
    assert query.flatten().tolist() == [0, 1, 2, 6, 7, 8] and gate.flatten().tolist() == [3, 4, 5, 9, 10, 11]


def test_an_adapter_of_the_linear_layers_own_projections_is_refused_naming_target_modules(qwen3_5, tmp_path):
    import json

    from batchserve.procs.engine import OfflineEngine
    from batchserve.shared.config import ServerConfig
    from batchserve.shared.model import ModelLoadError

    base = qwen3_5[0]
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "in_proj_qkv"]})
    )
    with pytest.raises(ModelLoadError, match=r"target_modules \['q_proj', 'in_proj_qkv'\]: only q_proj"):
        OfflineEngine(
            ServerConfig(model=str(base), enable_lora=True, lora_modules=[f"x={tmp_path}"], kv_capacity_tokens=512)
        )
