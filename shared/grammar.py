"""The grammar engine's view of a model's tokenizer, built the same way by the tokenizer process (to
check grammars) and the worker (to mask logits): llguidance (https://github.com/guidance-ai/llguidance),
which compiles JSON schemas, regexes and Lark grammars and computes each step's allowed-token bitmask.

Also the checks a grammar's source passes before anything compiles it (`check_constraint_source`,
`check_regex`, `check_json_schema`, `check_lark`): its size and its repetition bounds, against the
limits in `shared.checks`. llguidance bounds the rest itself (`LLParserLimits`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llguidance

from batchserve.shared.checks import MAX_GRAMMAR_CHARS, MAX_NESTED_REPEAT, MAX_REGEX_CHARS, MAX_REGEX_REPEAT
from batchserve.shared.errors import Refusal
from batchserve.shared.schema_finite import has_finite_instance


def grammar_tokenizer(model_dir: Path, vocab_size: int, eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """`vocab_size` is the model's logits width (ids past the tokenizer's own are never allowed);
    a grammar that is complete allows only the EOS ids. Slow for a large vocabulary: build it once."""
    tokenizer_json = Path(model_dir) / "tokenizer.json"
    eos = list(eos_token_ids) or None
    if tokenizer_json.is_file():
        return llguidance.LLTokenizer(tokenizer_json.read_text(), n_vocab=vocab_size, eos_token=eos)
    from llguidance.hf import from_tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # a slow-only folder: transformers converts it

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):  # from_tokenizer's own check
        raise ValueError("Only fast tokenizers are supported")
    return from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)


# ---- source checks

# Python's regex parser reads the repetitions; these rewrite the few spellings of llguidance's
# (Rust's) syntax that Python does not read, into something with the same repetitions.
_RUST_ONLY = [
    (re.compile(r"\\[pP](\{[^}]*\}|[A-Za-z])"), "."),  # Unicode classes \p{L}, \pL
    (re.compile(r"\\[xuU]\{[0-9A-Fa-f]+\}"), "."),  # \x{1F600}
    (re.compile(r"\(\?<(?=[A-Za-z_])"), "(?P<"),  # named groups (?<name>...)
    (re.compile(r"\(\?[imsxUu-]+\)"), "(?:)"),  # flags in the middle: Python wants them first
    (re.compile(r"\\z"), r"\\Z"),
]
_REPEATS = None  # re._constants' repeat opcodes, looked up on first use


def _repeat_ops() -> tuple[Any, ...]:
    global _REPEATS
    if _REPEATS is None:
        from re import _constants as c  # type: ignore[attr-defined]  # re's private module: no stubs

        _REPEATS = tuple(
            getattr(c, name) for name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT") if hasattr(c, name)
        )
    return _REPEATS


def check_regex(pattern: str, param: str) -> None:
    """A regex of at most MAX_REGEX_CHARS whose repetition bounds are each at most MAX_REGEX_REPEAT
    and, nested, multiply to at most MAX_NESTED_REPEAT; else a `Refusal` naming `param`. Whether
    it is otherwise valid is llguidance's to say."""
    if len(pattern) > MAX_REGEX_CHARS:
        raise Refusal(f"{param}: a regex may be at most {MAX_REGEX_CHARS} characters (got {len(pattern)})", param)
    text = pattern
    for rust, python in _RUST_ONLY:
        text = rust.sub(python, text)
    from re import _parser  # type: ignore[attr-defined]  # re's private module: no stubs

    try:
        tree = _parser.parse(text)
    except RecursionError:
        raise Refusal(f"{param}: the regex nests groups too deeply", param) from None
    except (re.error, OverflowError, ValueError) as exc:
        # llguidance's syntax is not Python's: its own verdict, if it has one, is the better message
        error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_regex(pattern))
        reason = error.strip() or f"its repetitions cannot be checked here (Python's re: {exc})"
        raise Refusal(f"{param}: invalid regex: {reason}", param) from None
    _check_repeats(tree, 1, param)


def _check_repeats(items: Any, outer: int, param: str) -> None:
    """Walk a parsed regex; `outer`: the product of the bounds of the repetitions around `items`."""
    from re import _constants as c  # type: ignore[attr-defined]  # re's private module: no stubs

    for op, av in items:
        if op in _repeat_ops():
            low, high, sub = av
            bounded = high != c.MAXREPEAT
            bound = high if bounded else low  # a loop (*, +, {m,}) costs its minimum, not a copy per pass
            if bound > MAX_REGEX_REPEAT:
                raise Refusal(f"{param}: a repetition bound may be at most {MAX_REGEX_REPEAT} (got {bound})", param)
            product = outer * max(bound, 1)
            if outer > 1 and bound > 1 and product > MAX_NESTED_REPEAT:
                raise Refusal(
                    f"{param}: nested repetitions may multiply to at most {MAX_NESTED_REPEAT} (these reach {product})",
                    param,
                )
            _check_repeats(sub, product, param)
        elif op == c.SUBPATTERN:
            _check_repeats(av[-1], outer, param)
        elif op == c.BRANCH:
            for branch in av[1]:
                _check_repeats(branch, outer, param)
        elif op in (c.ASSERT, c.ASSERT_NOT):
            _check_repeats(av[1], outer, param)
        elif op == c.GROUPREF_EXISTS:
            for branch in av[1:]:
                if branch is not None:
                    _check_repeats(branch, outer, param)
        elif op == getattr(c, "ATOMIC_GROUP", None):
            _check_repeats(av, outer, param)


def _check_size(source: str, what: str, param: str) -> None:
    if len(source) > MAX_GRAMMAR_CHARS:
        raise Refusal(f"{param}: {what} may be at most {MAX_GRAMMAR_CHARS} characters (got {len(source)})", param)


def check_json_schema(schema: Any, param: str) -> None:
    """A JSON schema (an object, or its JSON text) within MAX_GRAMMAR_CHARS, with a finite instance
    (`schema_finite`), each of its `pattern`s and `patternProperties` a regex that passes `check_regex`."""
    text = schema if isinstance(schema, str) else json.dumps(schema)
    _check_size(text, "a JSON schema", param)
    parsed = json.loads(text) if isinstance(schema, str) else schema
    if not has_finite_instance(parsed):
        raise Refusal(
            f"{param}: the schema has no finite instance (its required properties refer back to it with no way "
            "out), so no answer could ever be complete",
            param,
        )
    stack = [parsed]
    while stack:  # iterative: a deeply nested schema must not exhaust the stack here
        node = stack.pop()
        if isinstance(node, dict):
            pattern = node.get("pattern")
            if isinstance(pattern, str):
                check_regex(pattern, param)
            properties = node.get("patternProperties")
            if isinstance(properties, dict):
                for key in properties:
                    check_regex(key, param)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


# Lark: /regex/flags terminals, and the ~ n / ~ n..m repetition
_LARK_REGEX = re.compile(r"/((?:\\.|[^/\\\n])+)/[imslux]*")
_LARK_RANGE = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?")


def check_lark(grammar: str, param: str) -> None:
    """A Lark grammar within MAX_GRAMMAR_CHARS whose regex terminals pass `check_regex` and whose
    `~` repetitions are each at most MAX_REGEX_REPEAT."""
    _check_size(grammar, "a grammar", param)
    for match in _LARK_REGEX.finditer(grammar):
        check_regex(match.group(1), param)
    for match in _LARK_RANGE.finditer(grammar):
        bound = max(int(match.group(1)), int(match.group(2) or 0))
        if bound > MAX_REGEX_REPEAT:
            raise Refusal(f"{param}: a repetition bound may be at most {MAX_REGEX_REPEAT} (got {bound})", param)


def check_constraint_source(kind: str, spec: str, param: str) -> None:
    """The checks for an `OutputConstraint`'s source (`kind`, `spec` as in shared.messages)."""
    if kind == "regex":
        check_regex(spec, param)
    elif kind == "json_schema":
        check_json_schema(spec, param)
    elif kind == "lark":
        check_lark(spec, param)
    elif kind == "choice":
        _check_size(spec, "the choices", param)
