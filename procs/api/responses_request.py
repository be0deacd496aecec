"""The Responses API's request (`POST /v1/responses`) and its translation into a chat request.

The request's schema, and `to_chat`: the `ChatCompletionRequest` that `validation.validate_chat`
then checks, so every limit of chat holds here too; `renamed` puts its refusals in this API's fields
(`max_output_tokens`, `input[i]`, `text.format`, `tools[i].name`). `response_echo`: the request's
fields as the response object repeats them.

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
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

from batchserve.procs.api.field_types import Choices, Temperature, TokenCount, TopLogprobs, TopP
from batchserve.procs.api.schemas import (
    ChatCompletionRequest,
    ChatMessageIn,
    FunctionCallIn,
    FunctionIn,
    NamedFunction,
    NamedToolChoice,
    SamplingExtras,
    TextContentPart,
    ToolCallIn,
    ToolIn,
)
from batchserve.shared.errors import Refusal

MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits
LOGPROBS_INCLUDE = "message.output_text.logprobs"
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


class ResponsesRequest(SamplingExtras, kw_only=True):
    """OpenAI's request, and vLLM's sampling extras as chat takes them (`SamplingExtras`)."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: TokenCount | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
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
    top_logprobs: TopLogprobs | None = None
    reasoning: ReasoningConfig | None = None
    max_tool_calls: TokenCount | None = None  # bounds built-in tool calls, of which this server has none
    truncation: str | None = None
    service_tier: str | None = None
    # Not implemented: refused unless at their neutral value (NEUTRAL).
    background: bool | None = None
    conversation: object | None = None
    prompt: object | None = None
    n: Choices | None = None
    max_tokens: TokenCount | None = None
    chat_template_kwargs: dict[str, object] | None = None


# field -> (values that mean "not used", what to say instead)
NEUTRAL: dict[str, tuple[tuple[object, ...], str]] = {
    "background": ((False,), "background mode is not supported by this server"),
    "conversation": (
        (),
        "the Conversations API is not supported by this server; pass the items in input or use previous_response_id",
    ),
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
            raise Refusal(
                "reasoning summaries are not supported: the reasoning item carries the model's own reasoning text",
                "reasoning.summary",
            )
        if req.reasoning.effort is not None:
            template_kwargs.setdefault("reasoning_effort", req.reasoning.effort)
    chat = ChatCompletionRequest(
        model=req.model,
        messages=messages,
        max_completion_tokens=req.max_output_tokens,
        stream=req.stream,
        temperature=req.temperature,
        top_p=req.top_p,
        **{name: getattr(req, name) for name in SamplingExtras.__struct_fields__},
        response_format=_response_format(text_format),
        tools=_tools(req.tools or []),
        tool_choice=_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
        logprobs=logprobs or None,
        top_logprobs=req.top_logprobs if logprobs else None,
        chat_template_kwargs=template_kwargs or None,
    )
    history = messages[1:] if req.instructions is not None else list(messages)
    return ChatTranslation(chat, origins, history)


def _logprobs_asked(req: ResponsesRequest) -> bool:
    for i, value in enumerate(req.include or []):
        if value != LOGPROBS_INCLUDE:
            raise Refusal(
                f"include[{i}]: only {LOGPROBS_INCLUDE!r} is supported by this server (got {value!r})", f"include[{i}]"
            )
    asked = LOGPROBS_INCLUDE in (req.include or [])
    if req.top_logprobs is not None:
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
            raise Refusal(
                f"{param}[{j}]: only text content is supported ({', '.join(TEXT_PART_TYPES)}; got type {part.type!r})",
                f"{param}[{j}].type",
            )
        out.append(TextContentPart(type="text", text=text))
    if not out:
        raise Refusal(f"{param} must not be empty", param)
    return out


def _call_field(value: str | None, param: str, field: str) -> str:
    """A function_call item's required `field`; Refusal naming it where it is missing."""
    if value is None:
        raise Refusal(f"{param}.{field} is required in a function_call item", f"{param}.{field}")
    return value


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
                raise Refusal(
                    f"{param}.role must be one of user, system, developer, assistant (got {role!r}){hint}",
                    f"{param}.role",
                )
            if item.content is None:
                raise Refusal(f"{param}.content is required", f"{param}.content")
            content = _text(item.content, f"{param}.content", role)
            if (
                role == "assistant"
                and last is not None
                and last.role == "assistant"
                and last.content is None
                and origins[-1].startswith("input[")
            ):
                last.content = content  # the text of the turn whose calls came first
                continue
            messages.append(ChatMessageIn(role=role, content=content))
        elif kind == "function_call":
            call_id, name = _call_field(item.call_id, param, "call_id"), _call_field(item.name, param, "name")
            arguments = _call_field(item.arguments, param, "arguments")
            call = ToolCallIn(id=call_id, function=FunctionCallIn(name=name, arguments=arguments))
            called[call_id] = name
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
            messages.append(
                ChatMessageIn(role="tool", content=output, tool_call_id=item.call_id, name=called.get(item.call_id))
            )
        elif kind == "reasoning":
            if item.encrypted_content is not None:
                raise Refusal(
                    f"{param}.encrypted_content: encrypted reasoning is not supported by this server",
                    f"{param}.encrypted_content",
                )
            continue  # earlier thinking: chat templates leave it out
        else:
            raise Refusal(
                f"{param}.type must be message, function_call, function_call_output or reasoning (got {item.type!r})",
                f"{param}.type",
            )
        origins.append(param)


def _response_format(fmt: TextFormat | None) -> dict[str, object] | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.type != "json_schema":
        raise Refusal(
            f"text.format.type must be one of text, json_object, json_schema (got {fmt.type!r})", "text.format.type"
        )
    if fmt.schema is None:
        raise Refusal("text.format.schema is required with type json_schema", "text.format.schema")
    return {
        "type": "json_schema",
        "json_schema": {"name": fmt.name or "response", "schema": dict(fmt.schema), "strict": fmt.strict},
    }


def _tools(tools: list[ResponsesTool]) -> list[ToolIn] | None:
    out = []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise Refusal(
                f"tools[{i}].type: only function tools are supported by this server (got {tool.type!r})",
                f"tools[{i}].type",
            )
        if tool.name is None:
            raise Refusal(f"tools[{i}].name is required", f"tools[{i}].name")
        out.append(
            ToolIn(
                type="function",
                function=FunctionIn(
                    name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict
                ),
            )
        )
    return out or None


def _tool_choice(choice: str | ResponsesToolChoice | None) -> str | NamedToolChoice | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type != "function":
        raise Refusal(
            f"tool_choice.type: only 'function' is supported by this server (got {choice.type!r})", "tool_choice"
        )
    if choice.name is None:
        raise Refusal("tool_choice.name is required with type function", "tool_choice")
    return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))


_RENAMES = [
    (re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"),
    (re.compile(r"\bresponse_format\b"), "text.format"),
    (re.compile(r"\btools\[(\d+)\]\.function\."), r"tools[\1]."),
]
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
            raise Refusal(
                f"metadata keys may have at most {MAX_METADATA_KEY} characters and values "
                f"{MAX_METADATA_VALUE} (key {key[:80]!r})",
                "metadata",
            )
    return metadata


def response_echo(req: ResponsesRequest, store: bool) -> dict[str, Any]:
    """The request's fields as the response object repeats them."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        text_format: dict[str, Any] = {"type": "text"}
    elif fmt.type == "json_object":
        text_format = {"type": "json_object"}
    else:
        text_format = {
            "type": "json_schema",
            "name": fmt.name,
            "schema": fmt.schema,
            "description": fmt.description,
            "strict": fmt.strict,
        }
    tools = [
        {
            "type": "function",
            "name": t.name,
            "description": t.description,
            "parameters": t.parameters,
            "strict": t.strict,
        }
        for t in req.tools or []
    ]
    choice = req.tool_choice
    tool_choice: Any = (
        choice
        if isinstance(choice, str)
        else ({"type": "function", "name": choice.name} if choice is not None else "auto")
    )
    effort = req.reasoning.effort if req.reasoning is not None else None
    return {
        "background": False,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "metadata": _metadata(req.metadata),
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": effort, "summary": None},
        "service_tier": "default",
        "store": store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": text_format, "verbosity": "medium"},
        "tool_choice": tool_choice,
        "tools": tools,
        "top_logprobs": req.top_logprobs or 0,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": "disabled",
        "user": req.user,
        "safety_identifier": req.safety_identifier,
        "prompt_cache_key": req.prompt_cache_key,
    }
