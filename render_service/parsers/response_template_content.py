"""How a response template's region text becomes a value: the content parsers (``json`` with its dialect knobs,
``xml-inline``, ``kv-lines``, the scalar ones), the ``transform`` that reshapes the value with the opener's named
captures, and the tools' schemas that type string arguments. The rules are upstream's (Hugging Face's response
parsing, as vLLM 0.34 vendors it); a region's value is read once, when it closes."""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

_LAX_OPEN, _LAX_CLOSE = "\x01", "\x02"  # stand-ins for pre-extracted strings; never in model text
_PLACEHOLDER = re.compile(r"\{(\w+(?:\.\w+)*)\}")


class RegionField(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def content(self) -> str: ...

    @property
    def content_args(self) -> dict[str, Any]: ...

    @property
    def transform(self) -> Any: ...

    @property
    def transform_each(self) -> bool: ...


def _text(text: str, args: dict[str, Any]) -> str:
    return text.strip() if args.get("strip", True) else text


def _json(text: str, args: dict[str, Any]) -> Any:
    delims = args.get("string_delims", [])
    if delims and (_LAX_OPEN in text or _LAX_CLOSE in text):
        raise ValueError("json: the text holds the reserved stand-in characters")
    captured: list[str] = []
    working = text

    def stash(m: re.Match[str]) -> str:
        captured.append(m.group(1))
        return f"{_LAX_OPEN}{len(captured) - 1}{_LAX_CLOSE}"

    for open_d, close_d in delims:
        working = re.sub(re.escape(open_d) + r"(.*?)" + re.escape(close_d), stash, working, flags=re.DOTALL)
    if args.get("unquoted_keys", False):
        working = re.sub(r"(?<=[{,])(\w+):", r'"\1":', working)
    for i, s in enumerate(captured):
        working = working.replace(f"{_LAX_OPEN}{i}{_LAX_CLOSE}", json.dumps(s))
    try:
        return json.loads(working)
    except json.JSONDecodeError:
        if args.get("allow_non_json"):
            return _text(text, args)
        raise ValueError("json: the region is not JSON") from None


def _sub_parse(raw: str, value_parser: dict[str, Any] | None) -> Any:
    if value_parser is None:
        return raw
    return parse_content(raw, value_parser.get("name", "text"), value_parser.get("args", {}))


def _xml_inline(text: str, args: dict[str, Any]) -> dict[str, Any]:
    pattern = args.get("tag_pattern")
    if pattern is None:
        raise ValueError("xml-inline: tag_pattern is required")
    out: dict[str, Any] = {}
    for m in re.finditer(pattern, text, flags=re.DOTALL):
        groups = m.groupdict()
        key = groups.get("key")
        if key is None:
            raise ValueError("xml-inline: tag_pattern needs a group named key")
        value = _sub_parse(groups.get("value") or "", args.get("value_parser"))
        if key in out and args.get("merge_duplicates", False):
            if not isinstance(out[key], list):
                out[key] = [out[key]]
            out[key].append(value)
        else:
            out[key] = value
    return out


def _kv_lines(text: str, args: dict[str, Any]) -> dict[str, Any]:
    kv_sep = args.get("kv_sep", ":")
    out: dict[str, Any] = {}
    for line in text.split(args.get("line_sep", "\n")):
        line = _text(line, args)
        if not line or kv_sep not in line:
            continue
        k, v = line.split(kv_sep, 1)
        out[_text(k, args)] = _sub_parse(_text(v, args), args.get("value_parser"))
    return out


_PARSERS = {
    "text": _text,
    "int": lambda t, a: int(_text(t, a)),
    "float": lambda t, a: float(_text(t, a)),
    "bool": lambda t, a: _text(t, a).lower() in ("true", "1"),
    "json": _json,
    "xml-inline": _xml_inline,
    "kv-lines": _kv_lines,
}


def parse_content(text: str, name: str, args: dict[str, Any]) -> Any:
    return _PARSERS[name](text, args)


def _apply(transform: Any, scope: dict[str, Any]) -> Any:
    if isinstance(transform, dict):
        return {k: _apply(v, scope) for k, v in transform.items()}
    if isinstance(transform, list):
        return [_apply(v, scope) for v in transform]
    whole = _PLACEHOLDER.fullmatch(transform) if isinstance(transform, str) else None
    if whole is None:
        return transform
    root, *keys = whole.group(1).split(".")
    value = scope[root]  # KeyError: a placeholder the region did not define
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            raise ValueError(f"transform placeholder {whole.group(0)!r} has no {key!r}")
        value = value[key]
    return value


def parse_region(body: str, field: RegionField, captures: dict[str, str]) -> Any:
    """The region's value: its content parser, then its transform (per element with ``transform_each``)."""
    value = parse_content(body, field.content, field.content_args)
    if field.transform is None:
        return value
    if field.transform_each:
        if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
            raise ValueError(f"field {field.name!r}: transform_each needs a list of objects")
        return [_apply(field.transform, {**captures, **item}) for item in value]
    return _apply(field.transform, {**captures, "content": value})


def _schema_types(schema: Any) -> tuple[str, ...]:
    if not isinstance(schema, dict):
        return ()
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else []
    if isinstance(declared, list):
        types.extend(t for t in declared if isinstance(t, str))
    for union in ("anyOf", "oneOf"):
        for choice in schema.get(union) or []:
            types.extend(_schema_types(choice))
    if schema.get("nullable") and "null" not in types:
        types.append("null")
    return tuple(types)


def _coerce(raw: str, types: tuple[str, ...]) -> Any:
    for type_name in types:
        try:
            if type_name == "integer":
                try:
                    return int(raw)
                except ValueError:
                    number = float(raw)
                    if number.is_integer():
                        return int(number)
                    continue
            if type_name == "number":
                number = float(raw)
                if number != number or number in (float("inf"), float("-inf")):
                    continue
                return int(number) if number.is_integer() and "." not in raw else number
            if type_name == "boolean" and raw.strip().lower() in ("true", "1", "false", "0"):
                return raw.strip().lower() in ("true", "1")
            if type_name == "null" and raw.strip() in ("null", "None"):
                return None
            if type_name in ("object", "array"):
                decoded = json.loads(raw)
                if isinstance(decoded, dict if type_name == "object" else list):
                    return decoded
        except ValueError:
            continue
    return raw  # strings, unknown types and failed casts keep the text


def coerce_arguments(arguments: dict[str, Any], parameters: dict[str, Any] | None) -> dict[str, Any]:
    """String arguments typed by the tool's declared parameters (upstream types them the same way)."""
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    if not isinstance(properties, dict) or not properties:
        return arguments
    out = dict(arguments)
    for key, value in arguments.items():
        types = _schema_types(properties.get(key))
        if not types:
            continue
        if isinstance(value, str):
            out[key] = _coerce(value, types)
        elif isinstance(value, list) and "array" not in types:
            out[key] = [_coerce(v, types) if isinstance(v, str) else v for v in value]
    return out
