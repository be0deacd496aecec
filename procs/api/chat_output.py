"""A chat answer's text as OpenAI structures it: `<think>` reasoning split out into
`reasoning_content`, and tool calls parsed out of the text into `tool_calls`.

The engine only ever sends text. Whole answers are parsed once (`parse_whole`); streamed ones
through a `ChatOutputStream` per choice, which holds back what may still turn out to be markup (a
partial `<think>`, `</think>` or `<tool_call>`) and emits OpenAI deltas.

A harmony answer (gpt-oss: `ChatFormat.reasoning` "harmony") is channel messages, which
`procs.api.harmony_output` reads whole (reasoning, content and calls alike); what follows is the rest.

Reasoning (when the model's chat template thinks, `ChatFormat.reasoning` "think"): a text that starts
(after whitespace) with `<think>` has everything up to `</think>` as reasoning (all of it, if the
block never closes). Whole answers also take a `</think>` without an opening tag (templates that
open the block in the prompt, as DeepSeek-R1's) as the end of the reasoning. Streamed, an output
that does not start with `<think>` is content from its first characters: vLLM's Qwen3 reasoning
parser does the same, since waiting for a `</think>` that may never come would hold the whole answer
back. Content after `</think>` has its leading whitespace stripped.

Tool calls (the request had tools and tool_choice is not "none"), in the content part:
- Hermes blocks `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, anywhere in
  the text (the format of Qwen/Hermes templates and of the prompt the tokenizer writes for templates
  without tools; `shared/chat_format.py`);
- a bare JSON object (optionally after `<|python_tag|>`) that is the whole text, with a "name" among
  the tools and "arguments" or "parameters" (Llama 3.1+).
A block whose JSON does not parse, is not an object, names an unknown function or has no arguments
object stays content. The content is the text outside the parsed calls, null when it is only
whitespace and there are calls. The finish reason "stop" becomes "tool_calls" when a call was parsed
("length" stays: the text was cut, and what could not be parsed is content).

Streamed, content goes out as it comes, except a trailing partial `<tool_call>`; a whole block goes
out as one delta `{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]}`
(arguments whole, which the openai package's stream helpers accept); an output whose first
non-space characters are `{` or `<|python_tag|>` is held to the end and parsed as a whole answer is.
Leading whitespace of the content is held until other text follows, so that whole and streamed
answers agree.
"""

from __future__ import annotations

import json
from typing import Any

from batchserve.procs.api.harmony_output import HarmonyStream, parse_harmony
from batchserve.procs.api.tool_call import ParsedCall, new_call_id
from batchserve.shared.chat_format import HERMES_CLOSE, HERMES_OPEN, THINK_CLOSE, THINK_OPEN, ReasoningFormat

PYTHON_TAG = "<|python_tag|>"  # Llama 3.1+: starts a tool call
ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes/Qwen write "arguments", Llama 3 "parameters"


def call_of(text: str, names: frozenset[str]) -> ParsedCall | None:
    """The call a JSON object `text` makes, if it parses and names one of `names` with an arguments object."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    arguments = next((obj[key] for key in ARGUMENT_KEYS if key in obj), None)
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False), new_call_id())


def _json_call_text(text: str) -> str | None:
    """`text` stripped of whitespace and a leading <|python_tag|>, if it may be a bare JSON call."""
    head = text.strip()
    if head.startswith(PYTHON_TAG):
        head = head[len(PYTHON_TAG) :].strip()
    return head if head.startswith("{") else None


def parse_tool_calls(text: str, names: frozenset[str]) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a whole text."""
    head = _json_call_text(text)
    if head is not None:
        call = call_of(head, names)
        if call is not None:
            return None, [call]
    outside: list[str] = []
    calls: list[ParsedCall] = []
    pos = 0
    while True:
        start = text.find(HERMES_OPEN, pos)
        if start < 0:
            break
        end = text.find(HERMES_CLOSE, start + len(HERMES_OPEN))
        if end < 0:
            break
        block_end = end + len(HERMES_CLOSE)
        call = call_of(text[start + len(HERMES_OPEN) : end], names)
        if call is None:
            outside.append(text[pos:block_end])
        else:
            outside.append(text[pos:start])
            calls.append(call)
        pos = block_end
    outside.append(text[pos:])
    content = "".join(outside)
    return (None if calls and not content.strip() else content), calls


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, content) of a whole text."""
    head = text.lstrip()
    if head.startswith(THINK_OPEN):
        body = head[len(THINK_OPEN) :]
        end = body.find(THINK_CLOSE)
        if end < 0:  # cut off while thinking
            return body or None, ""
        reasoning, content = body[:end], body[end + len(THINK_CLOSE) :].lstrip()
    else:
        end = text.find(THINK_CLOSE)
        if end < 0:
            return None, text
        reasoning, content = text[:end], text[end + len(THINK_CLOSE) :].lstrip()
    return reasoning or None, content


def final_finish_reason(engine_reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and engine_reason == "stop" else engine_reason


def parse_whole(
    text: str, engine_reason: str | None, *, tool_names: frozenset[str], reasoning: ReasoningFormat
) -> tuple[dict[str, Any], str | None]:
    """(the answer's `message`, its finish_reason)."""
    if reasoning == "harmony":
        harmony_message, called = parse_harmony(text, tool_names)
        return harmony_message, final_finish_reason(engine_reason, called)
    reasoning_content = None
    if reasoning == "think":
        reasoning_content, text = split_reasoning(text)
    content: str | None = text
    calls: list[ParsedCall] = []
    if tool_names:
        content, calls = parse_tool_calls(text, tool_names)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning == "think":
        message["reasoning_content"] = reasoning_content
    if calls:
        message["tool_calls"] = [call.as_dict() for call in calls]
    return message, final_finish_reason(engine_reason, bool(calls))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (to hold back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _split_at(buf: str, tag: str, final: bool) -> tuple[str, str, bool]:
    """(text that can go out, the rest, whether the rest starts with `tag`): the text before `tag`,
    or all but a trailing partial `tag` (all of it when `final`)."""
    at = buf.find(tag)
    if at >= 0:
        return buf[:at], buf[at:], True
    keep = 0 if final else _partial_suffix(buf, tag)
    return buf[: len(buf) - keep], buf[len(buf) - keep :], False


def _opening(buf: str, final: bool, opens: tuple[str, ...], partial: tuple[str, ...]) -> str | None:
    """What the text opens with (after whitespace): one of `opens`, "" for none of them, or None while
    it is blank or a proper start of one of `partial` (and more text will come)."""
    head = buf.lstrip()
    found = next((tag for tag in opens if head.startswith(tag)), None)
    if found is not None:
        return found
    if not final and (not head or any(tag.startswith(head) for tag in partial)):
        return None
    return ""


class ReasoningStream:
    """Splits streamed text into ("reasoning" | "content", text) pieces."""

    def __init__(self) -> None:
        self.state = "start"  # start -> reasoning -> after (</think> seen) -> content; or start -> content
        self.buf = ""

    def feed(self, text: str, final: bool = False) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        while True:
            if self.state == "start":
                opened = _opening(self.buf, final, (THINK_OPEN,), (THINK_OPEN,))
                if opened is None:
                    break
                if opened:
                    self.buf = self.buf.lstrip()[len(THINK_OPEN) :]
                self.state = "reasoning" if opened else "content"
                continue
            if self.state == "reasoning":
                ready, rest, closed = _split_at(self.buf, THINK_CLOSE, final)
                out.append(("reasoning", ready))
                if closed:
                    self.buf, self.state = rest[len(THINK_CLOSE) :], "after"
                    continue
                self.buf = rest
                break
            if self.state == "after":
                self.buf = self.buf.lstrip()
                if not self.buf:
                    break
                self.state = "content"
            out.append(("content", self.buf))
            self.buf = ""
            break
        return [(kind, piece) for kind, piece in out if piece]


class ToolCallStream:
    """Parses tool calls out of streamed content; emits OpenAI delta dicts."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.state = "start"  # start -> text <-> block; or start -> json (held to the end)
        self.buf = ""
        self.blank = ""  # leading whitespace of the content, held until other text follows
        self.spoke = False  # some content other than whitespace went out
        self.calls = 0

    def feed(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        self.buf += text
        out: list[dict[str, Any]] = []
        while True:
            if self.state == "start":  # a bare JSON call is held to the end; Hermes blocks stream as text
                opening = _opening(self.buf, final, ("{", PYTHON_TAG), (PYTHON_TAG, HERMES_OPEN))
                if opening is None:
                    break
                self.state = "json" if opening else "text"
                continue
            if self.state == "json":
                if final:
                    content, calls = parse_tool_calls(self.buf, self.names)
                    self.buf = ""
                    if content is not None:
                        self._content(content, out)
                    for parsed in calls:
                        self._call(parsed, out)
                break
            if self.state == "text":
                ready, self.buf, opened = _split_at(self.buf, HERMES_OPEN, final)
                self._content(ready, out)
                if opened:
                    self.state = "block"
                    continue
                break
            # block: self.buf starts with <tool_call>
            end = self.buf.find(HERMES_CLOSE, len(HERMES_OPEN))
            if end < 0:
                if final:  # never closed (cut off): content
                    self._content(self.buf, out)
                    self.buf = ""
                break
            block_end = end + len(HERMES_CLOSE)
            call = call_of(self.buf[len(HERMES_OPEN) : end], self.names)
            if call is None:
                self._content(self.buf[:block_end], out)
            else:
                self._call(call, out)
            self.buf, self.state = self.buf[block_end:], "text"
        if final and self.blank and not self.calls:  # an answer of whitespace alone, as it came
            out.append({"content": self.blank})
            self.blank = ""
        return out

    def _content(self, text: str, out: list[dict[str, Any]]) -> None:
        if not text:
            return
        if not self.spoke:
            if not text.strip():
                self.blank += text
                return
            text, self.blank, self.spoke = self.blank + text, "", True
        out.append({"content": text})

    def _call(self, call: ParsedCall, out: list[dict[str, Any]]) -> None:
        out.append({"tool_calls": [{"index": self.calls, **call.as_dict()}]})
        self.calls += 1


class ChatOutputStream:
    """One streamed choice: text in, OpenAI deltas out (reasoning first, then tool calls in the content)."""

    def __init__(self, *, tool_names: frozenset[str], reasoning: ReasoningFormat) -> None:
        self.harmony = HarmonyStream(tool_names) if reasoning == "harmony" else None  # channels say it all
        self.reasoning = ReasoningStream() if reasoning == "think" else None
        self.tools = ToolCallStream(tool_names) if tool_names and self.harmony is None else None

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._route(text, final=False)

    def finish(self, engine_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The held-back rest, and the choice's finish_reason."""
        deltas = self._route("", final=True)
        calls = self.harmony.calls if self.harmony is not None else self.tools.calls if self.tools else 0
        return deltas, final_finish_reason(engine_reason, bool(calls))

    def _route(self, text: str, final: bool) -> list[dict[str, Any]]:
        if self.harmony is not None:
            return _merged(self.harmony.feed(text, final))
        pieces = self.reasoning.feed(text, final) if self.reasoning else [("content", text)]
        out: list[dict[str, Any]] = []
        for kind, piece in pieces:
            if kind == "reasoning":
                out.append({"reasoning_content": piece})
            elif self.tools is not None:
                out += self.tools.feed(piece)
            elif piece:
                out.append({"content": piece})
        if final and self.tools is not None:
            out += self.tools.feed("", final=True)
        return _merged(out)


def _merged(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adjacent text deltas of one kind as one."""
    out: list[dict[str, Any]] = []
    for delta in deltas:
        ((key, value),) = delta.items()
        if out and key != "tool_calls" and list(out[-1]) == [key]:
            out[-1] = {key: out[-1][key] + value}
        else:
            out.append(delta)
    return out
