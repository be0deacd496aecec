"""The request schemas of the OpenAPI document narrowed to what this server accepts.

msgspec's schemas of the request structs say what decodes, ranges included; validation then refuses
more: what depends on the model (token ids below its vocabulary size, max_tokens within its context),
on this server's settings (`priority` without --scheduling-policy priority, `n` within the request cap),
rules across fields (top_logprobs needs logprobs, stream_options needs stream, /tokenize takes one of
prompt and messages) and fields declared only to be refused unless neutral. Each rule here writes one of
those into the schema, so that a request the document calls valid is not refused (Schemathesis's
`positive_data_acceptance`, tests/test_openapi_fuzz.py). What JSON Schema cannot say is left to
validation's 400 naming the field, and said in a description: a prompt's tokens beside max_tokens within
the context, min_tokens within max_tokens, a regex, grammar or JSON schema the engine compiles,
tool_choice naming a tool of the request, a stored previous_response_id.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchserve.procs.api.field_types import MAX_N
from batchserve.procs.api.validation import TOOL_NAME_RE, UNSUPPORTED
from batchserve.shared.checks import MAX_GRAMMAR_CHARS, MAX_REGEX_CHARS, MAX_TOKEN_ID
from batchserve.shared.messages import TOOL_CHOICES

Schema = dict[str, Any]
NULL: Schema = {"type": "null"}
REF = "#/components/schemas/"
# The tokenizer's CHAT_TEMPLATE_RESERVED (another process's module; tests/test_openapi.py compares them).
TEMPLATE_RESERVED = ("conversation", "tools", "tokenize", "add_generation_prompt", "continue_final_message")
TEMPLATE_KWARGS: Schema = {"type": "object", "propertyNames": {"not": {"enum": TEMPLATE_RESERVED}}}
CONSTRAINTS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
TEXT_FORMAT: Schema = {"type": "object", "required": ["type"], "properties": {"type": {"const": "text"}}}
JSON_OBJECT_FORMAT: Schema = {"type": "object", "required": ["type"], "properties": {"type": {"const": "json_object"}}}
JSON_SCHEMA_FORMAT: Schema = {
    "type": "object",
    "required": ["type", "json_schema"],
    "properties": {
        "type": {"const": "json_schema"},
        "json_schema": {"type": "object", "required": ["schema"], "properties": {"schema": {"type": "object"}}},
    },
}


@dataclass(frozen=True)
class ServerFacts:
    """What this server knows that the request structs do not."""

    served: tuple[str, ...] = ()  # the model names `model` may take
    runner: str = "generate"  # or the pooling runner's kind: "embed", "classify"
    max_context: int = MAX_TOKEN_ID
    vocab_size: int | None = None  # token ids below it are the tokenizer's (None: not known here)
    max_prompt_chars: int | None = None  # a longer prompt text cannot fit the context
    max_in_flight: int | None = None  # choices in the server at once (None: no cap)
    priority_scheduling: bool = False  # --scheduling-policy priority: `priority` may be other than 0
    dimensions: Schema | None = None  # an embedding's `dimensions` where the model may be cut (None: nowhere)

    @property
    def top_token(self) -> int:
        return MAX_TOKEN_ID if self.vocab_size is None else self.vocab_size - 1


# ---- pieces


def optional(schema: Schema, description: str | None = None) -> Schema:
    return {"anyOf": [schema, NULL], "default": None, **({"description": description} if description else {})}


def only_neutral(values: tuple[object, ...], why: str) -> Schema:
    """A field declared to be refused: absent, null, or one of the values that mean "not used"."""
    return {"anyOf": [{"enum": list(values)}, NULL] if values else [NULL], "default": None, "description": why}


def text(max_length: int | None = None) -> Schema:
    return {"type": "string", "minLength": 1, **({"maxLength": max_length} if max_length is not None else {})}


def token_id(facts: ServerFacts) -> Schema:
    return {"type": "integer", "minimum": 0, "maximum": facts.top_token}


def prompt(facts: ServerFacts, most_ids: int | None = None) -> Schema:
    """A text, a list of token ids, or a batch of either (`prompt_fields`), none empty, within the context
    (`most_ids`: the ids that fit; default: the context less a token to generate)."""
    one = text(facts.max_prompt_chars)
    most = facts.max_context - 1 if most_ids is None else most_ids
    ids = {"type": "array", "items": token_id(facts), "minItems": 1, "maxItems": most}
    batch = [{"type": "array", "items": item, "minItems": 1} for item in (one, ids)]
    return {"anyOf": [one, ids, *batch]}


def decimal_below(n: int) -> str:
    """A regex of the decimal numbers 0 .. n - 1 (without leading zeros): logit_bias's keys."""
    top = str(n - 1)
    parts = ["0", *(f"[1-9][0-9]{{{k}}}" for k in range(len(top) - 1))]
    for i, digit in enumerate(top):
        low = 1 if i == 0 else 0
        if int(digit) > low:
            parts.append(f"{top[:i]}[{low}-{int(digit) - 1}][0-9]{{{len(top) - i - 1}}}")
    parts.append(top)
    return "^(?:" + "|".join(dict.fromkeys(parts)) + ")$"


def given(field: str, schema: Schema) -> Schema:
    """The object has `field`, matching `schema`."""
    return {"required": [field], "properties": {field: schema}}


def unless(field: str, otherwise: Schema, then: Schema) -> Schema:
    """`field` matches `otherwise` (absent, often), or `then` holds: if/then, written as the `anyOf` that
    generators handle best (Schemathesis gives up on a handful of if/then rules together)."""
    return {"anyOf": [{"properties": {field: otherwise}}, then]}


def add_rule(struct: Schema, schema: Schema) -> None:
    """A rule across fields (`allOf` holds them all)."""
    struct.setdefault("allOf", []).append(schema)


def value_of(struct: Schema, field: str) -> Schema:
    """An optional field's schema without its null: narrowing it narrows the field."""
    schema = struct["properties"][field]
    return schema["anyOf"][0] if "anyOf" in schema else schema


# ---- rules, by struct


def models(struct: Schema, facts: ServerFacts) -> None:
    """`model`: one of the served names, or null (the server's only model)."""
    if "model" in struct["properties"]:
        struct["properties"]["model"] = {"anyOf": [{"enum": list(facts.served)}, NULL]}


def sampling(struct: Schema, facts: ServerFacts) -> None:
    """The fields every generating request has (`SamplingExtras`)."""
    props = struct["properties"]
    value_of(struct, "stop_token_ids")["items"]["maximum"] = facts.top_token
    value_of(struct, "logit_bias")["propertyNames"]["pattern"] = decimal_below(facts.top_token + 1)
    value_of(struct, "min_tokens").update(
        maximum=facts.max_context - 1, description="at most max_tokens (when given); the context less the prompt"
    )
    props["top_k"] = optional({"anyOf": [{"const": -1}, {"type": "integer", "minimum": 1, "maximum": MAX_TOKEN_ID}]})
    if not facts.priority_scheduling:
        props["priority"] = optional({"type": "integer", "const": 0}, "other values need --scheduling-policy priority")


def max_tokens(*fields: str) -> Callable[[Schema, ServerFacts], None]:
    """The rule of these token-count fields: at least 1 (a completion takes 0 with echo too: left out),
    at most the context less the prompt's tokens (at least one)."""

    def rule(struct: Schema, facts: ServerFacts) -> None:
        for field in fields:
            value_of(struct, field).update(
                minimum=1, maximum=facts.max_context - 1, description="at most the context less the prompt's tokens"
            )

    return rule


def _choices(struct: Schema, facts: ServerFacts) -> None:
    """`n` within the request cap, `best_of` only as n (1 always is), stream_options with stream."""
    cap = MAX_N if facts.max_in_flight is None else min(MAX_N, facts.max_in_flight)
    value_of(struct, "n")["maximum"] = cap
    struct["properties"]["best_of"] = optional({"const": 1}, "only null, 1 or n: more is not supported")
    add_rule(struct, unless("stream_options", NULL, given("stream", {"const": True})))


def _constraints(struct: Schema, facts: ServerFacts) -> None:
    """Structured output: each field in a form validation takes. That at most one of them constrains is
    said, not written: as a rule of five branches beside the others it is more than Schemathesis expands."""
    props = struct["properties"]
    props["response_format"] = optional(
        {"anyOf": [TEXT_FORMAT, JSON_OBJECT_FORMAT, JSON_SCHEMA_FORMAT]},
        "json_schema: a JSON schema the engine compiles. At most one of response_format (but text) and the "
        "guided_* fields may be given",
    )
    props["guided_json"] = optional({"type": "object"}, "a JSON schema the engine compiles (or its JSON text)")
    props["guided_regex"] = optional(text(MAX_REGEX_CHARS), "a regex the engine compiles")
    props["guided_choice"] = optional({"type": "array", "items": {"type": "string"}, "minItems": 1})
    props["guided_grammar"] = optional(
        {"type": "string", "pattern": r"\S", "maxLength": MAX_GRAMMAR_CHARS}, "a Lark grammar the engine compiles"
    )


def unconstrained() -> Schema:
    """The structured-output fields constraining nothing: null, or response_format "text"."""
    plain = {"anyOf": [NULL, TEXT_FORMAT]}
    return {name: plain if name == "response_format" else NULL for name in CONSTRAINTS}


def _completion(struct: Schema, facts: ServerFacts) -> None:
    struct["properties"]["prompt"] = prompt(facts)
    struct["properties"]["suffix"] = only_neutral((), "not supported: leave it out")


def _chat(struct: Schema, facts: ServerFacts) -> None:
    props = struct["properties"]
    props["messages"]["minItems"] = 1
    for name, neutral in UNSUPPORTED.items():
        props[name] = only_neutral(neutral, "not supported: leave it out")
    props["chat_template_kwargs"] = optional(TEMPLATE_KWARGS)
    add_rule(struct, unless("top_logprobs", NULL, given("logprobs", {"const": True})))
    tool_choice_rules(struct, REF + "NamedToolChoice", unconstrained())


def tool_choice_rules(struct: Schema, named: str, unconstrained: Schema) -> None:
    """tool_choice: one of TOOL_CHOICES or a named function; all but "none" need tools, and a forced call
    (held by grammar) leaves out structured output (`unconstrained`: those fields' schemas)."""
    choice = {"anyOf": [{"enum": list(TOOL_CHOICES)}, {"$ref": named}]}
    struct["properties"]["tool_choice"] = optional(choice, "a named function must be one of `tools`")
    tools = {"type": "array", "minItems": 1}
    forced = {"anyOf": [{"const": "required"}, {"type": "object"}]}
    add_rule(
        struct,
        {
            "anyOf": [
                {"properties": {"tool_choice": {"anyOf": [NULL, {"const": "none"}]}}},
                {"properties": {"tool_choice": {"const": "auto"}, "tools": tools}, "required": ["tools"]},
                {"properties": {"tool_choice": forced, "tools": tools, **unconstrained}, "required": ["tools"]},
            ]
        },
    )


def _chat_message(struct: Schema, facts: ServerFacts) -> None:
    """A message by its role: content (tool calls instead, for an assistant), a tool's call id."""
    props = struct["properties"]
    props["role"] = {"enum": ["system", "user", "developer", "assistant", "tool"]}
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"$ref": REF + "TextContentPart"}}]}
    no_calls = {"anyOf": [NULL, {"type": "array", "maxItems": 0}]}
    struct["anyOf"] = [
        {
            "properties": {
                "role": {"enum": ["system", "user", "developer"]},
                "content": content,
                "tool_calls": no_calls,
            },
            "required": ["content"],
        },
        {
            "properties": {"role": {"const": "assistant"}},
            "anyOf": [given("content", content), given("tool_calls", {"type": "array", "minItems": 1})],
        },
        {
            "properties": {
                "role": {"const": "tool"},
                "content": content,
                "tool_call_id": text(),
                "tool_calls": no_calls,
            },
            "required": ["content", "tool_call_id"],
        },
    ]


def _text_part(struct: Schema, facts: ServerFacts) -> None:
    struct["properties"]["type"] = {"const": "text"}
    struct["properties"]["text"] = {"type": "string"}
    struct["required"] = ["type", "text"]


def function_type(struct: Schema, facts: ServerFacts) -> None:
    """`type`: "function", the only kind of tool (its default where it has one)."""
    default = struct["properties"]["type"].get("default")
    struct["properties"]["type"] = {"const": "function", **({"default": default} if default else {})}


def _function(struct: Schema, facts: ServerFacts) -> None:
    struct["properties"]["name"] = {"type": "string", "pattern": f"^{TOOL_NAME_RE.pattern}$"}
    value_of(struct, "parameters")["description"] = "a JSON schema (compiled when the call is forced)"


def _tokenize(struct: Schema, facts: ServerFacts) -> None:
    """Exactly one of prompt and messages; a chat may not both continue and add the generation prompt."""
    props = struct["properties"]
    props["prompt"] = optional(text(facts.max_prompt_chars))
    props["messages"] = optional({"type": "array", "items": {"$ref": REF + "ChatMessageIn"}, "minItems": 1})
    props["chat_template_kwargs"] = optional(TEMPLATE_KWARGS)
    struct["oneOf"] = [given("prompt", text()), given("messages", {"type": "array"})]
    not_true = {"anyOf": [NULL, {"const": False}]}
    add_rule(struct, unless("continue_final_message", not_true, given("add_generation_prompt", not_true)))


def _detokenize(struct: Schema, facts: ServerFacts) -> None:
    struct["properties"]["tokens"]["items"] = token_id(facts)


def _load_lora(struct: Schema, facts: ServerFacts) -> None:
    """A new adapter's name (not a served one's) and its PEFT folder on the server."""
    struct["properties"]["lora_name"] = {**text(), "not": {"enum": list(facts.served)}}
    struct["properties"]["lora_path"] = {"type": "string", "description": "a PEFT adapter's folder on the server"}


Rule = Callable[[Schema, ServerFacts], None]
# struct name -> its rules (`openapi_more_rules` has the Responses API's and the pooling endpoints')
RULES: dict[str, tuple[Rule, ...]] = {
    "CompletionRequest": (models, sampling, max_tokens("max_tokens"), _choices, _constraints, _completion),
    "ChatCompletionRequest": (
        models, sampling, max_tokens("max_tokens", "max_completion_tokens"), _choices, _constraints, _chat,
    ),
    "ChatMessageIn": (_chat_message,),
    "TextContentPart": (_text_part,),
    "ToolCallIn": (function_type,),
    "ToolIn": (function_type,),
    "FunctionIn": (_function,),
    "NamedToolChoice": (function_type,),
    "TokenizeBody": (models, _tokenize),
    "DetokenizeBody": (models, _detokenize),
    "LoadLoraBody": (_load_lora,),
}  # fmt: skip
