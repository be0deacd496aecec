"""The detokenizer's tokenizer cache (`procs/detokenizer/decoder_cache.py`): the first start caches the
Rust backend transformers built, later starts read it without transformers, and it decodes as
transformers' tokenizer does; an edited tokenizer builds it again, a damaged cache file is replaced."""

from __future__ import annotations

import random
import shutil

import pytest
import tokenizers

from batchserve.procs.detokenizer import decoder_cache
from batchserve.procs.detokenizer.incremental import make_decode, special_token_ids
from batchserve.shared.model import ModelSpec, load_tokenizer


@pytest.fixture(scope="module")
def default_model_dir():
    return ModelSpec.resolve("smollm2-135m-instruct").model_dir  # the default model's, from its GGUF


@pytest.fixture
def cache(default_model_dir, tmp_path, monkeypatch):
    """A cache folder of the test's own (resolved after the default model, whose conversion stays put)."""
    monkeypatch.setenv("BATCHSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokenizers"


def test_the_cached_backend_decodes_as_transformers_does(tiny_model_dir, default_model_dir, cache, monkeypatch):
    word_level = tiny_model_dir("llama", with_tokenizer=True)  # no decoder
    byte_level = tiny_model_dir("llama", with_tokenizer="bytes")
    for folder in (word_level, byte_level, default_model_dir):
        first = decoder_cache.load_decoding_tokenizer(folder)
        monkeypatch.setattr(decoder_cache, "load_tokenizer", lambda _: pytest.fail("transformers loaded again"))
        second = decoder_cache.load_decoding_tokenizer(folder)
        monkeypatch.setattr(decoder_cache, "load_tokenizer", load_tokenizer)
        assert not isinstance(first, tokenizers.Tokenizer) and isinstance(second, tokenizers.Tokenizer)
        assert special_token_ids(second) == special_token_ids(first) != frozenset()
        ids = random.Random(0)
        size = second.get_vocab_size(with_added_tokens=True)
        for skip in (True, False):
            ours, theirs = make_decode(second, skip_special_tokens=skip), make_decode(first, skip_special_tokens=skip)
            for _ in range(200):
                sample = [ids.randrange(size) for _ in range(ids.randrange(1, 10))]
                assert ours(sample) == theirs(sample) == first.decode(sample, skip_special_tokens=skip)


def test_an_edited_tokenizer_is_built_again_and_a_damaged_cache_file_replaced(tiny_model_dir, cache, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama", with_tokenizer=True), folder)
    key = decoder_cache.tokenizer_key(folder)
    (folder / "model.safetensors").write_bytes(b"other weights")
    assert decoder_cache.tokenizer_key(folder) == key  # weights are not part of the key
    (folder / "tokenizer_config.json").write_text((folder / "tokenizer_config.json").read_text() + "\n")
    assert decoder_cache.tokenizer_key(folder) != key

    decoder_cache.load_decoding_tokenizer(folder)
    (path,) = cache.iterdir()
    path.write_text(path.read_text()[:100])  # cut short
    assert not isinstance(decoder_cache.load_decoding_tokenizer(folder), tokenizers.Tokenizer)  # rebuilt
    assert isinstance(decoder_cache.load_decoding_tokenizer(folder), tokenizers.Tokenizer)  # and replaced
