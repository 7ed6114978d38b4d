"""Twenty JSON schemas of the shapes APIs and agents ask for, each with a prompt that asks for
it: nested objects, arrays with bounds, enums, ``anyOf``, string formats and patterns, required
and optional fields. Written for this project (no data set is downloaded); strings are bounded
so that a 135M model finishes each object within the token budget."""

from __future__ import annotations

from typing import Any

# What a json_object request asks for. Worded so that greedy decoding closes the object on AVX2
# and AVX-512 hosts alike: after 'Reply with the JSON {"ok": true} only.' the comma after true
# is a near-tie that AVX2's rounding tips towards a string running past 64 tokens.
JSON_OBJECT_PROMPT = 'Reply with this JSON and nothing else: {"ok": true}'

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SHORT = {"type": "string", "maxLength": 40}

SCHEMAS: list[tuple[str, str, dict[str, Any]]] = [
    (
        "person",
        "Describe a person named Ana who is 31 as JSON.",
        {
            "type": "object",
            "properties": {
                "name": NAME,
                "age": {"type": "integer", "minimum": 0, "maximum": 130},
                "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org)$"},
            },
            "required": ["name", "age"],
        },
    ),
    (
        "address",
        "Give the address of a museum in Paris as JSON.",
        {
            "type": "object",
            "properties": {
                "street": SHORT,
                "city": NAME,
                "postcode": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"type": "string", "enum": ["France", "Germany", "Spain"]},
            },
            "required": ["street", "city", "postcode", "country"],
        },
    ),
    (
        "order",
        "Write a shop order with two items as JSON.",
        {
            "type": "object",
            "properties": {
                "order_id": {"type": "integer", "minimum": 1},
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                            "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                        },
                        "required": ["sku", "quantity"],
                    },
                },
                "express": {"type": "boolean"},
            },
            "required": ["order_id", "items", "express"],
        },
    ),
    (
        "sentiment",
        "Classify the sentiment of 'I loved this film' as JSON.",
        {
            "type": "object",
            "properties": {
                "label": {"type": "string", "enum": ["positive", "negative", "neutral"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["label", "confidence"],
        },
    ),
    (
        "event",
        "Describe a concert next spring as JSON with a date.",
        {
            "type": "object",
            "properties": {
                "title": SHORT,
                "date": {"type": "string", "format": "date"},
                "tickets": {"type": "integer", "minimum": 0, "maximum": 100000},
            },
            "required": ["title", "date"],
        },
    ),
    (
        "tags",
        "List up to four tags for an article about cooking, as JSON.",
        {
            "type": "object",
            "properties": {
                "tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 4},
            },
            "required": ["tags"],
        },
    ),
    (
        "point",
        "Give a point on a map as JSON.",
        {
            "type": "object",
            "properties": {
                "lat": {"type": "number", "minimum": -90, "maximum": 90},
                "lon": {"type": "number", "minimum": -180, "maximum": 180},
            },
            "required": ["lat", "lon"],
        },
    ),
    (
        "contact",
        "Give a contact as JSON: a phone number or an email.",
        {
            "type": "object",
            "properties": {
                "name": NAME,
                "reach": {
                    "anyOf": [
                        {
                            "type": "object",
                            "properties": {"phone": {"type": "string", "pattern": "^[0-9]{7}$"}},
                            "required": ["phone"],
                        },
                        {
                            "type": "object",
                            "properties": {
                                "email": {
                                    "type": "string",
                                    "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$",
                                }
                            },
                            "required": ["email"],
                        },
                    ]
                },
            },
            "required": ["name", "reach"],
        },
    ),
    (
        "weather",
        "Report the weather in Oslo as JSON.",
        {
            "type": "object",
            "properties": {
                "city": NAME,
                "celsius": {"type": "integer", "minimum": -60, "maximum": 60},
                "sky": {"type": "string", "enum": ["clear", "cloudy", "rain", "snow"]},
            },
            "required": ["city", "celsius", "sky"],
        },
    ),
    (
        "book",
        "Describe a novel as JSON with its authors.",
        {
            "type": "object",
            "properties": {
                "title": SHORT,
                "authors": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 2},
                "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
                "isbn": {"type": "string", "pattern": "^[0-9]{13}$"},
            },
            "required": ["title", "authors", "year"],
        },
    ),
    (
        "matrix",
        "Write a 2 by 2 matrix of small integers as JSON.",
        {
            "type": "object",
            "properties": {
                "rows": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 2,
                    "items": {
                        "type": "array",
                        "minItems": 2,
                        "maxItems": 2,
                        "items": {"type": "integer", "minimum": -9, "maximum": 9},
                    },
                }
            },
            "required": ["rows"],
        },
    ),
    (
        "answer",
        "Is water wet? Answer as JSON.",
        {
            "type": "object",
            "properties": {"answer": {"type": "boolean"}, "reason": SHORT},
            "required": ["answer"],
        },
    ),
    (
        "user",
        "Create a user account record as JSON.",
        {
            "type": "object",
            "properties": {
                "username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,11}$"},
                "role": {"type": "string", "enum": ["admin", "editor", "viewer"]},
                "active": {"type": "boolean"},
                "created": {"type": "string", "format": "date-time"},
            },
            "required": ["username", "role", "active"],
        },
    ),
    (
        "recipe",
        "Give a short recipe for tea as JSON.",
        {
            "type": "object",
            "properties": {
                "name": NAME,
                "steps": {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 3},
                "minutes": {"type": "integer", "minimum": 1, "maximum": 120},
            },
            "required": ["name", "steps"],
        },
    ),
    (
        "color",
        "Give a colour as JSON with its hex code.",
        {
            "type": "object",
            "properties": {
                "name": NAME,
                "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"},
            },
            "required": ["name", "hex"],
        },
    ),
    (
        "company",
        "Describe a company and its headquarters as JSON.",
        {
            "type": "object",
            "properties": {
                "name": NAME,
                "employees": {"type": "integer", "minimum": 1, "maximum": 1000000},
                "hq": {
                    "type": "object",
                    "properties": {"city": NAME, "country": NAME},
                    "required": ["city", "country"],
                },
            },
            "required": ["name", "hq"],
        },
    ),
    (
        "score",
        "Give the score of a football match as JSON.",
        {
            "type": "object",
            "properties": {
                "home": NAME,
                "away": NAME,
                "result": {
                    "type": "array",
                    "prefixItems": [
                        {"type": "integer", "minimum": 0, "maximum": 20},
                        {"type": "integer", "minimum": 0, "maximum": 20},
                    ],
                    "items": False,
                    "minItems": 2,
                },
            },
            "required": ["home", "away", "result"],
        },
    ),
    (
        "task",
        "Write a to-do item as JSON with an optional due date.",
        {
            "type": "object",
            "properties": {
                "title": SHORT,
                "done": {"type": "boolean"},
                "priority": {
                    "anyOf": [{"type": "integer", "minimum": 1, "maximum": 5}, {"type": "null"}]
                },
                "due": {"type": "string", "format": "date"},
            },
            "required": ["title", "done", "priority"],
        },
    ),
    (
        "translation",
        "Translate 'good morning' to French and Spanish, as JSON.",
        {
            "type": "object",
            "properties": {
                "source": SHORT,
                "translations": {
                    "type": "array",
                    "maxItems": 2,
                    "items": {
                        "type": "object",
                        "properties": {
                            "language": {"type": "string", "enum": ["fr", "es", "de"]},
                            "text": SHORT,
                        },
                        "required": ["language", "text"],
                    },
                },
            },
            "required": ["source", "translations"],
        },
    ),
    (
        "measurement",
        "Record a temperature reading as JSON with its unit.",
        {
            "type": "object",
            "properties": {
                "value": {"type": "number"},
                "unit": {"type": "string", "enum": ["C", "F", "K"]},
                "sensor": {"type": "string", "pattern": "^S[0-9]{2}$"},
            },
            "required": ["value", "unit", "sensor"],
        },
    ),
]


def schema_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's ``response_format`` asking for ``schema``, strict."""
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
