"""`shared.schema_finite`: a JSON schema with no finite instance (required properties that refer back
with no way out) is found, and refused before any grammar is compiled; every schema with one passes."""

from __future__ import annotations

import pytest

from batchserve.shared.errors import Refusal
from batchserve.shared.grammar import check_json_schema
from batchserve.shared.schema_finite import has_finite_instance


def node(child: dict, required: bool = True) -> dict:
    return {"type": "object", "properties": {"child": child}, **({"required": ["child"]} if required else {})}


REF_N = {"$ref": "#/$defs/n"}
ENDLESS = [
    {"$defs": {"n": node(REF_N)}, "$ref": "#/$defs/n"},  # the issue's example
    node({"$ref": "#"}),  # the root itself
    {
        "definitions": {"a": node({"$ref": "#/definitions/b"}), "b": node({"$ref": "#/definitions/a"})},
        "$ref": "#/definitions/a",
    },
    {
        "type": "object",
        "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "minItems": 1}},
        "required": ["kids"],
    },
    {"$defs": {"n": node({"allOf": [REF_N, {"type": "object"}]})}, "$ref": "#/$defs/n"},
    {"$defs": {"n": node({"anyOf": [REF_N, node(REF_N)]})}, "$ref": "#/$defs/n"},
    False,
]
FINITE = [
    {"$defs": {"n": node({"anyOf": [REF_N, {"type": "null"}]})}, "$ref": "#/$defs/n"},  # a tree: null ends it
    {"$defs": {"n": node(REF_N, required=False)}, "$ref": "#/$defs/n"},  # optional: leave it out
    {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]},
    {"$defs": {"n": node({**node(REF_N), "type": ["object", "string"]})}, "$ref": "#/$defs/n"},  # a string ends it
    {"$defs": {"n": {"properties": {"child": REF_N}, "required": ["child"]}}, "$ref": "#/$defs/n"},  # no type: any
    node({"$ref": "https://example.com/other.json"}),  # another document: not ours to judge
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"]},
    {"enum": [1, 2]},
    True,
]


@pytest.mark.parametrize("schema", ENDLESS)
def test_no_finite_instance(schema):
    assert not has_finite_instance(schema)


@pytest.mark.parametrize("schema", FINITE)
def test_a_finite_instance(schema):
    assert has_finite_instance(schema)


def test_the_check_refuses_naming_the_field():
    with pytest.raises(Refusal, match="no finite instance") as caught:
        check_json_schema(ENDLESS[0], "response_format")
    assert caught.value.param == "response_format"
