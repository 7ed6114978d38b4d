"""JSON-schema features a grammar cannot enforce, found before compiling.

xgrammar compiles some schemas whose every constraint it does not enforce: it warns (or says
nothing) and the output may then break the schema. Measured with xgrammar 0.2.8 by feeding a
violating value to a matcher (tests/structured/test_schema_keywords.py holds each): ``not``,
``uniqueItems``, ``contains`` (and its counts), ``dependentRequired``, ``dependentSchemas``,
``dependencies``, ``if``/``then``/``else``, ``multipleOf`` on numbers that need not be integers,
``allOf`` of more than one schema (the branches are not merged), ``pattern`` together with
``minLength``/``maxLength`` or ``format`` (all but the pattern dropped), ``format`` together with
``minLength``/``maxLength`` (the lengths are dropped), and the formats ``regex``, ``idn-email``,
``iri`` and any it does not know (the format is dropped). A schema that uses one of them is
refused, naming the keyword and where it is, rather than answered with JSON that may not
validate. ``oneOf`` is compiled as ``anyOf``, which is exact only where no value can match
two branches: a ``oneOf`` is kept where its branches are of distinct types, distinct constants,
or objects told apart by a required property's constants (the discriminated union Pydantic
writes), and refused where they may overlap.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

ENFORCED_FORMATS = frozenset(
    {
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)
# RFC 3339's full-date with each month's days (February's 29 in any year: leap years would
# make the pattern far longer), and its full-time, "T" and "Z" in either case (section 5.6).
_LONG, _SHORT = r"(0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])", r"(0[469]|11)-(0[1-9]|[12][0-9]|30)"
_DAYS = f"({_LONG}|{_SHORT}|02-(0[1-9]|[12][0-9]))"
_DATE = r"[0-9]{4}-" + _DAYS
_OFFSET = r"([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]{1,9})?" + _OFFSET
BOUNDED_FORMATS = {"date-time": f"^{_DATE}[Tt]{_TIME}$", "time": f"^{_TIME}$"}
_ONE_SCHEMA = (
    "items",
    "additionalProperties",
    "not",
    "contains",
    "propertyNames",
    "if",
    "then",
    "else",
    "additionalItems",
    "unevaluatedItems",
    "unevaluatedProperties",
)
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


# Keywords xgrammar 0.2.8 compiles and does not enforce (a value that breaks them is accepted);
# llguidance refuses each of them as unimplemented.
_IGNORED_KEYWORDS = (
    "not",
    "contains",
    "minContains",
    "maxContains",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "if",
    "then",
    "else",
)


def unenforced_feature(schema: object) -> str | None:
    """The first feature of ``schema`` a grammar would not enforce, with where it is."""
    for path, node in subschemas(schema):
        where = "/".join(path) or "(root)"
        ignored = next((k for k in _IGNORED_KEYWORDS if k in node), None)
        if ignored is not None:
            return f"{ignored!r} (at {where})"
        if node.get("uniqueItems") is True:
            return f"'uniqueItems' (at {where})"
        if "multipleOf" in node and node.get("type") != "integer":
            return f"'multipleOf' on a type other than integer (at {where})"
        if isinstance(node.get("oneOf"), list) and not _disjoint(node["oneOf"], schema):
            return f"'oneOf' whose branches may overlap (at {where})"
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return f"'allOf' of more than one schema (at {where})"
        lengths = "minLength" in node or "maxLength" in node
        if "pattern" in node and (lengths or "format" in node):
            return f"'pattern' with minLength, maxLength or format (at {where})"
        fmt = node.get("format")
        if fmt is not None:
            if fmt not in ENFORCED_FORMATS:
                return f"format {fmt!r} (at {where})"
            if lengths:
                return f"format with minLength or maxLength (at {where})"
    return None


def _disjoint(branches: list, root: object) -> bool:
    """Whether no value can match two of ``branches`` (local references resolved from
    ``root``), by what a schema states outright; anything else counts as a possible overlap."""
    resolved = [_resolved(branch, root) for branch in branches]
    return all(_apart(a, b, root) for i, a in enumerate(resolved) for b in resolved[i + 1 :])


def _apart(a: dict, b: dict, root: object) -> bool:
    types_a, types_b = _types(a), _types(b)
    if types_a is not None and types_b is not None and not types_a & types_b:
        return True
    values_a, values_b = _constants(a), _constants(b)
    if values_a is not None and values_b is not None and not values_a & values_b:
        return True
    # Objects that each require a property whose constants the other's do not take.
    shared = set(a.get("required", ())) & set(b.get("required", ()))
    for name in shared:
        keys = [_constants(_resolved(s.get("properties", {}).get(name), root)) for s in (a, b)]
        if None not in keys and not keys[0] & keys[1]:
            return True
    return False


def _types(schema: dict) -> set[str] | None:
    """The JSON types a schema allows, where it says (an integer is a number too)."""
    named = schema.get("type")
    if named is None:
        return None
    found = {named} if isinstance(named, str) else set(named)
    if "number" in found:
        found.add("integer")
    if "integer" in found:
        found.add("number")
    return found


def _constants(schema: dict) -> set[str] | None:
    """The values a schema allows, where it lists them (as canonical JSON text)."""
    if "const" in schema:
        return {json.dumps(schema["const"], sort_keys=True)}
    if isinstance(schema.get("enum"), list):
        return {json.dumps(value, sort_keys=True) for value in schema["enum"]}
    return None


def _resolved(schema: object, root: object, depth: int = 8) -> dict:
    """``schema``, following local references (``#/...``) from ``root``; {} where it is not an
    object or a reference does not resolve."""
    while depth and isinstance(schema, dict) and isinstance(schema.get("$ref"), str):
        ref, node = schema["$ref"], root
        if not ref.startswith("#"):
            return {}
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            node = node.get(part) if isinstance(node, dict) else None
        schema, depth = node, depth - 1
    return schema if isinstance(schema, dict) else {}


def closed_objects(schema: object) -> object:
    """A copy of ``schema`` whose objects with listed properties allow no others unless they
    say so: what OpenAI's strict mode and xgrammar's default do, given to every backend."""
    closed = json.loads(json.dumps(schema))
    for _, node in subschemas(closed):
        if "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
    return closed


def bounded_fractions(schema: object) -> object:
    """A copy of ``schema`` whose ``date-time`` and ``time`` strings take at most nine digits
    of a second (nanoseconds: what Go, Java and PostgreSQL keep), as patterns, for the grammar
    alone: RFC 3339 bounds none, and a model that starts a fraction can write digits until
    ``max_tokens`` (the default model did, sampling at 0.7 on an H200: "22.00000000039..." for
    256 tokens). A string in that pattern is a valid date-time or time (but for February 29 of
    a year that is not a leap year), so the schema the output is checked against stays the
    caller's. A node with a pattern of its own keeps its format: its pattern bounds it."""
    bounded = json.loads(json.dumps(schema))
    for _, node in subschemas(bounded):
        if node.get("format") in BOUNDED_FORMATS and "pattern" not in node:
            node["pattern"] = BOUNDED_FORMATS[node.pop("format")]
    return bounded


def hoisted(schema: object, name: str) -> dict[str, Any]:
    """Definitions under which ``schema`` can sit inside an enclosing schema (the call list of
    ``tool_choice: "required"`` holds each tool's parameters so): ``schema`` itself as ``name``
    and each of its ``$defs`` and ``definitions`` as ``name.defs.NAME``, every reference within
    them rewritten to resolve from the enclosing schema's root, whose ``$defs`` must hold them
    all. Left in place, a reference such as ``#/$defs/Address`` (every Pydantic model with a
    nested one) points at the enclosing root, where nothing of that name is."""
    copy = json.loads(json.dumps(schema))
    if not isinstance(copy, dict):
        return {name: copy}
    defs = {name: copy}
    for key in ("$defs", "definitions"):
        for inner, definition in (copy.pop(key, None) or {}).items():
            defs[f"{name}.defs.{inner}"] = definition
    for definition in defs.values():
        for _, node in subschemas(definition):
            if isinstance(node.get("$ref"), str) and node["$ref"].startswith("#"):
                node["$ref"] = _rebased(node["$ref"], name)
    return defs


def _rebased(ref: str, name: str) -> str:
    """A reference from a schema's root made to resolve from the root holding ``hoisted``'s
    definitions (JSON pointer segments escape ``~`` and ``/`` as ``~0`` and ``~1``)."""
    parts = ref[1:].split("/")
    if len(parts) >= 3 and parts[0] == "" and parts[1] in ("$defs", "definitions"):
        inner = parts[2].replace("~1", "/").replace("~0", "~")
        target = f"{name}.defs.{inner}".replace("~", "~0").replace("/", "~1")
        return "/".join(["#", "$defs", target, *parts[3:]])
    return f"#/$defs/{name.replace('~', '~0').replace('/', '~1')}{ref[1:]}"


def subschemas(schema: object) -> Iterator[tuple[list[str], dict[str, Any]]]:
    """Every schema object within ``schema`` with its path, iteratively (no deep recursion)."""
    stack: list[tuple[list[str], object]] = [([], schema)]
    while stack:
        path, node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield path, node
        for key in _ONE_SCHEMA:
            if isinstance(node.get(key), dict):
                stack.append(([*path, key], node[key]))
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend(([*path, key, str(i)], s) for i, s in enumerate(node[key]))
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend(([*path, key, name], s) for name, s in node[key].items())
