"""A gpt-oss answer in OpenAI's harmony format, as OpenAI's chat API structures it (what users of vLLM's
gpt-oss support get): the `analysis` channel is `reasoning_content`, the `final` channel the `content`,
a `commentary` message to `functions.NAME` a tool call with its body as the arguments, and a commentary
message to no one (a preamble the model says before its calls) content too.

The model writes messages after the prompt's `<|start|>assistant`, each a header and a body:
`<|channel|>analysis<|message|>...<|end|>`, then `<|start|>assistant<|channel|>final<|message|>...<|return|>`,
or a call `<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}<|call|>`
(the recipient may also come before the channel: `<|start|>assistant to=functions.x<|channel|>commentary json`).
`<|end|>` ends a message, `<|return|>` the answer and `<|call|>` a call (both are stop tokens, so the text may
end without them). The tokenizer keeps these special tokens in a harmony chat's text for this parser
(`StopParams.skip_special_tokens`); none of them reaches the client. A body streams as it comes, held back
only where it may be the start of an end tag. Text that never opens a message (a model that does not
write harmony) is the content; a header cut off by the length limit is dropped.
"""

from __future__ import annotations

import re
from typing import Any

from batchserve.procs.api.tool_call import ParsedCall, new_call_id

MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


def _held_back(text: str) -> int:
    """Length of the longest end of `text` that is a proper start of an end tag."""
    for n in range(min(max(len(tag) for tag in ENDS) - 1, len(text)), 0, -1):
        if any(tag.startswith(text[-n:]) for tag in ENDS):
            return n
    return 0


class HarmonyStream:
    """One choice's text in, OpenAI deltas out (`reasoning_content`, `content`, `tool_calls`); `calls` counts
    the calls made (the finish reason is then "tool_calls")."""

    def __init__(self, tool_names: frozenset[str]) -> None:
        self.tool_names = tool_names
        self.buf = ""
        self.header: str | None = None  # the open message's header; None between messages
        self.arguments = ""  # a call's body so far
        self.calls = 0
        self.opened = False  # a message was opened: text outside messages is structure, not content

    def feed(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        self.buf += text
        out: list[dict[str, Any]] = []
        while True:
            if self.header is None:
                at = self.buf.find(MESSAGE)
                if at < 0:
                    if final:
                        self._outside(out)
                    return out
                self.header, self.buf, self.opened = self.buf[:at], self.buf[at + len(MESSAGE) :], True
                continue
            end, tag = min(((self.buf.find(t), t) for t in ENDS if t in self.buf), default=(-1, ""))
            if end < 0:
                keep = 0 if final else _held_back(self.buf)
                self._body(self.buf[: len(self.buf) - keep], out)
                self.buf = self.buf[len(self.buf) - keep :]
                if final:
                    self._close(out)
                return out
            self._body(self.buf[:end], out)
            self.buf = self.buf[end + len(tag) :]
            self._close(out)

    def _kind(self) -> str:
        """What the open message is: "reasoning", "content" or "call"."""
        header = self.header or ""
        channel = _CHANNEL_NAME.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient is not None and recipient.group(1).startswith(FUNCTIONS):
            return "call"
        return "reasoning" if channel is not None and channel.group(1) == "analysis" else "content"

    def _body(self, text: str, out: list[dict[str, Any]]) -> None:
        if not text:
            return
        kind = self._kind()
        if kind == "call":
            self.arguments += text
        else:
            out.append({"reasoning_content" if kind == "reasoning" else "content": text})

    def _close(self, out: list[dict[str, Any]]) -> None:
        """The open message ends: a call goes out whole (its name offered, else its text as content)."""
        if self._kind() == "call":
            recipient = _RECIPIENT.search(self.header or "")
            assert recipient is not None  # `_kind` found a call's in the header
            name = recipient.group(1)[len(FUNCTIONS) :]
            arguments = self.arguments.strip() or "{}"
            if name in self.tool_names:
                call = ParsedCall(name, arguments, new_call_id())
                out.append({"tool_calls": [{"index": self.calls, **call.as_dict()}]})
                self.calls += 1
            else:
                out.append({"content": arguments})
        self.header, self.arguments = None, ""

    def _outside(self, out: list[dict[str, Any]]) -> None:
        """The end, between messages: leftover text is the content of a model that wrote no harmony, or
        the start of a header the length limit cut off (after a message, or opening with a special token)."""
        if not self.opened and self.buf and not self.buf.lstrip().startswith("<|"):
            out.append({"content": self.buf})
        self.buf = ""


def parse_harmony(text: str, tool_names: frozenset[str]) -> tuple[dict[str, Any], bool]:
    """(the answer's `message`, whether it called a tool) of a whole text."""
    stream = HarmonyStream(tool_names)
    parts: dict[str, list[str]] = {"content": [], "reasoning_content": []}
    calls: list[dict[str, Any]] = []
    for delta in stream.feed(text, final=True):
        ((key, value),) = delta.items()
        if key == "tool_calls":
            calls += [{k: v for k, v in call.items() if k != "index"} for call in value]
        else:
            parts[key].append(value)
    message: dict[str, Any] = {
        "role": "assistant",
        "content": "".join(parts["content"]) or None,
        "reasoning_content": "".join(parts["reasoning_content"]) or None,
    }
    if calls:
        message["tool_calls"] = calls
    return message, bool(calls)
