"""Request bodies of the OpenAI-compatible endpoints, as msgspec structs.

Decoding a body with `decode_body` checks every field's type, so a wrong type is an error that
names the field; `validation.py` checks values. Fields OpenAI clients commonly send that we do not
implement are declared so that a non-default value can be refused (see `validation.UNSUPPORTED`);
unknown fields are ignored, as OpenAI does. Optional fields also accept an explicit `null`, which
means the default. Structured output (`response_format`, vLLM's `guided_*`) and tools are typed
here as far as msgspec can; `validation.py` checks the rest (schemas are objects, names, choices).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, TypeVar

import msgspec
from msgspec import Meta

from batchserve.procs.api.field_types import (
    INT32_MAX,
    Choices,
    CompletionLogprobs,
    LogitBias,
    MinP,
    Penalty,
    Priority,
    RepetitionPenalty,
    Seed,
    StopString,
    StopStrings,
    StopTokenIds,
    Temperature,
    TokenCount,
    TokenId,
    TopK,
    TopLogprobs,
    TopP,
)
from batchserve.shared.errors import Refusal


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class TextContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class FunctionCallIn(msgspec.Struct, kw_only=True):
    name: str
    arguments: str | dict[str, object] = "{}"  # JSON text, as OpenAI sends it (an object is taken too)


class ToolCallIn(msgspec.Struct, kw_only=True):
    """An earlier assistant message's call (`messages[i].tool_calls[j]`)."""

    id: str
    type: str = "function"
    function: FunctionCallIn


class ChatMessageIn(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[TextContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    name: str | None = None


class FunctionIn(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, object] | None = None  # JSON schema of the arguments; none: no arguments
    # accepted: a forced call (tool_choice required/named) is held to the schema by grammar whatever
    # this says; under tool_choice auto calls are free text, parsed afterwards
    strict: bool | None = None


class ToolIn(msgspec.Struct, kw_only=True):
    type: str
    function: FunctionIn


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`."""

    type: str
    function: NamedFunction


class SamplingExtras(msgspec.Struct, kw_only=True):
    """The sampling and stopping fields every generating endpoint takes beyond OpenAI's core (chat and
    completions have most as OpenAI's, the Responses API as vLLM's extras): the Responses API passes
    them to chat by name, so a new one is a field here and its use in `validation`."""

    stop: StopString | StopStrings | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None  # vLLM's: a matched stop string ends the text
    skip_special_tokens: bool | None = None  # vLLM's: false keeps special tokens in the text
    min_tokens: TokenCount | None = None  # vLLM's
    priority: Priority | None = None  # vLLM's: lower first, with --scheduling-policy priority
    speculative: bool | None = None  # false: no speculative decoding for this request (--speculative)
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None  # vLLM's
    logit_bias: LogitBias | None = None  # JSON keys are strings: token ids in decimal


class CommonRequestFields(SamplingExtras, kw_only=True):
    model: str | None = None
    max_tokens: TokenCount | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    # choices and streaming
    n: Choices | None = None
    best_of: Choices | None = None  # only null, 1 or n
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # Structured output: at most one of these (validation.constraint_of).
    response_format: dict[str, object] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    guided_json: object | None = None  # vLLM's: a JSON schema, as an object or as JSON text
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # Lark


class CompletionRequest(CommonRequestFields, kw_only=True):
    # A text, a list of token ids, or a batch of either (one choice per prompt, as OpenAI's):
    # msgspec allows one list type in a union, so `validation` sorts out the elements.
    prompt: str | list[TokenId | str | list[TokenId]]
    logprobs: CompletionLogprobs | None = None
    echo: bool | None = None
    suffix: str | None = None


class ChatCompletionRequest(CommonRequestFields, kw_only=True):
    messages: list[ChatMessageIn]
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    tools: list[ToolIn] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, object] | None = None  # vLLM's: extra chat template variables
    # OpenAI's: how hard a reasoning model thinks; the chat template's `reasoning_effort` (gpt-oss's system message)
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    # OpenAI's deprecated function calling: refused unless neutral (validation.UNSUPPORTED).
    functions: list[object] | None = None
    function_call: object | None = None


class TokenizeBody(msgspec.Struct, kw_only=True):
    """`/tokenize`: vLLM's TokenizeCompletionRequest (`prompt`) or TokenizeChatRequest (`messages`)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool | None = None  # default: a text True, a chat False (the template writes its own)
    add_generation_prompt: bool | None = None  # chat; default: not continue_final_message
    continue_final_message: bool | None = None  # chat: the last (assistant) message is left open
    return_token_strs: bool | None = None
    chat_template_kwargs: dict[str, object] | None = None  # chat
    tools: list[ToolIn] | None = None  # chat: rendered into the template as for generation


class DetokenizeBody(msgspec.Struct, kw_only=True):
    """`/detokenize` (vLLM's DetokenizeRequest)."""

    model: str | None = None
    tokens: list[TokenId]


class LoadLoraBody(msgspec.Struct, kw_only=True):
    """`POST /v1/load_lora_adapter` (vLLM's LoadLoRAAdapterRequest)."""

    lora_name: str
    lora_path: str


class UnloadLoraBody(msgspec.Struct, kw_only=True):
    """`POST /v1/unload_lora_adapter` (vLLM's UnloadLoRAAdapterRequest; its `lora_int_id` is not needed here)."""

    lora_name: str
    lora_int_id: Annotated[int, Meta(ge=0, le=INT32_MAX)] | None = None


T = TypeVar("T", bound=msgspec.Struct)  # a request body's schema

# A high surrogate escape (\uD800-\uDBFF) with no low surrogate escape after it: not valid text.
_LONE_SURROGATE_RE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})")

# msgspec names the offending location as "at `$.field[0].sub`" or "field `name`".
_PATH_RE = re.compile(r"at `\$\.?([^`]*)`")
_MISSING_RE = re.compile(r"missing required field `([^`]*)`")
_KEY_RE = re.compile(r"at `key` in `\$\.?([^`]*)`")  # a dict's key: named by the dict


def _param_of(message: str) -> str | None:
    missing = _MISSING_RE.search(message)
    path = _PATH_RE.search(message)
    if missing:
        prefix = path.group(1) + "." if path and path.group(1) else ""
        return prefix + missing.group(1)
    if path and path.group(1):
        return path.group(1).removesuffix("[...]")  # a dict's value: named by the dict
    key = _KEY_RE.search(message)
    return key.group(1) if key and key.group(1) else None


def decode_body(body: bytes, schema: type[T]) -> T:
    """The body as `schema`, or a `Refusal` (400) whose message and `param` name the bad field."""
    if not body.strip():
        raise Refusal("request body is empty; expected a JSON object")
    try:
        decoded = msgspec.json.decode(body, type=schema)
        _check_free_form_ints(decoded, "")
        return decoded
    except msgspec.ValidationError as exc:
        message = str(exc)
        raise Refusal(f"invalid request: {message}", param=_param_of(message)) from None
    except msgspec.DecodeError as exc:
        if _LONE_SURROGATE_RE.search(body):
            raise Refusal(
                "request body is not valid JSON: a \\uD800-\\uDBFF escape is not followed by a "
                "low surrogate (a lone surrogate is not text)"
            ) from None
        raise Refusal(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # msgspec's nesting limit, reached by a crafted body
        raise Refusal("request body nests arrays or objects too deeply") from None


# What the messages between the processes carry (msgpack): a free-form field's (chat_template_kwargs, a tool's
# parameters) integer outside it could not be sent on, so it is refused here rather than failing there.
INT_RANGE = (-(2**63), 2**64 - 1)


def _check_free_form_ints(value: object, field: str) -> None:
    """Refusal naming the top-level field of the first integer outside `INT_RANGE` (the typed fields carry
    ranges of their own; this finds the ones inside free-form objects)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if not INT_RANGE[0] <= value <= INT_RANGE[1]:
            raise Refusal(f"invalid request: {field} holds an integer outside [-2**63, 2**64)", param=field)
    elif isinstance(value, msgspec.Struct):
        for name in value.__struct_fields__:
            _check_free_form_ints(getattr(value, name), field or name)
    elif isinstance(value, dict):
        for item in value.values():
            _check_free_form_ints(item, field)
    elif isinstance(value, list | tuple):
        for item in value:
            _check_free_form_ints(item, field)
