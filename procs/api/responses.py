"""OpenAI's response shapes for `/v1/completions` and `/v1/chat/completions`, whole and streamed.

A stream is: (chat only) a first chunk per choice with `delta.role`, a content chunk per engine delta
that made tokens (its text empty while they have none of their own), one chunk per choice with its
`finish_reason` and an empty text/delta, and with `stream_options.include_usage` a last chunk with
empty `choices` and `usage` (all earlier chunks then carry `"usage": null`, as OpenAI's do). Every
choice object carries its `index`.

Logprobs, when asked for, are per chunk for the tokens of that chunk (whole answers: all tokens):
chat `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], "refusal": null}`,
completions `{tokens, token_logprobs, top_logprobs: [{token: logprob} incl. the token itself], text_offset}`
(text_offset: each token's character offset in the choice's text). With echo a choice's text and
tokens start with its prompt's (the first prompt token has logprob and top_logprobs null).

Chat answers of requests with tools (tool_choice not "none"), or of a model that thinks in
`<think>` blocks, are parsed into `tool_calls` and `reasoning_content` (`chat_output.py`). Streamed,
text may then be held back for a while; the logprobs of its tokens go with the next chunk sent.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import msgspec

from batchserve.procs.api.chat_output import ChatOutputStream, parse_whole
from batchserve.procs.api.errors import error_body
from batchserve.shared.chat_format import ReasoningFormat
from batchserve.shared.messages import TextDelta, TokenLogprob, Usage

_encoder = msgspec.json.Encoder()
SSE_DONE = b"data: [DONE]\n\n"
MIN_LOGPROB = -9999.0  # -inf is not JSON; vLLM clamps the same way


def sse_event(obj: Any) -> bytes:
    return b"data: " + _encoder.encode(obj) + b"\n\n"


def usage_dict(usage: Usage) -> dict[str, Any]:
    """OpenAI's usage object; with speculative decoding, its draft tokens as OpenAI counts a predicted
    output's (`completion_tokens_details`)."""
    out: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    if usage.draft_tokens:
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": usage.accepted_tokens,
            "rejected_prediction_tokens": usage.draft_tokens - usage.accepted_tokens,
        }
    return out


@dataclass
class Piece:
    """Text of a choice, and the tokens behind it with their character offsets in the choice's text."""

    text: str = ""
    tokens: list[TokenLogprob] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    generated: int = 0  # generated tokens behind the text (tokens holds logprobs, when asked for)


class ChoiceOutput:
    """One choice's answer, built from its engine deltas.

    `leader` is choice 0 of the same prompt (None for choice 0 itself): with echo only the leader asks
    the engine for the prompt's text and logprobs, and the others repeat them. `collect` keeps every
    piece for a whole (non-streamed) answer.
    """

    def __init__(
        self,
        index: int,
        *,
        leader: ChoiceOutput | None = None,
        echo: bool = False,
        drop_generated: bool = False,
        collect: bool = False,
    ) -> None:
        self.index = index
        self.leader = leader
        self.echo = echo
        self.drop_generated = drop_generated
        self.collected: list[Piece] | None = [] if collect else None
        self.prompt: tuple[str, list[TokenLogprob]] | None = None  # text and logprobs, once the engine sent them
        self.chars = 0  # characters of text so far: the next token's text_offset
        self.tokens = 0  # generated tokens delivered
        self.started = False
        self.finish_reason: str | None = None
        self.usage: Usage | None = None

    def add(self, delta: TextDelta) -> Piece:
        """Take the next delta; what it adds to the answer."""
        piece = Piece()
        if delta.prompt_text is not None:
            self.prompt = (delta.prompt_text, delta.prompt_logprobs)
        if self.echo and not self.started:
            prompt = self.prompt if self.leader is None else self.leader.prompt
            if prompt is not None:
                self._extend(piece, *prompt)
        self.started = True
        if not self.drop_generated:
            self.tokens += len(delta.token_ids)
            piece.generated = len(delta.token_ids)
            self._extend(piece, delta.text, delta.logprobs)
        if delta.finish_reason is not None:
            # echo with max_tokens 0: the one token the engine made is not part of the answer
            self.finish_reason = "length" if self.drop_generated else delta.finish_reason
            self.usage = delta.usage
        if self.collected is not None:
            self.collected.append(piece)
        return piece

    def _extend(self, piece: Piece, text: str, tokens: list[TokenLogprob]) -> None:
        offset = self.chars
        for token in tokens:
            piece.offsets.append(offset)
            offset += len(token.token)
        piece.text += text
        piece.tokens += tokens
        self.chars += len(text)

    def whole(self) -> Piece:
        pieces = self.collected or []
        return Piece(
            "".join(p.text for p in pieces),
            [t for p in pieces for t in p.tokens],
            [o for p in pieces for o in p.offsets],
        )

    @property
    def completion_tokens(self) -> int:
        if self.drop_generated:
            return 0
        # The engine always sends usage with the last delta; count what was delivered if not.
        return self.usage.completion_tokens if self.usage is not None else self.tokens


def total_usage(choices: list[ChoiceOutput]) -> Usage:
    """As OpenAI counts: each prompt once (from its choice 0), the completion tokens of every choice."""
    leaders = [c.usage for c in choices if c.leader is None and c.usage is not None]
    prompt = sum(u.prompt_tokens for u in leaders)
    completion = sum(c.completion_tokens for c in choices)
    every = [c.usage for c in choices if c.usage is not None]
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        cached_tokens=sum(u.cached_tokens for u in leaders),
        draft_tokens=sum(u.draft_tokens for u in every),
        accepted_tokens=sum(u.accepted_tokens for u in every),
    )


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _logprob(value: float | None) -> float | None:
    """None (a prompt's first token) stays None."""
    return None if value is None else _clamp(value)


class ResponseShapes(ABC):
    """Builds one request's JSON objects; `object`/`chunk_object` and the choice layout differ per endpoint."""

    object: str
    chunk_object: str

    def __init__(
        self,
        rid: str,
        model: str,
        include_usage: bool = False,
        logprobs: bool = False,
        *,
        tool_names: frozenset[str] = frozenset(),
        reasoning: ReasoningFormat = "",
    ) -> None:
        self.rid = rid
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        self.logprobs = logprobs  # report them
        # chat only: parse tool calls of these functions / split <think> reasoning out of the answer
        self.tool_names = tool_names
        self.reasoning = reasoning

    def _envelope(self, obj_type: str, choices: list[dict]) -> dict[str, Any]:
        return {"id": self.rid, "object": obj_type, "created": self.created, "model": self.model, "choices": choices}

    def _chunk(self, choice: dict) -> dict[str, Any]:
        chunk = self._envelope(self.chunk_object, [choice])
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _logprobs_of(self, piece: Piece) -> dict[str, Any] | None:
        return self._logprobs(piece) if self.logprobs else None

    def start_chunk(self, index: int) -> dict[str, Any] | None:
        """The chunk sent for a choice before any text (chat: the role), or None."""
        return None

    def stream_chunks(self, choice: ChoiceOutput, piece: Piece) -> list[dict[str, Any]]:
        """The chunks to send for `piece`, the part of `choice` its last delta added (and its finish).

        A chunk for every delta that made tokens, its text empty where they have none of their own yet (part
        of a multi-byte character, a skipped special token, text held back by a stop string), as vLLM and
        SGLang stream: a client sees each step's progress and can count tokens by chunks."""
        chunks = []
        if piece.text or piece.generated or (self.logprobs and piece.tokens):
            chunks.append(self.text_chunk(choice.index, piece))
        if choice.finish_reason is not None:
            chunks.append(self.finish_chunk(choice.index, choice.finish_reason))
        return chunks

    def text_chunk(self, index: int, piece: Piece) -> dict[str, Any]:
        return self._chunk(self._choice(index, piece.text, self._logprobs_of(piece), None, streamed=True))

    def finish_chunk(self, index: int, finish_reason: str) -> dict[str, Any]:
        return self._chunk(self._choice(index, "", None, finish_reason, streamed=True))

    def full(self, choices: list[ChoiceOutput], usage: Usage) -> dict[str, Any]:
        out = []
        for c in choices:
            piece = c.whole()
            out.append(self._choice(c.index, piece.text, self._logprobs_of(piece), c.finish_reason, streamed=False))
        obj = self._envelope(self.object, out)
        obj["usage"] = usage_dict(usage)
        return obj

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        chunk = self._envelope(self.chunk_object, [])
        chunk["usage"] = usage_dict(usage)
        return chunk

    # ---- a stream's bytes: what `app._stream` writes (the Responses API frames its events differently)

    def stream_start(self, choices: list[ChoiceOutput]) -> bytes:
        starts = [self.start_chunk(c.index) for c in choices]
        return b"".join(sse_event(c) for c in starts if c is not None)

    def stream_bytes(self, choice: ChoiceOutput, piece: Piece) -> bytes:
        return b"".join(sse_event(chunk) for chunk in self.stream_chunks(choice, piece))

    def stream_end(self, choices: list[ChoiceOutput], usage: Usage) -> bytes:
        """After the last choice's finish."""
        return (sse_event(self.usage_chunk(usage)) if self.include_usage else b"") + SSE_DONE

    def stream_failure(self, unfinished: list[ChoiceOutput], status: int, message: str, param: str | None) -> bytes:
        """The end of a stream the engine failed: each unfinished choice's "abort", an error event, [DONE]."""
        aborts = b"".join(sse_event(self.finish_chunk(c.index, "abort")) for c in unfinished)
        return aborts + sse_event(error_body(status, message, param)) + SSE_DONE

    def engine_param(self, param: str | None) -> str | None:
        """The request field an engine refusal names, in this endpoint's terms."""
        return param

    @abstractmethod
    def _choice(
        self, index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None, *, streamed: bool
    ) -> dict[str, Any]: ...

    @abstractmethod
    def _logprobs(self, piece: Piece) -> dict[str, Any]: ...


class CompletionShapes(ResponseShapes):
    object = "text_completion"
    chunk_object = "text_completion"

    def _choice(
        self, index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None, *, streamed: bool
    ) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def _logprobs(self, piece: Piece) -> dict[str, Any]:
        top: list[dict[str, float] | None] = []
        for t in piece.tokens:
            if t.logprob is None:  # a prompt's first token: nothing before it to predict it from
                top.append(None)
            else:  # as vLLM's: the alternatives and the token itself
                top.append({**{a.token: _clamp(a.logprob) for a in t.top}, t.token: _clamp(t.logprob)})
        return {
            "tokens": [t.token for t in piece.tokens],
            "token_logprobs": [_logprob(t.logprob) for t in piece.tokens],
            "top_logprobs": top,
            "text_offset": list(piece.offsets),
        }


class ChatShapes(ResponseShapes):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.parses = bool(self.tool_names) or self.reasoning  # the text is not simply the content
        self._streams: dict[int, ChatOutputStream] = {}
        self._unsent: dict[int, list[TokenLogprob]] = {}  # tokens whose text is held back: their logprobs

    def stream_chunks(self, choice: ChoiceOutput, piece: Piece) -> list[dict[str, Any]]:
        if not self.parses:
            return super().stream_chunks(choice, piece)
        index = choice.index
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = ChatOutputStream(tool_names=self.tool_names, reasoning=self.reasoning)
        unsent = self._unsent.setdefault(index, [])
        if self.logprobs:
            unsent += piece.tokens
        deltas = stream.feed(piece.text)
        if choice.finish_reason is not None:
            rest, choice.finish_reason = stream.finish(choice.finish_reason)
            deltas += rest
        chunks = []
        for delta in deltas:
            chunks.append(
                self._chunk(
                    {"index": index, "delta": delta, "logprobs": self._take_logprobs(unsent), "finish_reason": None}
                )
            )
        if choice.finish_reason is not None:
            chunks.append(
                self._chunk(
                    {
                        "index": index,
                        "delta": {},
                        "logprobs": self._take_logprobs(unsent),
                        "finish_reason": choice.finish_reason,
                    }
                )
            )
        return chunks

    def _take_logprobs(self, unsent: list[TokenLogprob]) -> dict[str, Any] | None:
        if not unsent:
            return None
        logprobs = self._logprobs(Piece(tokens=list(unsent)))
        unsent.clear()
        return logprobs

    def full(self, choices: list[ChoiceOutput], usage: Usage) -> dict[str, Any]:
        if not self.parses:
            return super().full(choices, usage)
        out = []
        for c in choices:
            piece = c.whole()
            message, c.finish_reason = parse_whole(
                piece.text, c.finish_reason, tool_names=self.tool_names, reasoning=self.reasoning
            )
            out.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": self._logprobs_of(piece),
                    "finish_reason": c.finish_reason,
                }
            )
        obj = self._envelope(self.object, out)
        obj["usage"] = usage_dict(usage)
        return obj

    def start_chunk(self, index: int) -> dict[str, Any]:
        return self._chunk(
            {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        )

    def _choice(
        self, index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None, *, streamed: bool
    ) -> dict[str, Any]:
        if streamed:
            body = {"delta": {"content": text} if finish_reason is None else {}}
        else:
            body = {"message": {"role": "assistant", "content": text}}
        return {"index": index, **body, "logprobs": logprobs, "finish_reason": finish_reason}

    def _logprobs(self, piece: Piece) -> dict[str, Any]:
        content = [
            {**_chat_logprob(t.token, t.logprob), "top_logprobs": [_chat_logprob(a.token, a.logprob) for a in t.top]}
            for t in piece.tokens
        ]
        return {"content": content, "refusal": None}


def _chat_logprob(token: str, logprob: float | None) -> dict[str, Any]:
    return {"token": token, "logprob": _logprob(logprob), "bytes": list(token.encode("utf-8"))}
