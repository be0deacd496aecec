"""OpenAI's Responses API (`POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`), built on the chat path.

A request is translated into a `ChatCompletionRequest` and checked by `validation.validate_chat`, so
every limit of chat holds here too; its refusals are renamed into this API's fields (`max_output_tokens`,
`input[i]`, `text.format`, `tools[i].name`). Then it runs as a chat request with one choice, and
`ResponsesShapes` writes the answer as a `response` object or as typed SSE events.

Translation (as vLLM's `construct_input_messages`):
- `instructions` -> a system message first (not carried over by `previous_response_id`, as OpenAI's;
  the input's own items are);
- `input` text -> one user message; a list of items: messages (`role` user/system/developer/assistant,
  `content` a text or text parts), `function_call` items (-> the assistant message's `tool_calls`,
  merged into the assistant message before them) and `function_call_output` items (-> `tool`
  messages, with the called function's name); `reasoning` items are dropped (templates drop earlier
  thinking);
- `tools` (flat `{"type": "function", "name", "description", "parameters"}`) and `tool_choice`
  (`{"type": "function", "name"}` for one function) -> chat's; `text.format` json_schema/json_object
  -> `response_format`; `max_output_tokens` -> `max_completion_tokens`; `reasoning.effort` -> the
  chat template's `reasoning_effort` (as vLLM). vLLM's sampling extras (`top_k`, `seed`, `stop`, ...)
  pass through as in chat.

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

Stored responses: `store` (default true, as OpenAI's) keeps the answer and its conversation in a
bounded in-memory store (`ResponseStore`: least recently used out first), so `previous_response_id`
continues it and `GET /v1/responses/{id}` returns it until it is evicted or the server restarts.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import msgspec

from procs.api.chat_output import ChatOutputStream, ReasoningStream, parse_whole
from procs.api.engine_client import EngineClient
from procs.api.responses import MIN_LOGPROB, ChoiceOutput, Piece, ResponseShapes
from procs.api.schemas import (ChatCompletionRequest, ChatMessageIn, FunctionCallIn, FunctionIn, NamedFunction,
                               NamedToolChoice, TextContentPart, ToolCallIn, ToolIn, decode_body)
from procs.api.validation import ValidatedRequest, validate_chat
from shared.errors import Refusal
from shared.messages import TokenLogprob, Usage

MAX_STORED_RESPONSES = 1024  # responses kept for previous_response_id and GET
MAX_STORED_BYTES = 64 * 1024 * 1024  # their JSON size, conversations included
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits
LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_TOP_LOGPROBS = 20
TEXT_PART_TYPES = ("input_text", "output_text", "text")

# ---------------------------------------------------------------- request schema


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None
    refusal: str | None = None  # an assistant's refusal part


class InputItem(msgspec.Struct, kw_only=True):
    """One element of `input`: a message (`type` "message" or left out), a `function_call`, a
    `function_call_output` or a `reasoning` item; which fields count depends on the type."""

    type: str | None = None
    role: str | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call: JSON text
    output: str | list[ContentPart] | None = None  # function_call_output
    encrypted_content: str | None = None  # reasoning
    id: str | None = None
    status: str | None = None


class ResponsesTool(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, object] | None = None
    strict: bool | None = None


class ResponsesToolChoice(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None


class TextFormat(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None
    schema: dict[str, object] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(msgspec.Struct, kw_only=True):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: str | ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # a routing hint; the prefix cache needs none
    store: bool | None = None
    previous_response_id: str | None = None
    stream: bool | None = None
    stream_options: dict[str, object] | None = None  # include_obfuscation: this server pads nothing
    include: list[str] | None = None
    top_logprobs: int | None = None
    reasoning: ReasoningConfig | None = None
    max_tool_calls: int | None = None  # bounds built-in tool calls, of which this server has none
    truncation: str | None = None
    service_tier: str | None = None
    # Not implemented: refused unless at their neutral value (NEUTRAL).
    background: bool | None = None
    conversation: object | None = None
    prompt: object | None = None
    n: int | None = None
    max_tokens: int | None = None
    # vLLM's extras, as chat has them
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    priority: int | None = None
    speculative: bool | None = None
    chat_template_kwargs: dict[str, object] | None = None


# field -> (values that mean "not used", what to say instead)
NEUTRAL: dict[str, tuple[tuple[object, ...], str]] = {
    "background": ((False,), "background mode is not supported by this server"),
    "conversation": ((), "the Conversations API is not supported by this server; pass the items in input "
                         "or use previous_response_id"),
    "prompt": ((), "prompt templates are not supported by this server"),
    "n": ((1,), "the Responses API makes one answer per request (n is chat's)"),
    "max_tokens": ((), "the Responses API calls it max_output_tokens"),
    "truncation": (("disabled",), "truncation 'auto' is not supported: an input longer than the context is refused"),
    "service_tier": (("auto", "default"), "this server has one service tier"),
}

# ---------------------------------------------------------------- translation to chat


@dataclass
class ChatTranslation:
    request: ChatCompletionRequest
    origins: list[str]  # the request field each chat message came from ("input[2]", "instructions", ...)
    history: list[ChatMessageIn]  # the conversation to store: all but the instructions


def to_chat(req: ResponsesRequest, previous: list[ChatMessageIn]) -> ChatTranslation:
    """The chat request of `req`, continuing the stored conversation `previous`."""
    for name, (neutral, why) in NEUTRAL.items():
        value = getattr(req, name)
        if value is not None and value not in neutral:
            raise Refusal(f"{name}: {why}", name)
    messages: list[ChatMessageIn] = []
    origins: list[str] = []
    if req.instructions is not None:
        messages.append(ChatMessageIn(role="system", content=req.instructions))
        origins.append("instructions")
    messages += previous
    origins += ["previous_response_id"] * len(previous)
    if isinstance(req.input, str):
        if req.input == "":
            raise Refusal("input must not be empty", "input")
        messages.append(ChatMessageIn(role="user", content=req.input))
        origins.append("input")
    else:
        if not req.input:
            raise Refusal("input must not be empty", "input")
        _add_items(req.input, messages, origins)
    text_format = req.text.format if req.text is not None else None
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise Refusal("text.verbosity other than 'medium' is not supported by this server", "text.verbosity")
    logprobs = _logprobs_asked(req)
    template_kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning is not None:
        if req.reasoning.summary is not None or req.reasoning.generate_summary is not None:
            raise Refusal("reasoning summaries are not supported: the reasoning item carries the model's own "
                          "reasoning text", "reasoning.summary")
        if req.reasoning.effort is not None:
            template_kwargs.setdefault("reasoning_effort", req.reasoning.effort)
    chat = ChatCompletionRequest(
        model=req.model, messages=messages, max_completion_tokens=req.max_output_tokens, stream=req.stream,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, seed=req.seed,
        stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, logit_bias=req.logit_bias, priority=req.priority,
        speculative=req.speculative,
        response_format=_response_format(text_format), tools=_tools(req.tools or []),
        tool_choice=_tool_choice(req.tool_choice), parallel_tool_calls=req.parallel_tool_calls,
        logprobs=logprobs or None, top_logprobs=req.top_logprobs if logprobs else None,
        chat_template_kwargs=template_kwargs or None)
    history = messages[1:] if req.instructions is not None else list(messages)
    return ChatTranslation(chat, origins, history)


def _logprobs_asked(req: ResponsesRequest) -> bool:
    for i, value in enumerate(req.include or []):
        if value != LOGPROBS_INCLUDE:
            raise Refusal(f"include[{i}]: only {LOGPROBS_INCLUDE!r} is supported by this server (got {value!r})",
                          f"include[{i}]")
    asked = LOGPROBS_INCLUDE in (req.include or [])
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise Refusal(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}] (got {req.top_logprobs})",
                          "top_logprobs")
        if req.top_logprobs and not asked:
            raise Refusal(f"top_logprobs needs include [{LOGPROBS_INCLUDE!r}]", "top_logprobs")
    return asked


def _text(parts: str | list[ContentPart], param: str, role: str) -> str | list[TextContentPart]:
    """A message's content as chat takes it (text parts are joined as chat joins them)."""
    if isinstance(parts, str):
        return parts
    out = []
    for j, part in enumerate(parts):
        text = part.refusal if part.type == "refusal" and role == "assistant" else part.text
        if part.type not in (*TEXT_PART_TYPES, "refusal") or text is None:
            raise Refusal(f"{param}[{j}]: only text content is supported ({', '.join(TEXT_PART_TYPES)}; got type "
                          f"{part.type!r})", f"{param}[{j}].type")
        out.append(TextContentPart(type="text", text=text))
    if not out:
        raise Refusal(f"{param} must not be empty", param)
    return out


def _add_items(items: list[InputItem], messages: list[ChatMessageIn], origins: list[str]) -> None:
    # call_id -> function name, for the tool messages that answer them (calls stored ones made too)
    called = {call.id: call.function.name for m in messages for call in m.tool_calls or []}
    for i, item in enumerate(items):
        param = f"input[{i}]"
        kind = item.type or ("message" if item.role is not None else None)
        last = messages[-1] if messages else None
        if kind == "message":
            role = item.role
            if role not in ("user", "system", "developer", "assistant"):
                hint = "; a tool's result is a function_call_output item" if role == "tool" else ""
                raise Refusal(f"{param}.role must be one of user, system, developer, assistant (got {role!r}){hint}",
                              f"{param}.role")
            if item.content is None:
                raise Refusal(f"{param}.content is required", f"{param}.content")
            content = _text(item.content, f"{param}.content", role)
            if (role == "assistant" and last is not None and last.role == "assistant" and last.content is None
                    and origins[-1].startswith("input[")):
                last.content = content  # the text of the turn whose calls came first
                continue
            messages.append(ChatMessageIn(role=role, content=content))
        elif kind == "function_call":
            for field in ("call_id", "name", "arguments"):
                if getattr(item, field) is None:
                    raise Refusal(f"{param}.{field} is required in a function_call item", f"{param}.{field}")
            call = ToolCallIn(id=item.call_id, function=FunctionCallIn(name=item.name, arguments=item.arguments))
            called[item.call_id] = item.name
            if last is not None and last.role == "assistant" and origins[-1].startswith("input["):
                last.tool_calls = [*(last.tool_calls or []), call]  # one turn: its text and all its calls
                continue
            messages.append(ChatMessageIn(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            if item.call_id is None:
                raise Refusal(f"{param}.call_id is required in a function_call_output item", f"{param}.call_id")
            if item.output is None:
                raise Refusal(f"{param}.output is required in a function_call_output item", f"{param}.output")
            output = _text(item.output, f"{param}.output", "tool")
            messages.append(ChatMessageIn(role="tool", content=output, tool_call_id=item.call_id,
                                          name=called.get(item.call_id)))
        elif kind == "reasoning":
            if item.encrypted_content is not None:
                raise Refusal(f"{param}.encrypted_content: encrypted reasoning is not supported by this server",
                              f"{param}.encrypted_content")
            continue  # earlier thinking: chat templates leave it out
        else:
            raise Refusal(f"{param}.type must be message, function_call, function_call_output or reasoning "
                          f"(got {item.type!r})", f"{param}.type")
        origins.append(param)


def _response_format(fmt: TextFormat | None) -> dict[str, object] | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.type != "json_schema":
        raise Refusal(f"text.format.type must be one of text, json_object, json_schema (got {fmt.type!r})",
                      "text.format.type")
    if fmt.schema is None:
        raise Refusal("text.format.schema is required with type json_schema", "text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": dict(fmt.schema),
                                                   "strict": fmt.strict}}


def _tools(tools: list[ResponsesTool]) -> list[ToolIn] | None:
    out = []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise Refusal(f"tools[{i}].type: only function tools are supported by this server (got {tool.type!r})",
                          f"tools[{i}].type")
        if tool.name is None:
            raise Refusal(f"tools[{i}].name is required", f"tools[{i}].name")
        out.append(ToolIn(type="function", function=FunctionIn(
            name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict)))
    return out or None


def _tool_choice(choice: str | ResponsesToolChoice | None) -> str | NamedToolChoice | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type != "function":
        raise Refusal(f"tool_choice.type: only 'function' is supported by this server (got {choice.type!r})",
                      "tool_choice")
    if choice.name is None:
        raise Refusal("tool_choice.name is required with type function", "tool_choice")
    return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))


_RENAMES = [(re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"),
            (re.compile(r"\bresponse_format\b"), "text.format"),
            (re.compile(r"\btools\[(\d+)\]\.function\."), r"tools[\1].")]
_MESSAGE_RE = re.compile(r"\bmessages\[(\d+)\]")


def renamed(exc: Refusal, origins: list[str]) -> Refusal:
    """A chat refusal in the Responses API's field names."""
    def rename(text: str) -> str:
        for pattern, new in _RENAMES:
            text = pattern.sub(new, text)
        text = _MESSAGE_RE.sub(lambda m: origins[int(m.group(1))] if int(m.group(1)) < len(origins) else "input", text)
        return re.sub(r"\bmessages\b", "input", text)

    param = None if exc.param is None else rename(exc.param)
    return Refusal(rename(exc.message), param, status=exc.status, code=exc.code)


def _metadata(metadata: dict[str, str] | None) -> dict[str, str]:
    metadata = metadata or {}
    if len(metadata) > MAX_METADATA_PAIRS:
        raise Refusal(f"metadata may hold at most {MAX_METADATA_PAIRS} pairs (got {len(metadata)})", "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise Refusal(f"metadata keys may have at most {MAX_METADATA_KEY} characters and values "
                          f"{MAX_METADATA_VALUE} (key {key[:80]!r})", "metadata")
    return metadata


# ---------------------------------------------------------------- the store


@dataclass
class StoredResponse:
    response: dict[str, Any]
    history: list[ChatMessageIn]  # the conversation through this response's answer, without its instructions
    size: int


class ResponseStore:
    """Responses by id, at most `max_entries` and `max_bytes` of JSON: least recently used out first."""

    def __init__(self, max_entries: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, rid: str, response: dict[str, Any], history: list[ChatMessageIn]) -> bool:
        """Keep it (False: larger than the whole store, not kept)."""
        size = len(msgspec.json.encode(response)) + len(msgspec.json.encode(history))
        if size > self.max_bytes:
            return False
        self.delete(rid)
        self._entries[rid] = StoredResponse(response, history, size)
        self.bytes += size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.size
        return True

    def get(self, rid: str) -> StoredResponse | None:
        entry = self._entries.get(rid)
        if entry is not None:
            self._entries.move_to_end(rid)
        return entry

    def delete(self, rid: str) -> bool:
        entry = self._entries.pop(rid, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry is not None


# ---------------------------------------------------------------- output shapes


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def usage_of(usage: Usage, reasoning_tokens: int) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage.total_tokens}


def _logprob(t: TokenLogprob) -> dict[str, Any]:
    def one(token: str, logprob: float | None) -> dict[str, Any]:
        return {"token": token, "logprob": max(logprob if logprob is not None else MIN_LOGPROB, MIN_LOGPROB),
                "bytes": list(token.encode("utf-8"))}

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
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}


def call_item(call: dict[str, Any]) -> dict[str, Any]:
    """A chat `tool_calls` entry as a `function_call` item."""
    return {"id": new_id("fc"), "type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": "completed"}


def history_message(output: list[dict[str, Any]]) -> ChatMessageIn:
    """The answer as the assistant message a follow-up turn continues from."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [ToolCallIn(id=item["call_id"], function=FunctionCallIn(name=item["name"], arguments=item["arguments"]))
             for item in output if item["type"] == "function_call"]
    return ChatMessageIn(role="assistant", content=text or (None if calls else ""), tool_calls=calls or None)


class ResponsesShapes(ResponseShapes):
    """One response: the `response` object (whole), or its SSE events (streamed). One choice only.

    `echo` holds the request's fields the response object repeats; `keep(response, output)` is
    called with the finished response (for the store), if given."""

    object = "response"
    chunk_object = "response"

    def __init__(self, rid: str, model: str, *, echo: dict[str, Any], logprobs: bool, tool_names: frozenset[str],
                 reasoning: bool, keep: Callable[[dict[str, Any]], None] | None = None) -> None:
        super().__init__(rid, model, logprobs=logprobs, tool_names=tool_names, reasoning=reasoning)
        self.echo = echo
        self.keep = keep
        self.parses = bool(tool_names) or reasoning
        # streaming state
        self.sequence = 0
        self.done_items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed: {"kind", "id", "text", "logprobs"}
        self.output_stream = ChatOutputStream(tool_names=tool_names, reasoning=reasoning) if self.parses else None
        self.reasoning_tokens = _ReasoningTokens() if reasoning else None
        self.unsent: list[TokenLogprob] = []  # tokens whose text is held back: their logprobs go with the next text

    def engine_param(self, param: str | None) -> str | None:
        return "input" if param == "messages" else param

    # ---- the response object

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
                 reason: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None, "error": error,
                "incomplete_details": {"reason": reason} if status == "incomplete" else None, "model": self.model,
                "output": output, "usage": usage, **self.echo}

    def _finished(self, finish_reason: str | None, output: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
        tokens = self.reasoning_tokens.count if self.reasoning_tokens is not None else 0
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
            message, choice.finish_reason = parse_whole(piece.text, choice.finish_reason, tool_names=self.tool_names,
                                                        reasoning=self.reasoning)
        else:
            message = {"content": piece.text}
        output = []
        if message.get("reasoning_content"):
            output.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
        calls = message.get("tool_calls") or []
        if message["content"] or not calls:
            output.append(self._choice(0, message["content"] or "", self._logprobs_of(piece), choice.finish_reason,
                                       streamed=False))
        output += [call_item(call) for call in calls]
        return self._finished(choice.finish_reason, output, usage)

    def _choice(self, index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None, *,
                streamed: bool) -> dict[str, Any]:
        """The answer's message item (what chat calls a choice)."""
        return message_item(new_id("msg"), text, (logprobs or {}).get("content"),
                            "incomplete" if finish_reason == "length" else "completed")

    def _logprobs(self, piece: Piece) -> dict[str, Any]:
        return {"content": [_logprob(t) for t in piece.tokens]}

    # ---- streamed events

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(payload) + b"\n\n"

    def stream_start(self, choices: list[ChoiceOutput]) -> bytes:
        started = self.response("in_progress", [], None)
        return self._event("response.created", response=started) + self._event("response.in_progress",
                                                                                 response=started)

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
        (key, value), = delta.items()
        if key == "tool_calls":
            out = self._close()
            for call in value:
                item = call_item(call)
                index = len(self.done_items)
                out += self._event("response.output_item.added", output_index=index,
                                   item={**item, "arguments": "", "status": "in_progress"})
                out += self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                   delta=item["arguments"])
                out += self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   arguments=item["arguments"])
                out += self._event("response.output_item.done", output_index=index, item=item)
                self.done_items.append(item)
            return out
        kind = "reasoning" if key == "reasoning_content" else "message"
        out = b""
        if self.open is None or self.open["kind"] != kind:
            out += self._close() + self._open(kind)
        item = self.open
        item["text"] += value
        ids = {"item_id": item["id"], "output_index": len(self.done_items), "content_index": 0}
        if kind == "reasoning":
            return out + self._event("response.reasoning_text.delta", **ids, delta=value)
        logprobs = [_logprob(t) for t in self.unsent]
        self.unsent = []
        item["logprobs"] += logprobs
        return out + self._event("response.output_text.delta", **ids, delta=value, logprobs=logprobs)

    def _open(self, kind: str) -> bytes:
        self.open = {"kind": kind, "id": new_id("rs" if kind == "reasoning" else "msg"), "text": "", "logprobs": []}
        index = len(self.done_items)
        if kind == "reasoning":
            item = {"id": self.open["id"], "type": "reasoning", "summary": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": self.open["id"], "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return (self._event("response.output_item.added", output_index=index, item=item)
                + self._event("response.content_part.added", item_id=self.open["id"], output_index=index,
                              content_index=0, part=part))

    def _close(self, status: str = "completed") -> bytes:
        if self.open is None:
            return b""
        item, self.open = self.open, None
        ids = {"item_id": item["id"], "output_index": len(self.done_items), "content_index": 0}
        if item["kind"] == "reasoning":
            done = reasoning_item(item["id"], item["text"], status)
            out = (self._event("response.reasoning_text.done", **ids, text=item["text"])
                   + self._event("response.content_part.done", **ids, part=done["content"][0]))
        else:
            done = message_item(item["id"], item["text"], item["logprobs"], status)
            out = (self._event("response.output_text.done", **ids, text=item["text"], logprobs=item["logprobs"])
                   + self._event("response.content_part.done", **ids, part=done["content"][0]))
        out += self._event("response.output_item.done", output_index=ids["output_index"], item=done)
        self.done_items.append(done)
        return out

    def stream_end(self, choices: list[ChoiceOutput], usage: Usage) -> bytes:
        (choice,) = choices
        cut = choice.finish_reason == "length"
        out = b""
        if not any(item["type"] == "message" for item in self.done_items) and (
                self.open is not None or not any(item["type"] == "function_call" for item in self.done_items)):
            if self.open is None or self.open["kind"] != "message":  # an answer of no text: an empty message
                out += self._close() + self._open("message")
        out += self._close("incomplete" if cut else "completed")
        final = self._finished(choice.finish_reason, list(self.done_items), usage)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return out + self._event(kind, response=final)

    def stream_failure(self, unfinished: list[ChoiceOutput], status: int, message: str, param: str | None) -> bytes:
        code = "server_error" if status >= 500 else "invalid_request_error"
        failed = self.response("failed", list(self.done_items), None, error={"code": code, "message": message})
        return (self._event("error", code=code, message=message, param=param)
                + self._event("response.failed", response=failed))


# ---------------------------------------------------------------- the endpoint


class ResponsesEndpoint:
    """`/v1/responses` of one app: translation, validation and the store."""

    def __init__(self, engine: EngineClient, *, reasoning: bool = False, store: ResponseStore | None = None) -> None:
        self.engine = engine
        self.reasoning = reasoning
        self.store = ResponseStore() if store is None else store

    def prepare(self, body: bytes, rid: str) -> tuple[ValidatedRequest, ResponsesShapes]:
        req = decode_body(body, ResponsesRequest)
        previous: list[ChatMessageIn] = []
        if req.previous_response_id is not None:
            stored = self.store.get(req.previous_response_id)
            if stored is None:
                raise Refusal(f"Previous response with id '{req.previous_response_id}' not found.",
                              "previous_response_id", code="previous_response_not_found")
            previous = stored.history
        translation = to_chat(req, previous)
        try:
            validated = validate_chat(translation.request, rid=rid, model_name=self.engine.model_name,
                                      max_context=self.engine.max_context)
        except Refusal as exc:
            raise renamed(exc, translation.origins) from None
        (generate,) = validated.requests
        constraint = generate.constraint
        if constraint is not None:
            constraint = msgspec.structs.replace(constraint, param="text.format")
        generate = msgspec.structs.replace(generate, max_tokens_param="max_output_tokens", constraint=constraint)
        validated = dataclasses.replace(validated, requests=[generate])
        store = req.store is not False
        echo = self._echo(req, store)
        history = translation.history

        def keep(response: dict[str, Any]) -> None:
            self.store.put(rid, response, [*history, history_message(response["output"])])

        shapes = ResponsesShapes(rid, self.engine.model_name, echo=echo, logprobs=validated.logprobs,
                                 tool_names=validated.tool_names, reasoning=self.reasoning,
                                 keep=keep if store else None)
        return validated, shapes

    @staticmethod
    def _echo(req: ResponsesRequest, store: bool) -> dict[str, Any]:
        """The request's fields as the response object repeats them."""
        fmt = req.text.format if req.text is not None else None
        if fmt is None or fmt.type == "text":
            text_format: dict[str, Any] = {"type": "text"}
        elif fmt.type == "json_object":
            text_format = {"type": "json_object"}
        else:
            text_format = {"type": "json_schema", "name": fmt.name, "schema": fmt.schema,
                           "description": fmt.description, "strict": fmt.strict}
        tools = [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
                  "strict": t.strict} for t in req.tools or []]
        choice = req.tool_choice
        tool_choice: Any = choice if isinstance(choice, str) else (
            {"type": "function", "name": choice.name} if choice is not None else "auto")
        effort = req.reasoning.effort if req.reasoning is not None else None
        return {"background": False, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "max_tool_calls": req.max_tool_calls, "metadata": _metadata(req.metadata),
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": req.previous_response_id, "reasoning": {"effort": effort, "summary": None},
                "service_tier": "default", "store": store,
                "temperature": 1.0 if req.temperature is None else req.temperature,
                "text": {"format": text_format, "verbosity": "medium"}, "tool_choice": tool_choice, "tools": tools,
                "top_logprobs": req.top_logprobs or 0, "top_p": 1.0 if req.top_p is None else req.top_p,
                "truncation": "disabled", "user": req.user, "safety_identifier": req.safety_identifier,
                "prompt_cache_key": req.prompt_cache_key}

    def retrieve(self, rid: str, request: Any) -> dict[str, Any]:
        if request.query.get("stream", "false").lower() not in ("false", "0"):
            raise Refusal("streaming a stored response again is not supported by this server", "stream")
        return self._get(rid).response

    def delete(self, rid: str, request: Any) -> dict[str, Any]:
        self._get(rid)
        self.store.delete(rid)
        return {"id": rid, "object": "response", "deleted": True}

    def _get(self, rid: str) -> StoredResponse:
        stored = self.store.get(rid)
        if stored is None:
            raise Refusal(f"Response with id '{rid}' not found.", "response_id", status=404)
        return stored
