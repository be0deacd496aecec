"""Multi-LoRA in the worker (issue 47, first part): random PEFT adapters made here with
`init_lora_weights=False` (PEFT's default makes B zero, which would make every comparison pass), of two
ranks and different target modules, one with rsLoRA, on a tiny Llama. Greedy tokens equal PEFT's
`PeftModel` for each adapter, alone and in one batch mixed with each other and with the base model, however
the batch is cut, with the C kernels and without, on padded decode batches; what PEFT would run otherwise
is refused at load, naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_batches import generate_greedy
from model_references import torch_only
from test_model_equivalence import SCHEDULES, transformers_greedy

from batchserve.procs.worker.lora.step import enable_lora, load_lora_adapter, lora_of
from batchserve.procs.worker.model_runner import ModelRunner
from batchserve.shared.model import ModelLoadError

NEW_TOKENS = 10
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "a": dict(r=4, lora_alpha=8, target_modules=ALL, use_rslora=True),
    "b": dict(r=8, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"]),
}


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, 320, (n,), generator=generator).tolist() for n in (11, 4, 17, 9, 6)]


def make_adapter(base: Path, out: Path, seed: int, **config) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **config))
    with torch.no_grad():  # a real share of each projection's output
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    peft_model.save_pretrained(out)
    return out


def peft_greedy(base: Path, adapter: Path, prompts: list[list[int]]) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        return [
            model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    base = tiny_model_dir("llama")
    folders = {
        name: make_adapter(base, tmp_path_factory.mktemp(f"lora-{name}"), seed, **config)
        for seed, (name, config) in enumerate(ADAPTERS.items())
    }
    prompts = _prompts()
    expected = {
        "base": transformers_greedy(base, prompts, NEW_TOKENS),
        **{name: peft_greedy(base, folder, prompts) for name, folder in folders.items()},
    }
    assert expected["a"] != expected["base"] and expected["b"] != expected["base"]  # the adapters matter
    return base, folders, prompts, expected


def runner_with_adapters(base: Path, folders: dict[str, Path], **kwargs) -> ModelRunner:
    runner = ModelRunner(
        base, device="cpu", dtype="float32", page_size=4, kv_capacity_tokens=2048, max_running_requests=8, **kwargs
    )
    for index, (name, folder) in enumerate(folders.items(), 1):
        load_lora_adapter(runner, index, name, str(folder), max_rank=16)
    return runner


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_mixed_adapters_and_base_in_one_batch_equal_peft(setup, schedule):
    base, folders, prompts, expected = setup
    runner = runner_with_adapters(base, folders)
    chosen = [1, 0, 2, 1, 2]  # a, base, b, a, b
    names = ["base", "a", "b"]
    got = generate_greedy(runner, prompts, NEW_TOKENS, adapters=chosen, **SCHEDULES[schedule])
    assert got == [expected[names[c]][i] for i, c in enumerate(chosen)]


@pytest.mark.parametrize("adapter", [0, 1, 2])
def test_each_adapter_alone_equals_peft_with_and_without_the_c_kernels(setup, adapter, monkeypatch):
    base, folders, prompts, expected = setup
    want = expected[["base", "a", "b"][adapter]]
    assert generate_greedy(runner_with_adapters(base, folders), prompts, NEW_TOKENS, adapters=[adapter] * 5) == want
    with torch_only(monkeypatch):
        runner = runner_with_adapters(base, folders, pad_decode=True)
        assert generate_greedy(runner, prompts, NEW_TOKENS, adapters=[adapter] * 5, **SCHEDULES["mixed"]) == want
        assert (runner.graph_runner.lora_steps > 0) == (adapter > 0)  # adapter rows on the padded decode path


def test_padded_decode_steps_mix_adapter_and_base_rows(setup):
    """Decode steps padded to the graphs' sizes (`pad_decode`: as CUDA graphs run them, eagerly here) with
    rows of both adapters and of the base model: the mask's padding rows add nothing, the real rows their
    own adapter's pairs; greedy tokens equal PEFT's, through the fused C decode call."""
    base, folders, prompts, expected = setup
    runner = runner_with_adapters(base, folders, pad_decode=True)
    chosen = [1, 0, 2, 1, 2]
    names = ["base", "a", "b"]
    got = generate_greedy(runner, prompts, NEW_TOKENS, adapters=chosen, **SCHEDULES["mixed"])
    assert got == [expected[names[c]][i] for i, c in enumerate(chosen)]
    padded = runner.graph_runner
    assert padded.lora_steps > 0 and set(padded.steps_per_size) <= set(padded.batch_sizes)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("use_dora", True, "use_dora true"),
        ("modules_to_save", ["lm_head"], "modules_to_save"),
        ("bias", "all", "bias 'all'"),
        ("target_modules", ["lm_head"], "target_modules"),
        ("rank_pattern", {"q_proj": 2}, "rank_pattern"),
        ("r", 64, "r 64 is above --max-lora-rank 16"),
    ],
)
def test_what_peft_would_run_otherwise_is_refused_naming_the_field(setup, tmp_path, field, value, message):
    base, folders, _, _ = setup
    folder = tmp_path / "bad"
    folder.mkdir()
    config = json.loads((folders["a"] / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, field: value}))
    (folder / "adapter_model.safetensors").write_bytes((folders["a"] / "adapter_model.safetensors").read_bytes())
    runner = ModelRunner(
        base, device="cpu", dtype="float32", page_size=4, kv_capacity_tokens=256, max_running_requests=2
    )
    with pytest.raises(ModelLoadError, match=message):
        load_lora_adapter(runner, 1, "bad", str(folder), max_rank=16)


def test_a_step_that_loads_an_adapter_reports_the_load_apart_from_its_cost(setup):
    """The load is one-off work (`StepResult.setup_s`): the scheduler's step-cost fit leaves it out."""
    import msgspec

    from batchserve.procs.worker.step_probe import probe_batch
    from batchserve.shared.messages import AdapterUpdate

    base, folders, _, _ = setup
    runner = runner_with_adapters(base, {})
    enable_lora(runner, 16)
    batch = probe_batch(runner, [0], [4])
    loading = runner.execute(
        msgspec.structs.replace(batch, adapter_updates=[AdapterUpdate(index=1, name="a", path=str(folders["a"]))])
    )
    assert loading.setup_s > 0 and 1 in lora_of(runner).adapters
    assert runner.execute(probe_batch(runner, [0], [4])).setup_s == 0.0
    with pytest.raises(ModelLoadError, match="enabled already"):  # one set of slots on the projections
        enable_lora(runner, 16)
