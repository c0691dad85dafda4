"""JSON schemas as xgrammar compiles them (`json_schema_ebnf`), and the keywords it would not
enforce, refused by name rather than dropped.

xgrammar turns a JSON schema into a grammar and leaves out what the grammar cannot say, most of
it without a word (a few with a warning on the worker's stderr). A request then got text that
breaks its own schema with finish_reason "stop": a fuzz of the served SmolLM2 (2026-12-07) got
`[-4, 0, 0]` for `uniqueItems` and `[10.9034295519625]` for `multipleOf: 0.5`. vLLM's xgrammar
backend refuses such schemas (`has_xgrammar_unsupported_json_features`) and vLLM's "auto" hands
them to llguidance; so does Folio (`Unenforced`, caught in guided.py: guided_llg.py), and what
llguidance cannot enforce either is a 400 naming the keyword and where it is
(tests/engine/test_structured_output.py samples each kind of constraint and validates the outputs).

`format` is an annotation in JSON Schema (validators do not assert it unless asked): xgrammar
enforces the formats it knows (email, date, uuid, ...) and passes others as any string, which
the schema allows; so it is not refused, except beside minLength / maxLength, which xgrammar
then drops.

Only schema positions are walked (a property *named* "not" is no keyword): properties, items,
prefixItems, additionalProperties, anyOf / oneOf / allOf and $defs / definitions; enum, const,
default and examples hold data.
"""

from __future__ import annotations

import json

from folio.worker.errors import InvalidRequestError


class Unenforced(InvalidRequestError):
    """A schema xgrammar would compile without some of its keywords (guided.py then asks llguidance)."""

# ignored wherever they are (the pinned xgrammar: no grammar for them)
UNENFORCED = ("contains", "minContains", "maxContains", "uniqueItems", "patternProperties", "propertyNames",
              "dependentSchemas", "dependentRequired", "not", "if", "then", "else", "unevaluatedItems",
              "unevaluatedProperties")
# what may stand beside a $ref (xgrammar follows the reference and drops its siblings)
REF_SIBLINGS = frozenset({"$ref", "$defs", "definitions", "$schema", "$id", "$comment", "title", "description",
                          "default", "examples"})
_SUBSCHEMA = ("items", "additionalProperties", "additionalItems")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf", "items")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")


def unenforced(schema) -> str | None:
    """Why xgrammar would not enforce all of `schema` (the first keyword found, with its path), or None.
    A local $ref's target is walked too, wherever it is (xgrammar followed "#/foo" into a place not
    walked here and dropped the uniqueItems it found: a fuzz, 2026-12-08)."""
    todo, seen = [(schema, "#")], set()
    while todo:
        node, path = todo.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node.get("$ref"), str) and node["$ref"].startswith("#"):
            todo.append((_pointed(schema, node["$ref"]), node["$ref"]))
        why = _own(node)
        if why is not None:
            return f"{why} (at {path})"
        for k in _SUBSCHEMA:
            if isinstance(node.get(k), dict):
                todo.append((node[k], f"{path}/{k}"))
        for k in _SUBSCHEMA_LISTS:
            if isinstance(node.get(k), list):
                todo.extend((s, f"{path}/{k}/{i}") for i, s in enumerate(node[k]))
        for k in _SUBSCHEMA_MAPS:
            if isinstance(node.get(k), dict):
                todo.extend((s, f"{path}/{k}/{name}") for name, s in node[k].items())
    return None


def _pointed(doc, pointer: str):
    """The JSON pointer's target in `doc` ("#/a/b~1c"), or None."""
    node = doc
    for part in [p.replace("~1", "/").replace("~0", "~") for p in pointer[1:].split("/") if p]:
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _own(node: dict) -> str | None:
    """A keyword of this schema object (not its subschemas) that xgrammar drops or gets wrong. The
    2026-12-08 fuzz found the last five: xgrammar dropped `multipleOf` beside a range, over 1024 or
    not whole; dropped keywords beside an allOf of one; wrote a pattern's control characters raw
    (no JSON), took `a^b` as "ab" and ignored lookaheads; left out a required name that
    additionalProperties false forbids; and took an empty anyOf as any text."""
    for k in UNENFORCED:
        if k in node:
            return f"{k!r} is not enforced by the grammar engine"
    types = node.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    if "multipleOf" in node and types != {"integer"}:
        return "'multipleOf' is enforced on integers only (\"type\": \"integer\")"
    step = node.get("multipleOf")
    if step is not None and not (type(step) is int and 0 < step <= 1024 and not any(
            k in node for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"))):
        return "'multipleOf' is enforced only as a whole number up to 1024 and without a range"
    if "pattern" in node:
        return "'pattern' is not enforced whole by the grammar engine"
    if "format" in node and ("minLength" in node or "maxLength" in node):  # (a pattern goes above)
        return "minLength / maxLength beside a format are not enforced by the grammar engine"
    if "allOf" in node:
        return "'allOf' is not enforced by the grammar engine"
    if any(node.get(k) == [] for k in ("anyOf", "oneOf")):
        return "an empty 'anyOf' / 'oneOf' matches nothing"
    if node.get("additionalProperties") is False and isinstance(node.get("required"), list) and any(
            r not in (node.get("properties") or {}) for r in node["required"]) and "patternProperties" not in node:
        return "a required property that additionalProperties false forbids"
    if "$ref" in node and any(k not in REF_SIBLINGS for k in node):
        extra = sorted(k for k in node if k not in REF_SIBLINGS)
        return f"keywords beside '$ref' ({', '.join(extra)}) are not enforced by the grammar engine"
    return None


# xgrammar 0.2.9 writes a string with minLength / maxLength as characters [^"\\\r\n]: a raw
# control character (which JSON forbids in a string: json.loads refused "\x03" from a random
# model) passes it. The same class as its unbounded strings, [^\0-\x1f"\\], fixes it.
_BOUNDED_CHAR = r'[^\"\\\r\n]'
_JSON_CHAR = r'[^\0-\x1f\"\\]'


# The deepest JSON schema document compiled (objects and arrays within each other). xgrammar's
# EBNF grows with the square of the depth: a schema of objects nested 100 deep (document depth
# 201) took 70 ms to compile here, 450 deep (16.7 KB, under MAX_SPEC_CHARS) ~9 s, during which
# the worker compiling it ran no step. 128 keeps ~60 levels of data (OpenAI allows 10).
MAX_SCHEMA_DEPTH = 128


def _depth(doc) -> int:
    deepest, todo = 0, [(doc, 1)]
    while todo:
        node, d = todo.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, d)
            todo.extend((v, d + 1) for v in (node.values() if isinstance(node, dict) else node))
    return deepest


def json_schema_ebnf(schema: str) -> str:
    """The EBNF of a JSON schema (compact: no free whitespace), as xgrammar writes it, mended."""
    import xgrammar as xgr

    try:
        doc = json.loads(schema)
        depth = _depth(doc)
    except RecursionError:  # deeper than Python's decoder follows
        depth = None
    except ValueError:  # not JSON: xgrammar's own error says so
        doc, depth = None, 0
    if depth is None or depth > MAX_SCHEMA_DEPTH:
        raise InvalidRequestError(f"the json schema is nested {depth or 'thousands of'} levels deep; at most "
                                  f"{MAX_SCHEMA_DEPTH} are compiled", param="response_format")
    why = unenforced(doc)
    if why is not None:  # compiled, it would be dropped from the grammar: output breaking the schema
        raise Unenforced(f"the json schema cannot be enforced: {why}", param="response_format")
    # (compact as llguidance's: xgrammar's own separators are ", " and ": ")
    return str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=(",", ":"))).replace(
        _BOUNDED_CHAR, _JSON_CHAR)
