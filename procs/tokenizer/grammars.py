"""Structured output, compiled: a request's `OutputConstraint` or forced tool call becomes the
llguidance grammar (`LogitsParams.grammar`) the worker masks the request's tokens with.

Compiling is checking: every grammar is validated against the model's tokenizer here, so a bad
schema, regex or Lark grammar is a 400 naming its field, never a failure in the worker. Results are
cached by their source text (a service usually sends the same few schemas).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import llguidance
from llguidance import LLMatcher

from batchserve.shared.chat_format import HERMES_CLOSE, HERMES_OPEN, ToolCallStyle
from batchserve.shared.errors import Refusal
from batchserve.shared.grammar import check_constraint_source, check_json_schema
from batchserve.shared.messages import OutputConstraint, ToolFunction

if TYPE_CHECKING:  # in llguidance's stubs alone
    from llguidance._lib import JsonCompileOptions

# JSON as models usually write it (", " and ": "), and no other whitespace: with free whitespace a
# small model can fill max_tokens with newlines and never close the object.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": True,
}  # lenient: ignore keywords it cannot enforce ("format": ...)
CACHE_SIZE = 256


class GrammarCompiler:
    def __init__(self, tokenizer: llguidance.LLTokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: OrderedDict[tuple[str, ...], str] = OrderedDict()

    def for_constraint(self, constraint: OutputConstraint) -> str:
        def build() -> str:
            # the api checked this too; the offline engine's requests come straight here
            check_constraint_source(constraint.kind, constraint.spec, constraint.param)
            return _constraint_grammar(constraint)

        return self._cached((constraint.kind, constraint.spec), constraint.param, build)

    def for_tool_call(self, tools: list[ToolFunction], forced: str | None, style: ToolCallStyle) -> str:
        """Exactly one call, of `forced` or (None) of any of `tools`, in the format the model was told."""
        candidates = [t for t in tools if forced is None or t.name == forced]
        key = ("tool", style, json.dumps([[t.name, t.parameters] for t in candidates], sort_keys=True))

        def build() -> str:
            for tool in candidates:
                check_json_schema(tool.parameters, "tools")
            return _tool_call_grammar(candidates, style)

        return self._cached(key, "tools", build)

    def _cached(self, key: tuple[str, ...], param: str, build: Any) -> str:
        grammar = self._cache.get(key)
        if grammar is not None:
            self._cache.move_to_end(key)
            return grammar
        try:
            grammar = build()
        except Refusal:
            raise
        except ValueError as exc:  # llguidance: not JSON, not a list of strings...
            raise Refusal(f"invalid {param}: {exc}", param) from None
        error = LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise Refusal(f"invalid {param}: {error.strip()}", param)
        self._cache[key] = grammar
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return grammar


def _constraint_grammar(c: OutputConstraint) -> str:
    if c.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if c.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(c.spec, defaults=JSON_OPTIONS)
    if c.kind == "regex":
        return LLMatcher.grammar_from_regex(c.spec)
    if c.kind == "choice":
        choices = json.loads(c.spec)
        if not choices or not all(isinstance(x, str) for x in choices):
            raise ValueError("expected a non-empty list of strings")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(x) for x in choices))
    if c.kind == "lark":
        return LLMatcher.grammar_from_lark(c.spec)
    raise ValueError(f"unknown constraint kind {c.kind!r}")


def _tool_call_grammar(tools: list[ToolFunction], style: ToolCallStyle) -> str:
    """Hermes: <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>; json (Llama 3):
    {"name": ..., "parameters": {...}}. The arguments always match the function's schema."""
    args_key = "arguments" if style == "hermes" else "parameters"
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, args_key: t.parameters},
            "required": ["name", args_key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = (
        {"anyOf": calls, "x-guidance": JSON_OPTIONS} if len(calls) > 1 else {**calls[0], "x-guidance": JSON_OPTIONS}
    )
    call = "%json " + json.dumps(schema)
    if style == "json":
        return LLMatcher.grammar_from_lark(f"start: {call}")
    return LLMatcher.grammar_from_lark(
        f"start: {json.dumps(HERMES_OPEN + chr(10))} {call} {json.dumps(chr(10) + HERMES_CLOSE)}"
    )
