"""Typing parameter values by the tool's JSON schema, for formats that write every value as text.

GLM, MiniMax-M2, Seed-OSS and Qwen3 XML write ``<parameter=p>5</parameter>``: the model's text says nothing
about whether ``5`` is a number or a string, so the declared schema decides. ``param_types`` reads the set of
JSON types a property allows from ``type`` (a name or a list), ``nullable``, ``enum``/``const`` values,
``anyOf``/``oneOf``/``allOf`` branches (what Pydantic writes for ``Optional[int]`` or ``int | str``) and the
shape keywords (``properties`` -> object, ``items`` -> array); ``convert`` then tries the allowed types from
the most specific to the least and keeps the raw text when none fits, so a value is never lost.

A property whose only type is ``string`` streams as it arrives; anything else is held until its end tag and
converted whole (``streams_as_string``).
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Callable, Iterator
from typing import Any

_TYPE_ALIASES = {
    "str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string",
    "int": "integer", "long": "integer", "short": "integer", "uint": "integer", "unsigned": "integer",
    "float": "number", "double": "number", "num": "number", "decimal": "number",
    "bool": "boolean", "binary": "boolean",
    "dict": "object", "map": "object", "list": "array", "tuple": "array", "arr": "array",
    "none": "null", "nil": "null",
}
_KNOWN = frozenset({"string", "integer", "number", "boolean", "object", "array", "null"})
# Tried in this order: the most specific reading of the text wins, a string is the fallback.
_ORDER = ("null", "integer", "number", "boolean", "object", "array", "string")
_NULL_WORDS = frozenset({"null", "none", "nil"})
_MAX_DEPTH = 16


def _normal_type(name: Any) -> str | None:
    if not isinstance(name, str):
        return None
    t = name.strip().lower()
    if t in _KNOWN:
        return t
    if t in _TYPE_ALIASES:
        return _TYPE_ALIASES[t]
    for prefix, canonical in (("int", "integer"), ("uint", "integer"), ("num", "number"), ("float", "number"),
                              ("dict", "object"), ("list", "array")):
        if t.startswith(prefix):
            return canonical
    return None


def _value_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def schema_types(schema: Any, depth: int = 0) -> frozenset[str]:
    """The JSON types ``schema`` allows; empty when it says nothing (no type, any value)."""
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return frozenset()
    types: set[str] = set()
    declared = schema.get("type")
    for name in declared if isinstance(declared, list) else [declared]:
        t = _normal_type(name)
        if t is not None:
            types.add(t)
    if schema.get("nullable") is True:
        types.add("null")
    if isinstance(schema.get("enum"), list):
        types.update(_value_type(v) for v in schema["enum"])
    if "const" in schema:
        types.add(_value_type(schema["const"]))
    for key in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(key)
        if isinstance(branches, list):
            for branch in branches:
                types |= schema_types(branch, depth + 1)
    if not types - {"null"}:
        if isinstance(schema.get("properties"), dict):
            types.add("object")
        elif "items" in schema:
            types.add("array")
    return frozenset(types)


def param_types(parameters: Any, param: str) -> frozenset[str] | None:
    """The types parameter ``param`` of a tool allows; None when the tool does not declare it."""
    if not isinstance(parameters, dict):
        return None
    props = parameters.get("properties")
    if not isinstance(props, dict) or param not in props:
        return None
    return schema_types(props[param])


def streams_as_string(types: frozenset[str] | None) -> bool:
    return types == frozenset({"string"})


def _as_int(text: str) -> Any:
    try:
        return int(text)
    except ValueError:
        pass
    number = _as_number(text)
    if isinstance(number, int):
        return number
    raise ValueError(text)


def _as_number(text: str) -> Any:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(text)  # 1e999 would serialise as Infinity, which is not JSON
    if number.is_integer() and abs(number) < 2**63:
        return int(number)  # upstream's rule: an integral number is an int
    return number


def _as_bool(text: str) -> bool:
    word = text.lower()
    if word == "true":
        return True
    if word == "false":
        return False
    raise ValueError(text)


def json_safe(value: Any, depth: int = 0) -> bool:
    """True when json.dumps gives strict JSON (no NaN/Infinity), so arguments always parse."""
    if isinstance(value, float):
        return math.isfinite(value)
    if depth > 64:
        return False
    if isinstance(value, dict):
        return all(isinstance(k, str) and json_safe(v, depth + 1) for k, v in value.items())
    if isinstance(value, (list, tuple)):  # a Python literal's tuple serialises as a JSON array
        return all(json_safe(v, depth + 1) for v in value)
    return value is None or isinstance(value, (str, int, bool))


_PARSE_ERRORS = (ValueError, SyntaxError, TypeError, MemoryError, RecursionError)


def _decoded(text: str) -> Iterator[Any]:
    """``text`` as JSON, then as a Python literal (what models write: single quotes, True)."""
    for parse in (json.loads, ast.literal_eval):
        try:
            yield parse(text)
        except _PARSE_ERRORS:
            continue


def _literals(text: str) -> Iterator[Any]:
    """What ``text`` reads as; a string holding a value (``"{\"a\": 1}"``, or a Python repr inside a JSON
    string, ``"{'a': 1}"``) is decoded once more, as vLLM's XML parsers do."""
    for value in _decoded(text):
        if isinstance(value, str):
            for inner in _decoded(value):
                if not isinstance(inner, str):
                    yield list(inner) if isinstance(inner, tuple) else inner
            continue
        yield list(value) if isinstance(value, tuple) else value


def _as_structured(text: str, want: type) -> Any:
    for value in _literals(text):
        if isinstance(value, want) and json_safe(value):
            return value
    raise ValueError(text)


_CONVERTERS: dict[str, Callable[[str], Any]] = {
    "integer": _as_int,
    "number": _as_number,
    "boolean": _as_bool,
    "object": lambda text: _as_structured(text, dict),
    "array": lambda text: _as_structured(text, list),
}


def convert(text: str, types: frozenset[str] | None, undeclared: str = "string") -> Any:
    """``text`` as the first of ``types`` it reads as; the raw text when none fits.

    ``undeclared`` says what a parameter the schema does not declare (or declares without a type) becomes:
    ``"string"`` (the raw text) or ``"json"`` (JSON / Python literal if it parses, else the raw text; GLM's
    upstream rule).
    """
    if not types:
        if undeclared == "json":
            return _any_literal(text)
        return text
    stripped = text.strip()
    for t in _ORDER:
        if t not in types:
            continue
        if t == "string":
            return text
        if t == "null":
            if stripped.lower() in _NULL_WORDS:
                return None
            continue
        try:
            return _CONVERTERS[t](stripped)
        except (ValueError, OverflowError):
            continue
    return text


def _any_literal(text: str) -> Any:
    for value in _literals(text.strip()):
        if json_safe(value):
            return value
    return text
