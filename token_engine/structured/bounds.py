"""Cheap checks that bound a grammar compile's work before it starts.

xgrammar's compile time grows much faster than the text it is given in a few places: a 60-byte schema
`{"type":"string","pattern":"[a-z]{40000}"}` compiles for minutes (a pattern repeat of 2000 takes about 1 s,
4000 about 5 s, 8000 about 22 s), and so does an object with a few hundred optional properties (200: 2 s).
These checks refuse such specs in microseconds, each with a 400 that names the limit; the compile worker's
time limit (compiler.py) stays the guarantee for whatever slips past them.

Counted: the spec's size in bytes; JSON nesting depth; properties per object and in all; enum, const and
choice values; and in every regex (the `regex` kind, schema `pattern`s and `patternProperties`) and EBNF
grammar: group nesting depth, each `{m,n}` repeat times the repeats of the groups around it (`(a{100}){100}`
is 10000), and the items all repeats add up to.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from token_engine.structured.spec import MAX_JSON_DEPTH, GuideSpec, check_json_depth, refuse_over_limit


@dataclass(frozen=True)
class CompileLimits:
    max_spec_bytes: int = 512 << 10  # schema / regex / grammar / choice text (a large tool set is ~100 KB)
    max_regex_bytes: int = 64 << 10  # each regex: the `regex` kind, every schema pattern
    max_nesting_depth: int = MAX_JSON_DEPTH  # JSON containers; regex and EBNF groups
    max_repetition: int = 1000  # one {m,n} repeat times the repeats around it
    max_repeated_items: int = 16384  # what all repeats of a regex or grammar add up to
    max_properties_per_object: int = 256
    max_properties: int = 4096  # in the whole spec
    max_enum_values: int = 4096  # enum entries + consts + choices, in the whole spec


DEFAULT_LIMITS = CompileLimits()


def check_bounds(spec: GuideSpec, limits: CompileLimits = DEFAULT_LIMITS) -> None:
    """GrammarError (a 400 naming the limit) when compiling spec could take unbounded work."""
    size = len(spec.value.encode())
    if size > limits.max_spec_bytes:
        raise refuse_over_limit(spec.kind, "the size in bytes", size, limits.max_spec_bytes, "max_spec_bytes")
    if spec.kind == "regex":
        _check_repeats(spec.value, "regex", limits, _REGEX_TOKENS)
    elif spec.kind == "grammar":
        _check_repeats(spec.value, "grammar", limits, _EBNF_TOKENS)
    elif spec.kind == "choice":
        count = len(json.loads(spec.value))
        if count > limits.max_enum_values:
            raise refuse_over_limit("choice", "the number of choices", count, limits.max_enum_values, "max_enum_values")
    elif spec.kind in ("json", "structural_tag"):
        _check_json_spec(json.loads(spec.value), spec.kind, limits)


def _check_json_spec(root, kind: str, limits: CompileLimits) -> None:
    check_json_depth(root, limits.max_nesting_depth, kind)
    properties = values = 0
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        stack.extend(node.values())
        props = node.get("properties")
        if isinstance(props, dict):
            if len(props) > limits.max_properties_per_object:
                raise refuse_over_limit(kind, "the number of properties of one object", len(props),
                              limits.max_properties_per_object, "max_properties_per_object")
            properties += len(props)
        enum = node.get("enum")
        values += (len(enum) if isinstance(enum, list) else 0) + ("const" in node)
        pattern = node.get("pattern")
        if isinstance(pattern, str):  # a schema's pattern, or a structural tag's {"type": "regex", ...}
            _check_repeats(pattern, kind, limits, _REGEX_TOKENS)
        pattern_props = node.get("patternProperties")
        if isinstance(pattern_props, dict):
            for key in pattern_props:
                _check_repeats(key, kind, limits, _REGEX_TOKENS)
        grammar = node.get("grammar")
        if node.get("type") == "grammar" and isinstance(grammar, str):  # structural tag grammar items
            _check_repeats(grammar, kind, limits, _EBNF_TOKENS)
    if properties > limits.max_properties:
        raise refuse_over_limit(kind, "the number of properties", properties, limits.max_properties, "max_properties")
    if values > limits.max_enum_values:
        raise refuse_over_limit(kind, "the number of enum and const values", values, limits.max_enum_values,
                      "max_enum_values")


# ---- repeats in regexes and EBNF ------------------------------------------------------------------------
# Both are read as a stream of tokens: "(" and ")" open and close a group, a repeat repeats the item before
# it n times (n = the upper bound, or the lower one when unbounded), and anything else is items.
# `*`, `+`, `?`, `|` cost nothing extra.

_REPEAT = r"\{\s*(?P<lo>\d*)\s*(?:(?P<comma>,)\s*(?P<hi>\d*)\s*)?\}"
_CLASS = r"\[\^?\]?(?:\\.|[^\]\\])*\]?"
# Only what matters is matched (in C): groups, repeats, and the escapes, classes, strings and comments that
# could hide a "(" or "{"; the plain text between two matches counts as that many items.
_REGEX_TOKENS = re.compile(rf"(?P<rep>{_REPEAT})|(?P<open>\()|(?P<close>\))|(?P<item>\\.|{_CLASS})", re.S)
_EBNF_TOKENS = re.compile(
    rf"(?P<rep>{_REPEAT})|(?P<open>\()|(?P<close>\))|(?P<item>\"(?:\\.|[^\"\\])*\"?|{_CLASS})|(?P<skip>#[^\n]*)",
    re.S)


def _tokens(text: str, pattern: re.Pattern):
    """("open"|"close"|"rep"|"item", how many) per token of text."""
    end = 0
    for m in pattern.finditer(text):
        if m.start() > end:
            yield "item", m.start() - end
        end = m.end()
        kind = m.lastgroup
        if kind == "rep":
            lo, hi = m.group("lo"), m.group("hi")
            if not lo and not hi:
                yield "item", 1  # `{}` or `{,}`: not a repeat
                continue
            # xgrammar expands `{m,}` into m copies and a star; over 9 digits is over every limit anyway
            yield "rep", int((hi or lo)[:10])
        elif kind != "skip":
            yield kind, 1
    if len(text) > end:
        yield "item", len(text) - end


def _check_repeats(text: str, kind: str, limits: CompileLimits, pattern: re.Pattern) -> None:
    if pattern is _REGEX_TOKENS and len(text) > limits.max_regex_bytes:
        raise refuse_over_limit(kind, "the size of a regex in characters", len(text), limits.max_regex_bytes,
                      "max_regex_bytes")
    # Per open group: [items so far, largest repeat product inside, the last item's (items, product)].
    groups: list[list] = [[0, 1, None]]
    extra = 0  # items that repeats add, in all
    for tok, count in _tokens(text, pattern):
        top = groups[-1]
        if tok == "open":
            if len(groups) > limits.max_nesting_depth:
                raise refuse_over_limit(kind, "the group nesting depth", len(groups), limits.max_nesting_depth,
                              "max_nesting_depth")
            groups.append([0, 1, None])
        elif tok == "close":
            if len(groups) == 1:
                continue  # unbalanced: the library says so
            inner = groups.pop()
            groups[-1][2] = (max(inner[0], 1), inner[1])
            groups[-1][0] += max(inner[0], 1)
            groups[-1][1] = max(groups[-1][1], inner[1])
        elif tok == "rep":
            if top[2] is None:
                continue  # a repeat of nothing: the library says so
            items, product = top[2]
            product *= max(count, 1)
            if product > limits.max_repetition:
                what = "a repeat count" if product == count else "a repeat count times the repeats around it"
                raise refuse_over_limit(kind, what, product, limits.max_repetition, "max_repetition")
            extra += items * max(count - 1, 0)
            top[0] += items * max(count - 1, 0)
            top[1] = max(top[1], product)
            top[2] = (items * max(count, 1), product)  # `a{2}{3}`: the second repeat multiplies the first
            if extra > limits.max_repeated_items:
                raise refuse_over_limit(kind, "the number of items repeats add", extra, limits.max_repeated_items,
                              "max_repeated_items")
        else:  # items; a repeat after a run of characters repeats its last one
            top[0] += count
            top[2] = (1, 1)
