"""The `structured_outputs` sampling parameter (vLLM's StructuredOutputsParams) read into a GuideSpec.

Only the shape is checked here (exactly one constraint, the right types); whether a schema, regex or
grammar is valid is the grammar library's call at compile time. Both raise GrammarError, a 400.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

PARAM = "sampling_params.structured_outputs"
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# JSON nesting, checked while a spec is read (before any recursive JSON code runs on it) and by bounds.py
MAX_JSON_DEPTH = 64
OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern", "disable_fallback")


class GrammarError(ValueError):
    """A structured-outputs request the engine cannot honour: the client's (400), or a cap the client hit
    (429) or a shutdown (503) in the subclasses of pool.py."""

    status = 400

    def __init__(self, message: str, param: str | None = PARAM):
        super().__init__(message)
        self.message = message
        self.param = param


def refuse_over_limit(spec_kind: str, what: str, value: int, limit: int, name: str) -> GrammarError:
    return GrammarError(f"structured_outputs.{spec_kind}: {what} is {value}, over the engine's limit of {limit} "
                        f"({name}); simplify the constraint.")


def check_json_depth(value, limit: int = MAX_JSON_DEPTH, what: str = "json") -> None:
    """GrammarError when value (decoded JSON) nests deeper than limit. Iterative: safe on any depth."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Iterable = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > limit:
            raise refuse_over_limit(what, "the JSON nesting depth", depth, limit, "max_nesting_depth")
        stack.extend((child, depth + 1) for child in children)


@dataclass(frozen=True)
class GuideSpec:
    """One constraint in a canonical, hashable form: the key of the compiled-grammar cache."""

    kind: str  # one of KINDS
    value: str  # schema JSON (compact), regex, grammar text, choices as a JSON list, structural tag JSON
    any_whitespace: bool = True  # False: disable_any_whitespace (JSON kinds only)


def _canonical_json(value, what: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except RecursionError:
            raise GrammarError(f"structured_outputs.{what} nests deeper than {MAX_JSON_DEPTH} levels "
                               "(max_nesting_depth).") from None
        except ValueError as exc:
            raise GrammarError(f"structured_outputs.{what} is not valid JSON: {exc}") from None
    if not isinstance(value, (dict, bool)):
        raise GrammarError(f"structured_outputs.{what} must be a JSON object (or its JSON text).")
    check_json_depth(value, MAX_JSON_DEPTH, what)  # before json.dumps, which recurses
    # Key order is kept: properties are generated in the order the schema lists them.
    return json.dumps(value, separators=(",", ":"))


def parse_structured_outputs(raw: dict) -> GuideSpec:
    """GuideSpec for a request's `structured_outputs` object, or GrammarError."""
    if not isinstance(raw, dict):
        raise GrammarError("structured_outputs must be an object.")
    # vLLM serializes every field of its dataclass, private ones too; a newer vLLM may add fields. An unknown
    # key left at an empty default asks for nothing; one that is set asks for something we cannot do.
    unknown = sorted(k for k in raw if k not in KINDS and k not in OPTIONS and not k.startswith("_")
                     and raw[k] not in (None, False, "", [], {}))
    if unknown:
        raise GrammarError(f"structured_outputs has unknown keys: {', '.join(unknown)}.")
    # json_object: false counts as unset, as vLLM's "is not None" test would not, but false asks for nothing.
    given = [k for k in KINDS if raw.get(k) is not None and raw.get(k) is not False]
    if len(given) != 1:
        raise GrammarError("structured_outputs must set exactly one of json, json_object, regex, choice, grammar, "
                           f"structural_tag; got {', '.join(given) or 'none'}.")
    if raw.get("whitespace_pattern") is not None:
        raise GrammarError("structured_outputs.whitespace_pattern is not supported by the xgrammar backend.")
    for flag in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
        if not isinstance(raw.get(flag, False), bool):
            raise GrammarError(f"structured_outputs.{flag} must be a boolean.")
    kind = given[0]
    value = raw[kind]
    if kind == "json":
        text = _canonical_json(value, "json")
    elif kind == "json_object":
        if value is not True:
            raise GrammarError("structured_outputs.json_object must be true.")
        text = ""
    elif kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise GrammarError(f"structured_outputs.{kind} must be a non-empty string.")
        text = value
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise GrammarError("structured_outputs.choice must be a non-empty list of strings.")
        text = json.dumps(value)
    else:  # structural_tag
        text = _canonical_json(value, "structural_tag")
    return GuideSpec(kind, text, any_whitespace=not raw.get("disable_any_whitespace", False))
