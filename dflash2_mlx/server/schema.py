"""JSON Schema checks of a strict tool's call (`strict: true`): the arguments the model generated, parsed as JSON,
must match the tool's `parameters`. No constrained decoder runs: the text is the model's, checked once a call is
whole, before it is sent.

The keywords checked are those OpenAI's strict mode takes and a few more: `type`, `enum`, `const`, `properties`,
`required`, `additionalProperties`, `items`, `prefixItems`, `anyOf`, `oneOf`, `allOf`, `not`, `$ref` (to the
schema's own `$defs`/`definitions`, or `#`), `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum`,
`multipleOf`, `minLength`, `maxLength`, `pattern`, `minItems`, `maxItems`, `uniqueItems`, `minProperties`,
`maxProperties`. Annotations (`ANNOTATIONS`: `description`, `title`, `default`, `format`, ...) assert nothing, as in
JSON Schema 2020-12, where `format` is an annotation unless a validator opts in. A strict tool whose schema uses
another keyword is refused when the request comes (`check_schema`): it could not be checked.
"""

from __future__ import annotations

import json
import math
import re

ANNOTATIONS = {
    "$schema",
    "$id",
    "$comment",
    "$anchor",
    "title",
    "description",
    "default",
    "examples",
    "deprecated",
    "readOnly",
    "writeOnly",
    "format",
    "discriminator",
    "$defs",
    "definitions",
    "contentEncoding",
    "contentMediaType",
}
SUBSCHEMA = {"items", "not"}  # keywords whose value is one schema
SUBSCHEMA_LISTS = {"anyOf", "oneOf", "allOf", "prefixItems"}
CHECKED = {
    *SUBSCHEMA,
    *SUBSCHEMA_LISTS,
    "type",
    "enum",
    "const",
    "properties",
    "required",
    "additionalProperties",
    "$ref",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "uniqueItems",
    "minProperties",
    "maxProperties",
}
TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
}


def check_schema(schema, where: str = "parameters") -> None:
    """Raise ValueError naming the first part of `schema` that cannot be checked (a keyword not in `CHECKED` or
    `ANNOTATIONS`, a type not JSON's, a pattern that does not compile, a `$ref` outside the schema)."""
    _check(schema, where, schema)


def _check(schema, where: str, root) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON schema (an object)")
    for key, value in schema.items():
        at = f"{where}.{key}"
        if key not in CHECKED and key not in ANNOTATIONS:
            raise ValueError(f"{at}: the keyword {key!r} is not one this server checks")
        if key in SUBSCHEMA or key == "additionalProperties":
            _check(value, at, root)
        elif key in SUBSCHEMA_LISTS:
            if not isinstance(value, list):
                raise ValueError(f"{at} must be a list of schemas")
            for i, sub in enumerate(value):
                _check(sub, f"{at}[{i}]", root)
        elif key in ("properties", "$defs", "definitions"):
            if not isinstance(value, dict):
                raise ValueError(f"{at} must be an object of schemas")
            for name, sub in value.items():
                _check(sub, f"{at}.{name}", root)
        elif key == "type":
            kinds = value if isinstance(value, list) else [value]
            if not kinds or not all(k in TYPES for k in kinds):
                raise ValueError(f"{at} must be one of {', '.join(TYPES)} or a list of them")
        elif key == "pattern":
            try:
                re.compile(value)
            except (re.error, TypeError) as e:
                raise ValueError(f"{at} is not a regular expression ({e})") from None
        elif key == "$ref":
            _resolve(root, value, at)


def _resolve(root, ref, where: str):
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        raise ValueError(f"{where}: only references within the schema ('#', '#/$defs/...') are followed")
    node = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            raise ValueError(f"{where}: {ref!r} names nothing in the schema")
        node = node[part]
    return node


def violation(value, schema, root=None, where: str = "arguments") -> str | None:
    """The first way `value` (decoded JSON) breaks `schema` (one `check_schema` passed), as a sentence naming
    where; None when it matches."""
    root = schema if root is None else root
    if schema is True:
        return None
    if schema is False:
        return f"{where} is not allowed"
    if "$ref" in schema:
        found = violation(value, _resolve(root, schema["$ref"], where), root, where)
        if found:
            return found
    kinds = schema.get("type")
    if kinds is not None:
        kinds = kinds if isinstance(kinds, list) else [kinds]
        if not any(TYPES[k](value) for k in kinds):
            return f"{where} must be {' or '.join(kinds)}, got {json.dumps(value)}"
    if "enum" in schema and not any(_equal(value, v) for v in schema["enum"]):
        return f"{where} must be one of {json.dumps(schema['enum'])}, got {json.dumps(value)}"
    if "const" in schema and not _equal(value, schema["const"]):
        return f"{where} must be {json.dumps(schema['const'])}, got {json.dumps(value)}"
    for check in (_combined, _number, _string, _array, _object):
        found = check(value, schema, root, where)
        if found:
            return found
    return None


def _equal(a, b) -> bool:
    return type(a) is type(b) and a == b if isinstance(a, bool) or isinstance(b, bool) else a == b


def _combined(value, schema, root, where: str) -> str | None:
    for sub in schema.get("allOf", []):
        found = violation(value, sub, root, where)
        if found:
            return found
    if "anyOf" in schema and all(violation(value, sub, root, where) for sub in schema["anyOf"]):
        return f"{where} matches none of the schemas of anyOf"
    if "oneOf" in schema:
        matched = sum(violation(value, sub, root, where) is None for sub in schema["oneOf"])
        if matched != 1:
            return f"{where} matches {matched} of the schemas of oneOf, not exactly one"
    if "not" in schema and violation(value, schema["not"], root, where) is None:
        return f"{where} matches the schema of 'not'"
    return None


def _number(value, schema, root, where: str) -> str | None:
    if not TYPES["number"](value):
        return None
    bounds = {
        "minimum": lambda v, b: v >= b,
        "maximum": lambda v, b: v <= b,
        "exclusiveMinimum": lambda v, b: v > b,
        "exclusiveMaximum": lambda v, b: v < b,
    }
    for key, holds in bounds.items():
        if key in schema and not holds(value, schema[key]):
            return f"{where} must meet {key} {schema[key]}, got {json.dumps(value)}"
    step = schema.get("multipleOf")
    if step is not None and not math.isclose(value / step, round(value / step), rel_tol=0, abs_tol=1e-9):
        return f"{where} must be a multiple of {step}, got {json.dumps(value)}"
    return None


def _string(value, schema, root, where: str) -> str | None:
    if not isinstance(value, str):
        return None
    if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", math.inf):
        return f"{where} has {len(value)} characters, outside minLength/maxLength"
    if "pattern" in schema and re.search(schema["pattern"], value) is None:
        return f"{where} does not match the pattern {schema['pattern']!r}, got {json.dumps(value)}"
    return None


def _array(value, schema, root, where: str) -> str | None:
    if not isinstance(value, list):
        return None
    if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", math.inf):
        return f"{where} has {len(value)} items, outside minItems/maxItems"
    if schema.get("uniqueItems") and any(_equal(a, b) for i, a in enumerate(value) for b in value[i + 1 :]):
        return f"{where} must have unique items"
    prefix = schema.get("prefixItems", [])
    for i, item in enumerate(value):
        sub = prefix[i] if i < len(prefix) else schema.get("items", True)
        found = violation(item, sub, root, f"{where}[{i}]")
        if found:
            return found
    return None


def _object(value, schema, root, where: str) -> str | None:
    if not isinstance(value, dict):
        return None
    missing = [name for name in schema.get("required", []) if name not in value]
    if missing:
        return f"{where} lacks the required {', '.join(map(repr, missing))}"
    if not schema.get("minProperties", 0) <= len(value) <= schema.get("maxProperties", math.inf):
        return f"{where} has {len(value)} properties, outside minProperties/maxProperties"
    properties, extra = schema.get("properties", {}), schema.get("additionalProperties", True)
    for name, item in value.items():
        sub = properties.get(name, extra)
        if sub is False:
            return f"{where} has {name!r}, which the schema does not allow (additionalProperties false)"
        found = violation(item, sub, root, f"{where}.{name}")
        if found:
            return found
    return None
