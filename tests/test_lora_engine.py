"""Multi-LoRA through the scheduler (issue 47, second part): `--enable-lora --lora-modules a=... b=...`
loaded by the worker at start, requests naming an adapter (`RequestParams.adapter`) mixed with base-model
requests in the offline engine, greedy text equal to PEFT's; the same prompt under an adapter and then the
base model shares no cached KV; `--max-loras` keeps a third adapter waiting (the rule's traces:
tests/scenarios/max_loras.json)."""

from __future__ import annotations

import pytest
from test_lora_worker import ADAPTERS, NEW_TOKENS, make_adapter, peft_greedy
from test_model_equivalence import transformers_greedy

from batchserve.shared.config import ServerConfig

PROMPTS = ["w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20", "w40 w41 w42", "w100 w101 w102 w103 w104 w105"]


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    base = tiny_model_dir("llama", with_tokenizer=True)
    folders = {
        name: make_adapter(base, tmp_path_factory.mktemp(f"lora-{name}"), seed, **config)
        for seed, (name, config) in enumerate(ADAPTERS.items())
    }
    ids = [AutoTokenizer.from_pretrained(base).encode(p) for p in PROMPTS]
    expected = {
        "base": transformers_greedy(base, ids, NEW_TOKENS),
        **{name: peft_greedy(base, folder, ids) for name, folder in folders.items()},
    }
    return base, folders, expected


def engine_for(base, folders, **config):
    from batchserve.procs.engine import OfflineEngine

    modules = [f"{name}={folder}" for name, folder in folders.items()]
    return OfflineEngine(
        ServerConfig(
            model=str(base),
            enable_lora=True,
            lora_modules=modules,
            page_size=4,
            kv_capacity_tokens=512,
            max_running_requests=4,
            **config,
        )
    )


def generate(engine, jobs: list[tuple[int, int]]) -> list[list[int]]:
    """Greedy token ids of (prompt index, adapter) jobs, run together."""
    from batchserve.procs.engine import request

    return [
        c.token_ids
        for c in engine.generate(
            [
                request(
                    f"r{i}",
                    prompt=PROMPTS[p],
                    adapter=adapter,
                    sampling={"temperature": 0},
                    stop={"max_tokens": NEW_TOKENS, "ignore_eos": True},
                )
                for i, (p, adapter) in enumerate(jobs)
            ]
        )
    ]


def test_adapters_mixed_with_the_base_model_equal_peft(setup):
    base, folders, expected = setup
    names = ["base", "a", "b"]
    jobs = [(0, 1), (1, 0), (2, 2), (1, 1), (0, 2), (2, 0)]
    got = generate(engine_for(base, folders), jobs)
    assert got == [expected[names[adapter]][p] for p, adapter in jobs]


def test_the_same_prompt_under_an_adapter_then_the_base_shares_no_kv(setup):
    base, folders, expected = setup
    engine = engine_for(base, folders)
    assert generate(engine, [(0, 1)]) == [expected["a"][0]]
    assert generate(engine, [(0, 1)]) == [expected["a"][0]]  # the same adapter: its cached pages serve
    hits = engine.scheduler.kv.hit_tokens
    assert hits > 0
    assert generate(engine, [(0, 0)]) == [expected["base"][0]] and engine.scheduler.kv.hit_tokens == hits
    assert generate(engine, [(0, 2)]) == [expected["b"][0]] and engine.scheduler.kv.hit_tokens == hits


def test_max_loras_one_runs_the_adapters_one_after_another(setup):
    base, folders, expected = setup
    engine = engine_for(base, folders, max_loras=1)
    jobs = [(0, 1), (1, 2), (2, 0)]
    assert generate(engine, jobs) == [expected["a"][0], expected["b"][1], expected["base"][2]]
    assert engine.scheduler.config.max_loras == 1


def test_lora_modules_without_enable_lora_or_malformed_are_refused():
    with pytest.raises(ValueError, match="lora_modules needs enable_lora"):
        ServerConfig(lora_modules=["a=/x"])
    with pytest.raises(ValueError, match="lora_modules entry 'nopath': expected NAME=PATH"):
        ServerConfig(enable_lora=True, lora_modules=["nopath"])
    with pytest.raises(ValueError, match="a name appears twice"):
        ServerConfig(enable_lora=True, lora_modules=["a=/x", '{"name": "a", "path": "/y"}'])


@pytest.mark.parametrize("held", [0, 1], ids=["all-loaded", "loaded-at-admission"])
def test_adapters_shard_like_their_base_layers_under_tensor_parallelism(setup, held):
    """--tensor-parallel-size 2: each rank holds its share of every pair (B's rows of q/k/v/gate/up, A's
    columns of o/down, whose term joins the rank's partial sum before the all-reduce); followers apply the
    steps' slot starts and adapter loads as rank 0 does (with --max-cpu-loras 1 each adapter is loaded by
    the step that admits its request). Greedy tokens equal PEFT's."""
    base, folders, expected = setup
    names = ["base", "a", "b"]
    jobs = [(0, 1), (1, 0), (2, 2), (1, 1), (0, 2)]
    engine = engine_for(base, folders, tensor_parallel_size=2, max_cpu_loras=held, max_loras=held or 4)
    try:
        assert generate(engine, jobs) == [expected[names[adapter]][p] for p, adapter in jobs]
    finally:
        engine.close()


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_attention_adapters_on_a_mixture_of_experts_equal_peft(tiny_model_dir, tmp_path, arch):
    """A mixture of experts serves adapters of its attention (q, k, v, o), greedy-equal to PEFT beside base
    rows; one that targets its MLPs (the experts) is refused at start, naming target_modules."""
    import json

    from transformers import AutoTokenizer

    from batchserve.procs.engine import OfflineEngine
    from batchserve.shared.model import ModelLoadError

    base = tiny_model_dir(arch, with_tokenizer=True)
    folder = make_adapter(
        base, tmp_path / "attention", 0, r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    ids = [AutoTokenizer.from_pretrained(base).encode(p) for p in PROMPTS]
    adapted, plain = peft_greedy(base, folder, ids), transformers_greedy(base, ids, NEW_TOKENS)
    assert generate(engine_for(base, {"a": folder}), [(0, 1), (1, 0), (2, 1)]) == [adapted[0], plain[1], adapted[2]]
    experts = tmp_path / "experts"
    experts.mkdir()
    (experts / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "gate_proj"]})
    )
    with pytest.raises(ModelLoadError, match=r"target_modules \['gate_proj'\]: this model's MLPs are mixtures of"):
        OfflineEngine(
            ServerConfig(model=str(base), enable_lora=True, lora_modules=[f"e={experts}"], kv_capacity_tokens=512)
        )
