"""The Responses API's answer: the `response` object (whole) or its typed SSE events (streamed).

Output: a `reasoning` item (the model's `<think>` text, when the model thinks), a `message` item
with one `output_text` part (left out when the answer is only tool calls) and a `function_call`
item per parsed call; `status` "incomplete" with `incomplete_details.reason` "max_output_tokens"
when the answer was cut. Streamed: `response.created`, `response.in_progress`, then per item
`response.output_item.added`, (`response.content_part.added`, `response.output_text.delta`s /
`response.reasoning_text.delta`s, their `.done`, `response.content_part.done`) or
(`response.function_call_arguments.delta`/`.done`), `response.output_item.done`, and last
`response.completed` (`response.incomplete` when cut, as OpenAI ends such a stream), each with a
`sequence_number`; SSE with `event:` lines and no `[DONE]`. An engine failure mid-stream ends with
an `error` event and `response.failed`.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

import msgspec

from batchserve.procs.api.chat_output import ChatOutputStream, ReasoningStream, parse_whole
from batchserve.procs.api.responses import MIN_LOGPROB, ChoiceOutput, Piece, ResponseShapes
from batchserve.shared.chat_format import ReasoningFormat
from batchserve.shared.messages import TokenLogprob, Usage


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def usage_of(usage: Usage, reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


def _logprob(t: TokenLogprob) -> dict[str, Any]:
    def one(token: str, logprob: float | None) -> dict[str, Any]:
        return {
            "token": token,
            "logprob": max(logprob if logprob is not None else MIN_LOGPROB, MIN_LOGPROB),
            "bytes": list(token.encode("utf-8")),
        }

    return {**one(t.token, t.logprob), "top_logprobs": [one(a.token, a.logprob) for a in t.top]}


class _ReasoningTokens:
    """Counts the generated tokens of the `<think>` part, delta by delta (the deltas it spans)."""

    def __init__(self) -> None:
        self.stream = ReasoningStream()
        self.count = 0
        self.pending = 0  # deltas before the text shows whether it opens with <think>

    def feed(self, piece: Piece) -> None:
        before = self.stream.state
        self.stream.feed(piece.text)
        if before == "start" or before == "reasoning":
            if self.stream.state == "start":
                self.pending += piece.generated
            elif self.stream.state != "content" or before == "reasoning":  # thinking, or just closed it
                self.count += self.pending + piece.generated
                self.pending = 0
            else:
                self.pending = 0


def message_item(item_id: str, text: str, logprobs: list[dict] | None, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def call_item(call: dict[str, Any]) -> dict[str, Any]:
    """A chat `tool_calls` entry as a `function_call` item."""
    return {
        "id": new_id("fc"),
        "type": "function_call",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": "completed",
    }


class ResponsesShapes(ResponseShapes):
    """One response: the `response` object (whole), or its SSE events (streamed). One choice only.

    `echo` holds the request's fields the response object repeats; `keep(response)` is
    called with the finished response (for the store), if given."""

    object = "response"
    chunk_object = "response"

    def __init__(
        self,
        rid: str,
        model: str,
        *,
        echo: dict[str, Any],
        logprobs: bool,
        tool_names: frozenset[str],
        reasoning: ReasoningFormat,
        keep: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        super().__init__(rid, model, logprobs=logprobs, tool_names=tool_names, reasoning=reasoning)
        self.echo = echo
        self.keep = keep
        self.parses = bool(tool_names) or reasoning
        # streaming state
        self.sequence = 0
        self.done_items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed: {"kind", "id", "text", "logprobs"}
        self.output_stream = ChatOutputStream(tool_names=tool_names, reasoning=reasoning) if self.parses else None
        self.reasoning_tokens = _ReasoningTokens() if reasoning == "think" else None
        self.unsent: list[TokenLogprob] = []  # tokens whose text is held back: their logprobs go with the next text

    def engine_param(self, param: str | None) -> str | None:
        return "input" if param == "messages" else param

    # ---- the response object

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
        reason: str | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": {"reason": reason} if status == "incomplete" else None,
            "model": self.model,
            "output": output,
            "usage": usage,
            **self.echo,
        }

    def _finished(self, finish_reason: str | None, output: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
        tokens = self.reasoning_tokens.count if self.reasoning_tokens is not None else 0
        reason: str | None
        if finish_reason == "length":
            status, reason = "incomplete", "max_output_tokens"
        else:
            status, reason = ("completed", None) if finish_reason in ("stop", "tool_calls") else ("incomplete", None)
        obj = self.response(status, output, usage_of(usage, tokens), reason)
        if self.keep is not None:
            self.keep(obj)
        return obj

    def full(self, choices: list[ChoiceOutput], usage: Usage) -> dict[str, Any]:
        (choice,) = choices
        piece = choice.whole()
        if self.reasoning_tokens is not None:
            for p in choice.collected or []:
                self.reasoning_tokens.feed(p)
        if self.parses:
            message, choice.finish_reason = parse_whole(
                piece.text, choice.finish_reason, tool_names=self.tool_names, reasoning=self.reasoning
            )
        else:
            message = {"content": piece.text}
        output = []
        if message.get("reasoning_content"):
            output.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
        calls = message.get("tool_calls") or []
        if message["content"] or not calls:
            output.append(
                self._choice(
                    0, message["content"] or "", self._logprobs_of(piece), choice.finish_reason, streamed=False
                )
            )
        output += [call_item(call) for call in calls]
        return self._finished(choice.finish_reason, output, usage)

    def _choice(
        self, index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None, *, streamed: bool
    ) -> dict[str, Any]:
        """The answer's message item (what chat calls a choice)."""
        return message_item(
            new_id("msg"),
            text,
            (logprobs or {}).get("content"),
            "incomplete" if finish_reason == "length" else "completed",
        )

    def _logprobs(self, piece: Piece) -> dict[str, Any]:
        return {"content": [_logprob(t) for t in piece.tokens]}

    # ---- streamed events

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(payload) + b"\n\n"

    def stream_start(self, choices: list[ChoiceOutput]) -> bytes:
        started = self.response("in_progress", [], None)
        return self._event("response.created", response=started) + self._event("response.in_progress", response=started)

    def stream_bytes(self, choice: ChoiceOutput, piece: Piece) -> bytes:
        if self.reasoning_tokens is not None:
            self.reasoning_tokens.feed(piece)
        if self.logprobs:
            self.unsent += piece.tokens
        if self.output_stream is None:
            deltas = [{"content": piece.text}] if piece.text else []
        else:
            deltas = self.output_stream.feed(piece.text)
            if choice.finish_reason is not None:
                rest, choice.finish_reason = self.output_stream.finish(choice.finish_reason)
                deltas += rest
        return b"".join(self._delta_events(delta) for delta in deltas)

    def _delta_events(self, delta: dict[str, Any]) -> bytes:
        ((key, value),) = delta.items()
        if key == "tool_calls":
            out = self._close()
            for call in value:
                item = call_item(call)
                index = len(self.done_items)
                out += self._event(
                    "response.output_item.added",
                    output_index=index,
                    item={**item, "arguments": "", "status": "in_progress"},
                )
                out += self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=item["arguments"],
                )
                out += self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
                out += self._event("response.output_item.done", output_index=index, item=item)
                self.done_items.append(item)
            return out
        kind = "reasoning" if key == "reasoning_content" else "message"
        out, streamed = b"", self.open
        if streamed is None or streamed["kind"] != kind:
            out += self._close()
            opening, streamed = self._open(kind)
            out += opening
        streamed["text"] += value
        ids = {"item_id": streamed["id"], "output_index": len(self.done_items), "content_index": 0}
        if kind == "reasoning":
            return out + self._event("response.reasoning_text.delta", **ids, delta=value)
        logprobs = [_logprob(t) for t in self.unsent]
        self.unsent = []
        streamed["logprobs"] += logprobs
        return out + self._event("response.output_text.delta", **ids, delta=value, logprobs=logprobs)

    def _open(self, kind: str) -> tuple[bytes, dict[str, Any]]:
        """A new `kind` item, streamed from now (`self.open`): the events that announce it, and the item."""
        opened: dict[str, Any] = {
            "kind": kind,
            "id": new_id("rs" if kind == "reasoning" else "msg"),
            "text": "",
            "logprobs": [],
        }
        self.open = opened
        index = len(self.done_items)
        if kind == "reasoning":
            item = {"id": opened["id"], "type": "reasoning", "summary": [], "status": "in_progress"}
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = {
                "id": opened["id"],
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events = self._event("response.output_item.added", output_index=index, item=item) + self._event(
            "response.content_part.added", item_id=opened["id"], output_index=index, content_index=0, part=part
        )
        return events, opened

    def _close(self, status: str = "completed") -> bytes:
        if self.open is None:
            return b""
        item, self.open = self.open, None
        ids = {"item_id": item["id"], "output_index": len(self.done_items), "content_index": 0}
        if item["kind"] == "reasoning":
            done = reasoning_item(item["id"], item["text"], status)
            out = self._event("response.reasoning_text.done", **ids, text=item["text"]) + self._event(
                "response.content_part.done", **ids, part=done["content"][0]
            )
        else:
            done = message_item(item["id"], item["text"], item["logprobs"], status)
            out = self._event(
                "response.output_text.done", **ids, text=item["text"], logprobs=item["logprobs"]
            ) + self._event("response.content_part.done", **ids, part=done["content"][0])
        out += self._event("response.output_item.done", output_index=ids["output_index"], item=done)
        self.done_items.append(done)
        return out

    def stream_end(self, choices: list[ChoiceOutput], usage: Usage) -> bytes:
        (choice,) = choices
        cut = choice.finish_reason == "length"
        out = b""
        if not any(item["type"] == "message" for item in self.done_items) and (
            self.open is not None or not any(item["type"] == "function_call" for item in self.done_items)
        ):
            if self.open is None or self.open["kind"] != "message":  # an answer of no text: an empty message
                out += self._close() + self._open("message")[0]
        out += self._close("incomplete" if cut else "completed")
        final = self._finished(choice.finish_reason, list(self.done_items), usage)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return out + self._event(kind, response=final)

    def stream_failure(self, unfinished: list[ChoiceOutput], status: int, message: str, param: str | None) -> bytes:
        code = "server_error" if status >= 500 else "invalid_request_error"
        failed = self.response("failed", list(self.done_items), None, error={"code": code, "message": message})
        return self._event("error", code=code, message=message, param=param) + self._event(
            "response.failed", response=failed
        )
