"""Whether a JSON schema has a finite instance at all.

A schema whose required properties lead back to itself with no way out (`{"$ref": "#/$defs/n"}` where n
requires a `child` that is an n) describes only infinite documents. A grammar engine accepts it and
expands it lazily while generating, until it runs out of room mid-answer: such a schema is refused up
front instead (`shared.grammar.check_json_schema`).

Local `$ref`s ("#", "#/$defs/x", "#/definitions/x", any JSON pointer into the document) are solved as a
least fixed point: every reference starts as "no finite instance" and turns true once its target has one
under what is known so far, until nothing changes. A reference this cannot resolve (another document) and
any keyword it does not model count as satisfiable: only a schema that certainly has no finite instance
is refused.
"""

from __future__ import annotations

from typing import Any

PRIMITIVE_TYPES = frozenset({"string", "number", "integer", "boolean", "null"})


def has_finite_instance(schema: Any) -> bool:
    """True unless every instance of `schema` (a parsed JSON schema) would be infinite."""
    refs = _local_refs(schema)
    known = dict.fromkeys(refs, False)
    changed = True
    while changed:
        changed = False
        for ref in refs:
            if not known[ref] and _finite(_resolve(schema, ref), known):
                known[ref] = changed = True
    return _finite(schema, known)


def _local_refs(schema: Any) -> list[str]:
    found: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#") and _resolve(schema, ref) is not None:
                found.add(ref)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return sorted(found)


def _resolve(schema: Any, ref: str) -> Any:
    """The node a local JSON pointer names, or None."""
    node = schema
    for part in ref[1:].lstrip("/").split("/") if ref not in ("#", "#/") else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _finite(node: Any, known: dict[str, bool]) -> bool:
    """Whether `node` has a finite instance, taking each reference as `known` says (not following it)."""
    if isinstance(node, bool):
        return node
    if not isinstance(node, dict):
        return True
    ref = node.get("$ref")
    if isinstance(ref, str) and not known.get(ref, True):
        return False
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list) and branches and not any(_finite(b, known) for b in branches):
            return False
    branches = node.get("allOf")
    if isinstance(branches, list) and not all(_finite(b, known) for b in branches):
        return False
    if "const" in node or "enum" in node:
        return True
    types = node.get("type")
    kinds = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    if not kinds & {"array", "object"} or kinds & PRIMITIVE_TYPES:  # no type: anything, a string too
        return True
    return ("array" in kinds and _array_finite(node, known)) or ("object" in kinds and _object_finite(node, known))


def _object_finite(node: dict, known: dict[str, bool]) -> bool:
    properties, extra, required = node.get("properties"), node.get("additionalProperties"), node.get("required")
    if not isinstance(properties, dict):
        properties = {}
    for name in required if isinstance(required, list) else []:
        schema = properties.get(name, extra if isinstance(extra, dict | bool) else True)
        if not _finite(schema, known):
            return False
    return True


def _array_finite(node: dict, known: dict[str, bool]) -> bool:
    least = node.get("minItems", 0)
    if not isinstance(least, int) or least <= 0:
        return True
    prefix = node.get("prefixItems")
    needed: list[Any] = prefix[:least] if isinstance(prefix, list) else []
    if least > len(needed):
        needed.append(node.get("items", True))
    return all(_finite(item, known) for item in needed)
