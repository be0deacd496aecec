"""The Responses API's and the pooling endpoints' request schemas narrowed to what this server accepts
(as `openapi_rules` does for completions, chat and /tokenize; its text says why)."""

from __future__ import annotations

from batchserve.procs.api.field_types import INT32_MAX
from batchserve.procs.api.openapi_rules import (
    NULL,
    REF,
    TEMPLATE_KWARGS,
    TEXT_FORMAT,
    Rule,
    Schema,
    ServerFacts,
    add_rule,
    function_type,
    given,
    max_tokens,
    models,
    only_neutral,
    optional,
    prompt,
    sampling,
    text,
    tool_choice_rules,
    unless,
    value_of,
)
from batchserve.procs.api.responses_request import (
    LOGPROBS_INCLUDE,
    MAX_METADATA_KEY,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE,
    NEUTRAL,
    TEXT_PART_TYPES,
)
from batchserve.procs.api.validation import TOOL_NAME_RE

_STRING: Schema = {"type": "string"}
_NAME: Schema = {"type": "string", "pattern": f"^{TOOL_NAME_RE.pattern}$"}


def _responses(struct: Schema, facts: ServerFacts) -> None:
    props = struct["properties"]
    # (reasoning items alone make no chat)
    spoken = {"properties": {"type": {"enum": ["message", "function_call", "function_call_output", None]}}}
    items = {"type": "array", "items": {"$ref": REF + "InputItem"}, "minItems": 1, "contains": spoken}
    props["input"] = {"anyOf": [text(), items]}
    for name, (neutral, why) in NEUTRAL.items():
        props[name] = only_neutral(neutral, why)
    props["include"] = optional({"type": "array", "items": {"const": LOGPROBS_INCLUDE}})
    props["chat_template_kwargs"] = optional(TEMPLATE_KWARGS)
    props["previous_response_id"]["description"] = "the id of a response this server stored"
    props["metadata"] = optional(
        {
            "type": "object",
            "maxProperties": MAX_METADATA_PAIRS,
            "propertyNames": {"maxLength": MAX_METADATA_KEY},
            "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE},
        }
    )
    logprobs = given("include", {"type": "array", "minItems": 1})
    add_rule(struct, unless("top_logprobs", {"anyOf": [NULL, {"const": 0}]}, logprobs))
    plain = {"anyOf": [NULL, {"type": "object", "properties": {"format": {"anyOf": [NULL, TEXT_FORMAT]}}}]}
    tool_choice_rules(struct, REF + "ResponsesToolChoice", {"text": plain})


def _input_item(struct: Schema, facts: ServerFacts) -> None:
    """An item by its type: a message (a role and its content), a function call, its output, reasoning."""
    content = {"anyOf": [_STRING, {"type": "array", "items": {"$ref": REF + "ContentPart"}, "minItems": 1}]}
    struct["anyOf"] = [
        {
            "properties": {
                "type": {"enum": ["message", None]},
                "role": {"enum": ["user", "system", "developer", "assistant"]},
                "content": content,
            },
            "required": ["role", "content"],
        },
        {
            "properties": {
                "type": {"const": "function_call"},
                "call_id": _STRING,
                "name": _STRING,
                "arguments": _STRING,
            },
            "required": ["type", "call_id", "name", "arguments"],
        },
        {
            "properties": {"type": {"const": "function_call_output"}, "call_id": text(), "output": content},
            "required": ["type", "call_id", "output"],
        },
        {"properties": {"type": {"const": "reasoning"}, "encrypted_content": NULL}, "required": ["type"]},
    ]


def _content_part(struct: Schema, facts: ServerFacts) -> None:
    """A text part (an assistant's refusal part is taken too, undocumented: its role decides)."""
    struct["properties"]["type"] = {"enum": list(TEXT_PART_TYPES)}
    struct["properties"]["text"] = _STRING
    struct["required"] = ["type", "text"]


def _tool(struct: Schema, facts: ServerFacts) -> None:
    function_type(struct, facts)
    struct["properties"]["name"] = _NAME
    struct["required"] = ["type", "name"]


def _named_choice(struct: Schema, facts: ServerFacts) -> None:
    function_type(struct, facts)
    struct["properties"]["name"] = _STRING
    struct["required"] = ["type", "name"]


def _text_config(struct: Schema, facts: ServerFacts) -> None:
    struct["properties"]["verbosity"] = only_neutral(("medium",), "other verbosities are not supported")


def _text_format(struct: Schema, facts: ServerFacts) -> None:
    """text, json_object, or json_schema with its schema."""
    struct["properties"]["type"] = {"enum": ["text", "json_object", "json_schema"]}
    value_of(struct, "schema")["description"] = "a JSON schema the engine compiles"
    add_rule(struct, unless("type", {"enum": ["text", "json_object"]}, given("schema", {"type": "object"})))


def _reasoning(struct: Schema, facts: ServerFacts) -> None:
    why = "reasoning summaries are not supported"
    struct["properties"]["summary"] = only_neutral((), why)
    struct["properties"]["generate_summary"] = only_neutral((), why)


def _pooling(struct: Schema, facts: ServerFacts) -> None:
    """What every pooling request has: truncate_prompt_tokens -1 (the context) or >= 1; priority."""
    props = struct["properties"]
    cut = {"anyOf": [{"const": -1}, {"type": "integer", "minimum": 1, "maximum": INT32_MAX}]}
    props["truncate_prompt_tokens"] = optional(cut, "without it an input longer than the context is refused")
    if not facts.priority_scheduling:
        props["priority"] = optional({"type": "integer", "const": 0}, "other values need --scheduling-policy priority")


def _embeddings(struct: Schema, facts: ServerFacts) -> None:
    struct["properties"]["input"] = prompt(facts, facts.max_context)
    struct["properties"]["dimensions"] = (
        optional(facts.dimensions) if facts.dimensions else only_neutral((), "this model's vectors are not cut")
    )


def _score(struct: Schema, facts: ServerFacts) -> None:
    """Two texts or lists of texts: one text with each of a list, or two lists of one length."""
    texts = {"anyOf": [text(), {"type": "array", "items": text(), "minItems": 1}]}
    struct["properties"]["text_1"] = texts
    struct["properties"]["text_2"] = {**texts, "description": "a list as long as text_1's, unless either is one text"}


def _rerank(struct: Schema, facts: ServerFacts) -> None:
    struct["properties"]["query"] = text()
    struct["properties"]["documents"] = {"type": "array", "items": text(), "minItems": 1}


# struct name -> its rules
MORE_RULES: dict[str, tuple[Rule, ...]] = {
    "ResponsesRequest": (models, sampling, max_tokens("max_output_tokens"), _responses),
    "InputItem": (_input_item,),
    "ContentPart": (_content_part,),
    "ResponsesTool": (_tool,),
    "ResponsesToolChoice": (_named_choice,),
    "TextConfig": (_text_config,),
    "TextFormat": (_text_format,),
    "ReasoningConfig": (_reasoning,),
    "EmbeddingsBody": (models, _pooling, _embeddings),
    "ScoreBody": (models, _pooling, _score),
    "RerankBody": (models, _pooling, _rerank),
}
