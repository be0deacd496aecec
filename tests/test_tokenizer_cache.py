"""The tokenizer cache (`shared/tokenizer_cache.py`): the first start caches what transformers built,
later starts read it without building it again (and, in a fresh process, without importing torch), and
the cached tokenizers encode, template and decode as transformers' do; an edited tokenizer is built again,
a damaged cache file is replaced."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys

import pytest
import tokenizers

from batchserve.procs.detokenizer.incremental import make_decode, special_token_ids
from batchserve.shared import tokenizer_cache
from batchserve.shared.model import ModelSpec, load_tokenizer

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Bonjour! 你好 🤖 naïve"}]


@pytest.fixture(scope="module")
def default_model_dir():
    return ModelSpec.resolve("smollm2-135m-instruct").model_dir  # the default model's, from its GGUF


@pytest.fixture
def cache(default_model_dir, tmp_path, monkeypatch):
    """A cache folder of the test's own (set after the default model's conversion, which stays put)."""
    monkeypatch.setenv("BATCHSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokenizers"


@pytest.fixture
def folders(tiny_model_dir, default_model_dir):
    word_level = tiny_model_dir("llama", with_tokenizer=True)  # no decoder
    byte_level = tiny_model_dir("llama", with_tokenizer="bytes")
    return word_level, byte_level, default_model_dir


def _built_once(load, folder, monkeypatch):
    first = load(folder)
    build = tokenizer_cache.build_tokenizer
    monkeypatch.setattr(tokenizer_cache, "build_tokenizer", lambda _: pytest.fail("transformers built it again"))
    second = load(folder)
    monkeypatch.setattr(tokenizer_cache, "build_tokenizer", build)
    return first, second


def test_the_cached_backend_decodes_as_transformers_does(folders, cache, monkeypatch):
    for folder in folders:
        first, second = _built_once(tokenizer_cache.load_decoding_tokenizer, folder, monkeypatch)
        assert not isinstance(first, tokenizers.Tokenizer) and isinstance(second, tokenizers.Tokenizer)
        assert special_token_ids(second) == special_token_ids(first) != frozenset()
        ids = random.Random(0)
        size = second.get_vocab_size(with_added_tokens=True)
        for skip in (True, False):
            ours, theirs = make_decode(second, skip_special_tokens=skip), make_decode(first, skip_special_tokens=skip)
            for _ in range(100):
                sample = [ids.randrange(size) for _ in range(ids.randrange(1, 10))]
                assert ours(sample) == theirs(sample) == first.decode(sample, skip_special_tokens=skip)


def test_the_cached_tokenizer_encodes_and_templates_as_transformers_does(folders, cache, monkeypatch):
    for folder in folders:
        first, second = _built_once(tokenizer_cache.load_cached_tokenizer, folder, monkeypatch)
        assert type(second) is type(first) and second is not first
        text = "w5 w6 Bonjour! 你好 🤖 naïve\n\n  end"
        assert second.encode(text) == first.encode(text)
        assert second(text, add_special_tokens=False)["input_ids"] == first(text, add_special_tokens=False)["input_ids"]
        if first.chat_template:
            for tokenize in (False, True):
                assert second.apply_chat_template(
                    CHAT, tokenize=tokenize, add_generation_prompt=True
                ) == first.apply_chat_template(CHAT, tokenize=tokenize, add_generation_prompt=True)
        assert second.get_vocab() == first.get_vocab() and second.all_special_ids == first.all_special_ids


def test_a_fresh_process_reads_the_cache_without_importing_torch(folders, cache, monkeypatch):
    folder = folders[2]
    tokenizer_cache.load_cached_tokenizer(folder)
    tokenizer_cache.load_decoding_tokenizer(folder)
    probe = (
        "import sys; from pathlib import Path; from batchserve.shared import tokenizer_cache as c; "
        f"t = c.load_cached_tokenizer(Path({str(folder)!r})); d = c.load_decoding_tokenizer(Path({str(folder)!r})); "
        "print('torch' in sys.modules, type(d).__name__, len(t.get_vocab()))"
    )
    out = subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "Tokenizer", "49152"]


def test_an_edited_tokenizer_is_built_again_and_a_damaged_cache_file_replaced(tiny_model_dir, cache, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama", with_tokenizer=True), folder)
    key = tokenizer_cache.tokenizer_key(folder)
    (folder / "model.safetensors").write_bytes(b"other weights")
    assert tokenizer_cache.tokenizer_key(folder) == key  # weights are not part of the key
    (folder / "tokenizer_config.json").write_text((folder / "tokenizer_config.json").read_text() + "\n")
    assert tokenizer_cache.tokenizer_key(folder) != key

    tokenizer_cache.load_decoding_tokenizer(folder)
    tokenizer_cache.load_cached_tokenizer(folder)
    assert sorted(path.stat().st_mode & 0o777 for path in cache.iterdir()) == [0o644, 0o644]
    for path in cache.iterdir():
        path.write_bytes(path.read_bytes()[:100])  # cut short
    assert not isinstance(tokenizer_cache.load_decoding_tokenizer(folder), tokenizers.Tokenizer)  # rebuilt
    assert isinstance(tokenizer_cache.load_decoding_tokenizer(folder), tokenizers.Tokenizer)  # and replaced
    assert tokenizer_cache.load_cached_tokenizer(folder).encode("w5 w6") == load_tokenizer(folder).encode("w5 w6")
