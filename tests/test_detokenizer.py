"""Tests for the incremental detokenizer and stop strings (procs/detokenizer), on small tokenizers
built in the test: a byte-level BPE (splits emoji and CJK across tokens) and a Metaspace one."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from batchserve.procs.detokenizer.incremental import IncrementalDetokenizer
from batchserve.procs.detokenizer.stop_strings import StopStringMatcher
from batchserve.shared.messages import RequestParams, StopParams

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Hello world, this is a small corpus for a byte-level BPE.",
    "The quick brown fox jumps over the lazy dog. STOP here. Done.",
    "中文字符和日本語のテキスト、한국어도 있습니다。",
    "Emoji: 😀 🎉 👍🏽 🇫🇷 and accents: héllo, naïve, façade, Ørsted.",
    "Numbers 12345 and symbols !@#$%^&*() <tag> </tag>",
]
MULTILINGUAL = "Hi 😀! 中文 and 日本語, naïve café 👍🏽 🇫🇷 done."


def _train_byte_level_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


BYTE_BPE = _train_byte_level_bpe()
VOCAB = BYTE_BPE.get_vocab_size()
SPECIAL_IDS = [BYTE_BPE.token_to_id(t) for t in SPECIAL_TOKENS]
HF_BYTE_BPE = PreTrainedTokenizerFast(tokenizer_object=BYTE_BPE)


def _stream(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> list[str]:
    return [detok.add(chunk).text for chunk in chunks]


def _one_token_per_char(text: str) -> list[int]:
    """Token ids for `text` with every character encoded on its own (so stop strings span tokens)."""
    return [i for ch in text for i in BYTE_BPE.encode(ch).ids]


def test_multibyte_characters_are_never_split() -> None:
    ids = BYTE_BPE.encode(MULTILINGUAL).ids
    partial = [i for i in ids if "\ufffd" in BYTE_BPE.decode([i])]
    assert partial, "the corpus must make the BPE split some characters across tokens"
    detok = IncrementalDetokenizer(BYTE_BPE)
    pieces = _stream(detok, [[i] for i in ids])
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.finish() == MULTILINGUAL
    assert any(p == "" for p in pieces)  # text was held while a character was incomplete


@pytest.mark.parametrize("tokenizer", [BYTE_BPE, HF_BYTE_BPE], ids=["tokenizers", "transformers"])
def test_byte_level_tokens_one_byte_at_a_time(tokenizer) -> None:
    # Single-byte tokens only: a 4-byte emoji takes four tokens to complete.
    text = "a😀b中c"
    ids = _byte_tokens(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = _stream(detok, [[i] for i in ids])
    assert pieces == ["a", "", "", "", "😀", "b", "", "", "中", "c"]
    assert detok.finish() == ""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by the ByteLevel pre-tokenizer."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_TO_UNICODE = _bytes_to_unicode()


def _byte_tokens(text: str) -> list[int]:
    """One single-byte token per UTF-8 byte of `text`."""
    return [BYTE_BPE.token_to_id(_BYTE_TO_UNICODE[b]) for b in text.encode()]


token_ids = st.lists(
    st.one_of(
        st.integers(0, VOCAB - 1),
        st.sampled_from(SPECIAL_IDS),
        st.integers(VOCAB, VOCAB + 50),  # ids a padded model vocab may produce: decode skips them
    ),
    max_size=40,
)


def _chunked(ids: list[int], cuts: list[int]) -> list[list[int]]:
    bounds = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    return [ids[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ids=token_ids,
    prompt=st.lists(st.integers(0, VOCAB - 1), max_size=8),
    cuts=st.lists(st.integers(0, 64), max_size=10),
    skip_special=st.booleans(),
    use_hf=st.booleans(),
)
def test_stream_concatenates_to_full_decode(
    ids: list[int], prompt: list[int], cuts: list[int], skip_special: bool, use_hf: bool
) -> None:
    tokenizer = HF_BYTE_BPE if use_hf else BYTE_BPE
    expected = BYTE_BPE.decode(ids, skip_special_tokens=skip_special)
    if use_hf:
        assert expected == HF_BYTE_BPE.decode(ids, skip_special_tokens=skip_special)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt, skip_special_tokens=skip_special)
    emitted = ""
    for chunk in _chunked(ids, cuts):
        emitted += detok.add(chunk).text
        # Whatever was sent is final: it is a prefix of the full decode (no half character that a
        # later byte turns into something else).
        assert expected.startswith(emitted)
    assert emitted + detok.finish() == expected
    assert detok.finish() == ""


def test_decode_work_per_token_stays_bounded() -> None:
    class CountingTokenizer:
        decoded_tokens = 0

        def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
            CountingTokenizer.decoded_tokens += len(ids)
            return BYTE_BPE.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = BYTE_BPE.encode(" ".join(CORPUS) * 10).ids
    detok = IncrementalDetokenizer(CountingTokenizer(), prompt_ids=ids[:50])
    text = "".join(detok.add([i]).text for i in ids) + detok.finish()
    assert text == BYTE_BPE.decode(ids)
    # Windows of a few tokens, two decodes per step: linear, not quadratic, in the length.
    assert CountingTokenizer.decoded_tokens < 12 * len(ids)


def _metaspace_tokenizer() -> Tokenizer:
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "▁again": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return tok


def test_prompt_context_keeps_the_leading_space() -> None:
    tok = _metaspace_tokenizer()
    assert tok.decode([2]) == "world"  # the decoder drops the first token's leading space
    detok = IncrementalDetokenizer(tok, prompt_ids=[1])
    assert [detok.add([t]).text for t in (2, 3, 4)] == [" world", "!", " again"]
    assert detok.finish() == ""
    alone = IncrementalDetokenizer(tok)
    assert "".join(alone.add([t]).text for t in (1, 2, 3)) + alone.finish() == "Hello world!"


def test_a_skipped_special_token_keeps_the_next_words_space() -> None:
    """A special token between two words shows no text; streamed alone, it must not become the next
    window's only context (the next word would lose its leading space), and any chunking of the
    stream gives the full decode."""
    tok = _metaspace_tokenizer()
    tok.add_special_tokens(["<sep>"])
    sep = tok.token_to_id("<sep>")
    ids = [1, sep, 2, sep, sep, 4, 3]
    expected = tok.decode(ids, skip_special_tokens=True)
    assert expected == "Hello world again!"
    for chunks in ([[t] for t in ids], [ids], [[1, sep], [2], [sep], [sep, 4, 3]]):
        detok = IncrementalDetokenizer(tok)
        assert "".join(detok.add(c).text for c in chunks) + detok.finish() == expected, chunks
    # a long run of them (a model repeating its end token under ignore_eos) is not kept to decode again
    detok = IncrementalDetokenizer(tok)
    detok.add([1])
    for _ in range(1000):
        assert detok.add([sep]).text == ""
    assert len(detok._ids) < 10 and detok.add([2]).text == " world"


def _byte_fallback_tokenizer() -> Tokenizer:
    """A Llama/Mistral-style SentencePiece BPE: characters outside the vocab become <0xXX> tokens,
    and the decoder shows each byte of an incomplete sequence as its own U+FFFD."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "a", "b", "c", "▁a", "▁b", "ab", "é", "中"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "a"), ("▁", "b"), ("a", "b")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tok


BYTE_FALLBACK = _byte_fallback_tokenizer()


def test_byte_fallback_tokenizer_shows_one_replacement_per_byte() -> None:
    ids = BYTE_FALLBACK.encode("a😀").ids
    assert BYTE_FALLBACK.decode(ids[:-1]).endswith("\ufffd\ufffd\ufffd")  # held back as a whole
    detok = IncrementalDetokenizer(BYTE_FALLBACK)
    assert [detok.add([i]).text for i in ids] == ["a", "", "", "", "😀"]


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab c中é日😀ñ", max_size=30),
    cuts=st.lists(st.integers(0, 200), max_size=8),
)
def test_byte_fallback_stream_matches_full_decode(text: str, cuts: list[int]) -> None:
    ids = BYTE_FALLBACK.encode(text).ids
    expected = BYTE_FALLBACK.decode(ids)
    detok = IncrementalDetokenizer(BYTE_FALLBACK)
    emitted = ""
    for chunk in _chunked(ids, cuts):
        emitted += detok.add(chunk).text
        assert expected.startswith(emitted)
    assert emitted + detok.finish() == expected


def test_numpy_ids_are_accepted() -> None:
    ids = BYTE_BPE.encode(MULTILINGUAL).ids
    detok = IncrementalDetokenizer(BYTE_BPE, prompt_ids=np.array(ids[:3], dtype=np.int32))
    text = "".join(detok.add(np.array([i], dtype=np.int32)).text for i in ids[3:])
    assert text + detok.add(np.array([], dtype=np.int32)).text + detok.finish() == BYTE_BPE.decode(ids[3:])


# --- stop strings -----------------------------------------------------------------------------


def _run(text: str, stop: list[str], per_token: bool = True) -> tuple[list[str], str, IncrementalDetokenizer]:
    ids = _one_token_per_char(text)
    detok = IncrementalDetokenizer(BYTE_BPE, stop=StopParams(stop=tuple(stop)))
    chunks = [[i] for i in ids] if per_token else [ids]
    pieces = _stream(detok, chunks)
    return pieces, detok.finish(), detok


def test_include_stop_str_in_output_ends_the_text_with_the_match() -> None:
    detok = IncrementalDetokenizer(BYTE_BPE, stop=StopParams(stop=("STOP", "fox S"), include_stop_str_in_output=True))
    pieces = [detok.add(BYTE_BPE.encode(part).ids).text for part in ("The fo", "x ST", "OP here")]
    assert "".join(pieces) + detok.finish() == "The fox S" and detok.stopped  # "fox S" completes first


def test_stop_string_spanning_token_boundaries() -> None:
    pieces, tail, detok = _run("The fox STOP here", ["STOP"])
    assert "".join(pieces) + tail == "The fox "
    assert detok.stopped
    assert tail == ""
    # Nothing after the match is ever emitted, whatever comes next.
    detok = IncrementalDetokenizer(BYTE_BPE, stop=StopParams(stop=("STOP",)))
    assert detok.add(BYTE_BPE.encode("The fox ST").ids).text == "The fox "
    out = detok.add(BYTE_BPE.encode("OP and more").ids)
    assert out.text == "" and out.stopped
    assert detok.add(BYTE_BPE.encode("more text").ids).text == ""
    assert detok.add([5]).stopped
    assert detok.finish() == ""


def test_stop_output_reports_the_match_on_the_step_that_found_it() -> None:
    ids = _one_token_per_char("ab<end>cd")
    detok = IncrementalDetokenizer(BYTE_BPE, stop=StopParams(stop=("<end>",)))
    outs = [detok.add([i]) for i in ids]
    first_stop = next(k for k, o in enumerate(outs) if o.stopped)
    assert first_stop == 6  # the ">" token completes "<end>"
    assert "".join(o.text for o in outs) == "ab"
    assert not any(o.stopped for o in outs[:first_stop])


def test_multiple_stop_strings_earliest_wins() -> None:
    pieces, tail, detok = _run("one two three four", ["four", "two", "three"])
    assert "".join(pieces) + tail == "one " and detok.stopped  # "two": any other match leaves more text
    # Overlapping candidates at the same start: the whole text before it is the same either way.
    pieces, tail, detok = _run("xx abcd", ["abc", "abcd", "bc"])
    assert "".join(pieces) + tail == "xx " and detok.stopped


def test_stop_string_at_the_very_first_token() -> None:
    ids = BYTE_BPE.encode("Hello world").ids
    detok = IncrementalDetokenizer(BYTE_BPE, stop=StopParams(stop=("Hel",)))
    out = detok.add(ids[:1])
    assert out.text == "" and out.stopped
    assert detok.add(ids[1:]).text == "" and detok.finish() == ""


def test_held_back_text_is_released_when_the_match_fails() -> None:
    detok = IncrementalDetokenizer(BYTE_BPE, stop=StopParams(stop=("STOP",)))
    texts = [detok.add([i]).text for i in _one_token_per_char("xSTO")]
    assert texts == ["x", "", "", ""]
    assert detok.add(_one_token_per_char("P")).stopped
    detok = IncrementalDetokenizer(BYTE_BPE, stop=StopParams(stop=("STOP",)))
    texts = [detok.add([i]).text for i in _one_token_per_char("xSTOX")]
    assert texts == ["x", "", "", "", "STOX"]
    # A partial prefix at the end of generation comes out of finish().
    detok = IncrementalDetokenizer(BYTE_BPE, stop=StopParams(stop=("STOP",)))
    assert "".join(detok.add([i]).text for i in _one_token_per_char("aST")) == "a"
    assert detok.finish() == "ST" and not detok.stopped


def test_stop_string_of_multibyte_characters() -> None:
    text = "前文中文後"
    ids = _byte_tokens(text)
    detok = IncrementalDetokenizer(BYTE_BPE, stop=StopParams(stop=("中文",)))
    pieces = [detok.add([i]).text for i in ids]
    assert "".join(pieces) == "前文" and detok.stopped
    assert all("\ufffd" not in p for p in pieces)


def test_empty_stop_strings_are_ignored() -> None:
    pieces, tail, detok = _run("abc", ["", "zz"])
    assert "".join(pieces) + tail == "abc" and not detok.stopped


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab中😀 ", max_size=30),
    stops=st.lists(st.text(alphabet="ab中😀 ", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 200), max_size=8),
)
def test_stop_strings_property(text: str, stops: list[str], cuts: list[int]) -> None:
    ids = BYTE_BPE.encode(text).ids
    # Reference: stream the text one character at a time and stop at the first completed match.
    expected, matched = text, None
    for end in range(1, len(text) + 1):
        ending_here = [s for s in stops if text[:end].endswith(s)]
        if ending_here:
            matched = max(ending_here, key=len)
            expected = text[: end - len(matched)]
            break
    detok = IncrementalDetokenizer(BYTE_BPE, stop=StopParams(stop=tuple(stops)))
    emitted = ""
    for chunk in _chunked(ids, cuts):
        out = detok.add(chunk)
        emitted += out.text
        assert expected.startswith(emitted)
    emitted += detok.finish()
    assert emitted == expected
    assert detok.stopped == (matched is not None)  # the emitted text above pins which stop matched


def test_matcher_holds_the_longest_partial_prefix() -> None:
    m = StopStringMatcher(["abcd", "cx"])
    assert m.feed("zzab") == "zz" and m.held == "ab"
    assert m.feed("c") == "" and m.held == "abc"
    assert m.feed("y") == "abcy" and m.held == ""
    assert m.feed("abc") == "" and m.held == "abc"
    assert m.feed("x") == "ab" and m.matched == "cx"
    assert m.feed("anything") == "" and m.flush() == ""


def test_matcher_without_stops_passes_text_through() -> None:
    m = StopStringMatcher()
    assert not m.active and m.feed("abc") == "abc" and m.flush() == ""


def test_add_after_finish_is_an_error() -> None:
    detok = IncrementalDetokenizer(BYTE_BPE)
    detok.add([5])
    detok.finish()
    with pytest.raises(RuntimeError):
        detok.add([6])


def test_unsupported_tokenizer_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        IncrementalDetokenizer(object())


# ---------------------------------------------------------------------------------------------
# Logprobs: ids (scheduler) -> token texts (api), through the process's `Detokenizers` and the
# scheduler's `token_deltas`.


def test_logprobs_get_token_texts_and_the_prompt_its_text() -> None:
    from batchserve.procs.detokenizer.process import Detokenizers
    from batchserve.shared.messages import TokenDelta, TokenLogprobs

    tok = _train_byte_level_bpe()
    ids = tok.encode("hello world").ids
    gen = tok.encode(" again").ids
    detok = Detokenizers(tok)
    first = TokenDelta(
        rid="r",
        token_ids=gen[:1],
        prompt_tokens=len(ids),
        completion_tokens=1,
        logprobs=[TokenLogprobs(gen[0], -0.5, [gen[0], ids[0]], [-0.5, -2.0])],
        prompt_ids=ids,
        prompt_logprobs=[TokenLogprobs(t, -1.0 - i, [], []) for i, t in enumerate(ids[1:])],
    )
    out, abort = detok.handle(first)
    assert out is not None and not abort
    assert out.prompt_text == "hello world"
    assert [e.token for e in out.prompt_logprobs] == [tok.decode([t]) for t in ids]
    assert out.prompt_logprobs[0].logprob is None and out.prompt_logprobs[1].logprob == -1.0
    (entry,) = out.logprobs
    assert (entry.token, entry.token_id, entry.logprob) == (tok.decode(gen[:1]), gen[0], -0.5)
    assert [(t.token, t.token_id, t.logprob) for t in entry.top] == [
        (tok.decode([gen[0]]), gen[0], -0.5),
        (tok.decode([ids[0]]), ids[0], -2.0),
    ]
    last, _ = detok.handle(
        TokenDelta(rid="r", token_ids=gen[1:2], finish_reason="length", prompt_tokens=len(ids), completion_tokens=2)
    )
    assert last is not None and last.logprobs == [] and last.prompt_text is None and last.usage is not None


def _delta_scheduler():
    from batchserve.procs.scheduler import Scheduler, SchedulerConfig

    return Scheduler(SchedulerConfig(max_running_requests=2, prefill_budget=64, kv_capacity_tokens=64))


def test_token_deltas_carry_logprobs_and_prompt_logprobs_once() -> None:
    from batchserve.procs.scheduler.core import StepOutput
    from batchserve.shared.messages import LogitsParams, TokenLogprobs

    sched = _delta_scheduler()
    prompt = np.array([5, 6, 7], dtype=np.int32)
    sched.add_request(
        "a", prompt, RequestParams(stop=StopParams(max_tokens=4), logits=LogitsParams(logprobs=1, prompt_logprobs=0))
    )
    sched.add_request("b", prompt, RequestParams(stop=StopParams(max_tokens=4)))
    lp = TokenLogprobs(9, -0.1, [9], [-0.1])
    plp = [TokenLogprobs(6, -3.0, [], []), TokenLogprobs(7, -2.0, [], [])]
    first = sched.token_deltas(
        StepOutput(
            step=0,
            new_tokens=[("a", 9), ("b", 4)],
            token_counts=[1, 1],
            logprobs={"a": [lp]},
            prompt_logprobs={"a": plp},
        )
    )
    a, b = first
    assert (a.logprobs, a.prompt_ids, a.prompt_logprobs) == ([lp], [5, 6, 7], plp)
    assert (b.logprobs, b.prompt_ids, b.prompt_logprobs) == ([], [], [])
    (second,) = sched.token_deltas(StepOutput(step=1, new_tokens=[("a", 8)], token_counts=[2], logprobs={"a": [lp]}))
    assert second.logprobs == [lp] and second.prompt_ids == []


def test_prompt_logprobs_survive_a_request_that_ends_with_its_first_token() -> None:
    from batchserve.shared.messages import ForwardBatch, LogitsParams, StepResult, TokenLogprobs

    plp = [TokenLogprobs(6, -3.0, [4], [-1.0])]

    class Worker:
        def execute(self, batch: ForwardBatch) -> StepResult:
            return StepResult(
                step=batch.step, next_token_ids=np.array([9], dtype=np.int32), prompt_logprobs=[(batch.slots[0], plp)]
            )

    sched = _delta_scheduler()
    sched.add_request(
        "a",
        np.array([5, 6], dtype=np.int32),
        RequestParams(stop=StopParams(max_tokens=1), logits=LogitsParams(prompt_logprobs=1)),
    )
    out = sched.step(Worker())
    assert out.finished == ["a"] and not sched.has_unfinished()
    (only,) = sched.token_deltas(out)
    assert (only.finish_reason, only.prompt_ids, only.prompt_logprobs) == ("length", [5, 6], plp)
