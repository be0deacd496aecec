"""Incremental detokenization of one request's generated tokens, with stop strings.

The prefix/read-offset technique (as vLLM's `detokenize_incrementally` and HF's TextStreamer): each
step decodes only a short window of recent tokens, starting at `prefix_offset`, a token boundary
where the text was last complete. Decoding from there keeps whatever the decoder does at the start
of a sequence (a SentencePiece tokenizer drops the first leading space) identical between the
window decode and the text already emitted, and byte-level BPE tokens that carry part of a UTF-8
character never leave half a character: while the window's text ends in U+FFFD (an incomplete
sequence so far) those trailing characters are held back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import tokenizers

from batchserve.procs.detokenizer.stop_strings import StopStringMatcher
from batchserve.shared.messages import NO_STOP, PROMPT_TAIL_TOKENS, StopParams

REPLACEMENT_CHAR = "\ufffd"
# Drop consumed ids from the front of the buffer once this many have piled up (amortised O(1)).
_TRIM_THRESHOLD = 64


@dataclass(frozen=True, slots=True)
class DetokenizerOutput:
    text: str  # new text, safe to send
    stopped: bool = False  # a stop string matched: `text` ends before it (or with it, if asked); nothing follows


Decode = Callable[[list[int]], str]


def special_token_ids(tokenizer: object) -> frozenset[int]:
    """The ids of a `tokenizers.Tokenizer`'s or a transformers tokenizer's special tokens (those a decode
    with `skip_special_tokens` leaves out)."""
    backend = (
        tokenizer if isinstance(tokenizer, tokenizers.Tokenizer) else getattr(tokenizer, "backend_tokenizer", None)
    )
    if isinstance(backend, tokenizers.Tokenizer):
        return frozenset(i for i, token in backend.get_added_tokens_decoder().items() if token.special)
    return frozenset(getattr(tokenizer, "all_special_ids", ()))


def make_decode(tokenizer: object, *, skip_special_tokens: bool = True) -> Decode:
    """A `decode(ids) -> str` for a `tokenizers.Tokenizer` or a transformers tokenizer.

    Fast transformers tokenizers are decoded through their Rust backend directly: the same text as
    `tokenizer.decode(ids, skip_special_tokens=...)` without the per-call Python overhead, and
    without `clean_up_tokenization_spaces`, which cannot be applied incrementally.
    """
    backend = tokenizer if isinstance(tokenizer, tokenizers.Tokenizer) else None
    if backend is None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, tokenizers.Tokenizer):
        decode_backend = backend.decode

        def decode(ids: list[int]) -> str:
            return decode_backend(ids, skip_special_tokens=skip_special_tokens)

        return decode
    decode_method = getattr(tokenizer, "decode", None)
    if not callable(decode_method):
        raise TypeError(f"cannot detokenize with {type(tokenizer).__name__}: it has no decode()")

    def decode_slow(ids: list[int]) -> str:
        return decode_method(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    return decode_slow


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text, step by step.

    `add(ids)` returns the new text that is safe to send; `finish()` returns what was held back
    (a partial stop-string prefix, an incomplete UTF-8 tail) once generation has ended. The
    concatenation of everything returned equals `decode(all generated ids)` up to the first stop
    string (included only with `include_stop_str_in_output`). (One exception, shared with vLLM: a
    byte-fallback tokenizer whose output ends in invalid UTF-8 decodes the whole final byte run as
    U+FFFDs, including characters already sent; valid UTF-8 output always matches.)
    """

    def __init__(
        self,
        tokenizer: object,
        *,
        prompt_ids: Sequence[int] = (),
        stop: StopParams = NO_STOP,
        skip_special_tokens: bool = True,
    ) -> None:
        """`stop`: the request's (`StopParams.stop`: its stop strings)."""
        self._decode = make_decode(tokenizer, skip_special_tokens=skip_special_tokens)
        self._skipped = special_token_ids(tokenizer) if skip_special_tokens else frozenset()
        self._stop = StopStringMatcher(stop.stop, include_match=stop.include_stop_str_in_output)
        # `_ids[_prefix_offset:_read_offset]` were decoded and emitted (or are prompt context);
        # `_emitted_len` is how many characters of `decode(_ids[_prefix_offset:])` are emitted.
        context = [int(t) for t in prompt_ids[max(0, len(prompt_ids) - PROMPT_TAIL_TOKENS) :]]
        context_text = self._decode(context) if context else ""
        if context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: decode the generated ids on their own instead.
            context, context_text = [], ""
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._emitted_len = len(context_text)
        self._finished = False

    @property
    def stopped(self) -> bool:
        return self._stop.matched is not None

    def add(self, token_ids: Sequence[int]) -> DetokenizerOutput:
        """Append generated tokens; return the new text that is safe to send."""
        if self._finished:
            raise RuntimeError("add() after finish()")
        if self.stopped or len(token_ids) == 0:
            return self._output("")
        self._ids.extend(int(t) for t in token_ids)
        return self._output(self._stop.feed(self._decode_new(final=False)))

    def finish(self) -> str:
        """End of generation: return all held-back text (an incomplete UTF-8 tail included, as
        U+FFFD, exactly as a full decode shows it). Stops at a stop string found in it."""
        if self._finished:
            return ""
        self._finished = True
        if self.stopped:
            return ""
        text = self._stop.feed(self._decode_new(final=True))
        return text + self._stop.flush()

    def _decode_new(self, *, final: bool) -> str:
        text = self._decode(self._ids[self._prefix_offset :])
        # Hold the whole trailing run of U+FFFD: byte-level BPE shows an incomplete character as
        # one U+FFFD, but byte-fallback decoders (Llama/Mistral SentencePiece) show one per byte.
        stable_end = len(text) if final else len(text.rstrip(REPLACEMENT_CHAR))
        new_text = text[self._emitted_len : stable_end] if stable_end > self._emitted_len else ""
        # max(): a byte-fallback run can turn already-sent text into U+FFFDs until it completes.
        self._emitted_len = max(self._emitted_len, stable_end)
        if stable_end == len(text):
            self._advance_window()
        return new_text

    def _advance_window(self) -> None:
        """The text is complete at the end of `_ids`: the next window starts at the last read
        offset, keeping the previously read tokens as decoding context. Not while the tokens read
        since show no text: a window starting with them alone would decode its next word as a
        sequence's first (a SentencePiece-style decoder drops its space). Skipped special tokens are
        dropped instead (every decode leaves them out), so a run of them costs nothing later."""
        if self._read_offset == len(self._ids):
            return
        if all(t in self._skipped for t in self._ids[self._read_offset :]):
            del self._ids[self._read_offset :]
            return
        text = self._decode(self._ids[self._read_offset :])  # the next window's whole text, emitted
        if not text:
            return
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._emitted_len = len(text)
        if self._prefix_offset >= _TRIM_THRESHOLD:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _output(self, text: str) -> DetokenizerOutput:
        return DetokenizerOutput(text=text, stopped=self.stopped)
