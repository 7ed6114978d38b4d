"""JSON Schema's keywords against the xgrammar backend: each keyword either holds (a value that
breaks it is refused by the grammar, one that keeps it accepted) or the schema is refused before
compiling with a message naming it (``structured/schema_support.py``). A keyword that moves from
one list to the other with a new xgrammar fails here."""

import json

import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string as accepts

from etinfer.structured.schema_support import unenforced_feature

ARRAY, OBJECT = {"type": "array", "items": {}}, {"type": "object", "additionalProperties": True}
AB = {"type": "object", "properties": {"a": {}, "b": {}}}
# keyword: (schema, a value that breaks it, one that keeps it)
ENFORCED = {
    "multipleOf (integer)": ({"type": "integer", "multipleOf": 3}, "4", "6"),
    "minimum": ({"type": "integer", "minimum": 3}, "2", "3"),
    "maximum": ({"type": "number", "maximum": 3.5}, "3.6", "3.4"),
    "exclusiveMinimum": ({"type": "number", "exclusiveMinimum": 0}, "0", "0.1"),
    "exclusiveMaximum": ({"type": "integer", "exclusiveMaximum": 3}, "3", "2"),
    "minLength": ({"type": "string", "minLength": 3}, '"ab"', '"abc"'),
    "maxLength": ({"type": "string", "maxLength": 2}, '"abc"', '"ab"'),
    "pattern": ({"type": "string", "pattern": "^a+$"}, '"b"', '"aa"'),
    "minItems": ({**ARRAY, "minItems": 1}, "[]", "[1]"),
    "maxItems": ({**ARRAY, "maxItems": 1}, "[1, 2]", "[1]"),
    "uniqueItems false": (
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": False},
        '["a"]',
        "[1, 1]",
    ),
    "prefixItems": (
        {"type": "array", "prefixItems": [{"type": "integer"}], "items": False},
        "[1, 2]",
        "[1]",
    ),
    "unevaluatedItems": (
        {"type": "array", "prefixItems": [{}], "unevaluatedItems": False},
        "[1, 2]",
        "[1]",
    ),
    "minProperties": ({**OBJECT, "minProperties": 1}, "{}", '{"a": 1}'),
    "maxProperties": ({**OBJECT, "maxProperties": 1}, '{"a": 1, "b": 2}', '{"a": 1}'),
    "required": ({**AB, "required": ["a"]}, "{}", '{"a": 1}'),
    "additionalProperties": ({**AB, "additionalProperties": False}, '{"c": 1}', '{"a": 1}'),
    "patternProperties": (
        {"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
        '{"x": "s"}',
        '{"x": 1}',
    ),
    "propertyNames": (
        {"type": "object", "propertyNames": {"pattern": "^a"}},
        '{"b": 1}',
        '{"a": 1}',
    ),
    "unevaluatedProperties": ({**AB, "unevaluatedProperties": False}, '{"c": 1}', '{"a": 1}'),
    "const": ({"const": {"a": [1]}}, '{"a":[2]}', '{"a":[1]}'),
    "enum": ({"enum": [1, "x"]}, "2", '"x"'),
    "type list": ({"type": ["string", "null"]}, "1", "null"),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "null", "1"),
    "oneOf of distinct types": ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "null", "1"),
    "oneOf of distinct constants": ({"oneOf": [{"const": 1}, {"enum": [2, 3]}]}, "4", "3"),
    "oneOf told apart by a required property": (
        {
            "$defs": {
                "Cat": {
                    "type": "object",
                    "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
                    "required": ["kind", "lives"],
                },
                "Dog": {
                    "type": "object",
                    "properties": {"kind": {"const": "dog"}, "bark": {"type": "string"}},
                    "required": ["kind", "bark"],
                },
            },
            "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
        },
        '{"kind": "cat", "bark": "x"}',
        '{"kind": "dog", "bark": "x"}',
    ),
    "allOf of one": ({"allOf": [{"type": "integer", "minimum": 2}]}, "1", "2"),
    "$ref": ({"$defs": {"A": {"type": "integer"}}, "$ref": "#/$defs/A"}, '"x"', "1"),
    "format": ({"type": "string", "format": "date"}, '"2024-13-01"', '"2024-12-01"'),
}
REFUSED = {
    "not": ({"not": {"type": "string"}}, '"x"', "1"),
    "uniqueItems": (
        {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        '["a", "a"]',
        '["a", "b"]',
    ),
    "contains": ({**ARRAY, "contains": {"const": 1}}, "[2]", "[1]"),
    "dependentRequired": (
        {**AB, "dependentRequired": {"a": ["b"]}},
        '{"a": 1}',
        '{"a": 1, "b": 1}',
    ),
    "dependentSchemas": (
        {**AB, "dependentSchemas": {"a": {"required": ["b"]}}},
        '{"a": 1}',
        '{"a": 1, "b": 1}',
    ),
    "dependencies": ({**AB, "dependencies": {"a": ["b"]}}, '{"a": 1}', '{"a": 1, "b": 1}'),
    "if": (
        {**AB, "if": {"required": ["a"]}, "then": {"required": ["b"]}},
        '{"a": 1}',
        '{"a": 1, "b": 1}',
    ),
    "multipleOf": ({"type": "number", "multipleOf": 0.5}, "0.3", "1.5"),
    "pattern": ({"type": "string", "pattern": "^a*$", "minLength": 2}, '"a"', '"aa"'),
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 2}]}, "1", "2"),
    # 3 matches both branches, so oneOf refuses it; compiled as anyOf, the grammar takes it.
    "oneOf": ({"oneOf": [{"type": "integer"}, {"minimum": 2}]}, "3", "1"),
    "format": (
        {"type": "string", "format": "email", "maxLength": 8},
        '"abc@example.com"',
        '"a@bc.de"',
    ),
}


def grammar(schema: dict) -> xgrammar.Grammar:
    return xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=True)


@pytest.mark.parametrize("keyword", list(ENFORCED))
def test_a_keyword_the_grammar_holds_is_compiled(keyword):
    schema, breaking, keeping = ENFORCED[keyword]
    assert unenforced_feature(schema) is None
    compiled = grammar(schema)
    assert not accepts(compiled, breaking)
    assert accepts(compiled, keeping)


@pytest.mark.parametrize("keyword", list(REFUSED))
def test_a_keyword_the_grammar_drops_is_refused_by_name(keyword):
    """Each would be loosened: xgrammar accepts the breaking value (checked, so that a keyword
    it comes to hold is moved to the other list), and the schema is refused naming it."""
    schema, breaking, keeping = REFUSED[keyword]
    refusal = unenforced_feature({"type": "object", "properties": {"x": schema}})
    assert refusal.startswith((f"'{keyword}'", keyword)) and "(at properties/x)" in refusal
    compiled = grammar(schema)
    assert accepts(compiled, breaking) and accepts(compiled, keeping)
