"""tool_choice: vLLM's rules for the request field, read once for render and derender (same errors), and the
constraint render puts on the output for it.

The constraint follows vLLM 0.32/0.33 per tool parser (tests/test_tool_constraint_parity.py holds it to what
their render servers answer). Parsers whose family has a structural tag (structural_tags.py: hermes, the Qwen3
XML, Llama JSON, DeepSeek, Kimi, GLM and MiniMax families) constrain a forced call to the model's own call
syntax, and an "auto" one once a tool is strict; mistral to its ``[{"name", "arguments"}]`` array; the others
to vLLM's JSON (a bare array of ``{"name", "parameters"}`` for "required", the tool's arguments object when
named). gpt-oss's Harmony render builds its own (render_service/harmony/).
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

from render_service.http.errors import bad_request
from render_service.parsers.pipeline import ToolChoiceMode
from render_service.render.render_config import TOOL_STRICT_LEVELS
from render_service.render.structural_tags import (
    FAMILIES,
    TagChoice,
    TagTool,
    const,
    grammar,
    json_schema,
    one_call_only,
    one_of,
    regex,
    structural_tag_text,
    tag,
    triggered,
)
from render_service.wire.protocol import ChatCompletionRequest

NAMED: Final = "named"
_STRING_MODES: dict[str, ToolChoiceMode] = {"auto": "auto", "none": "none", "required": "required"}


def parse_tool_choice(req: ChatCompletionRequest) -> tuple[ToolChoiceMode, str | None]:
    """("none" | "auto" | "required" | "named", the named function); 400 for a malformed choice.

    No choice means "auto" when tools are given, else "none"."""
    choice = req.tool_choice
    if choice is None:
        return ("auto" if req.tools else "none"), None
    if isinstance(choice, str):
        mode = _STRING_MODES.get(choice)
        if mode is None:
            raise bad_request(f"Invalid tool_choice {choice!r}", "tool_choice")
        return mode, None
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise bad_request("tool_choice must name a function: {'type': 'function', 'function': {'name': ...}}",
                          "tool_choice")
    return NAMED, name


def forces_a_call(req: ChatCompletionRequest) -> bool:
    """Named or "required" tool choice: render constrained the output to a call, so derender parses it even
    without a --tool-call-parser, and an empty content is "" rather than null (vLLM)."""
    return req.tool_choice == "required" or isinstance(req.tool_choice, dict)


def check_render_tool_choice(req: ChatCompletionRequest, auto_tool_choice: bool) -> tuple[ToolChoiceMode, str | None]:
    """The effective tool_choice at render, where vLLM also refuses what the server or tools cannot honour.

    ``auto_tool_choice``: --enable-auto-tool-choice together with a --tool-call-parser."""
    choice, name = parse_tool_choice(req)
    if choice == "auto" and req.tools and not auto_tool_choice:
        raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
    if choice == "required" and not req.tools:
        raise bad_request('When using `tool_choice` "required", `tools` must be set.', "tool_choice")
    if choice == NAMED and not any(_function(t).get("name") == name for t in req.tools or []):
        raise bad_request(f"Tool '{name}' has not been passed in `tools`.", "tool_choice")
    return choice, name


def tool_choice_structured_outputs(tools: list[dict[str, Any]] | None, choice: str, name: str | None,
                                   parallel_tool_calls: bool | None = None) -> dict[str, Any] | None:
    """Named and "required" tool choice as vLLM's JSON: the named tool's arguments object, or an array of
    ``{"name", "parameters"}`` (one at most with ``parallel_tool_calls: false``)."""
    if choice == NAMED:
        tool = next(t for t in tools or [] if _function(t).get("name") == name)
        return {"json": _function(tool).get("parameters") or {"type": "object", "properties": {}}}
    if choice == "required":
        variants = []
        for tool in tools or []:
            fn = _function(tool)
            variants.append({
                "properties": {
                    "name": {"type": "string", "enum": [fn.get("name")]},
                    "parameters": fn.get("parameters") or {"type": "object", "properties": {}},
                },
                "required": ["name", "parameters"],
            })
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return {"json": schema}
    return None


def mistral_structured_outputs(tools: list[dict[str, Any]] | None, choice: str,
                               name: str | None) -> dict[str, Any] | None:
    """vLLM's mistral parser over a Hugging Face tokenizer: a forced call is Mistral's own array of
    ``{"name", "arguments"}`` (one for a named tool)."""
    if choice not in (NAMED, "required"):
        return None
    chosen = [t for t in tools or [] if choice == "required" or _function(t).get("name") == name]
    variants = [{"type": "object", "properties": {
        "name": {"type": "string", "enum": [_function(t).get("name")]},
        "arguments": _function(t).get("parameters") or {"type": "object"}}, "required": ["name", "arguments"]}
        for t in chosen]
    schema: dict[str, Any] = {"type": "array", "minItems": 1}
    if choice == NAMED:
        schema["maxItems"] = 1
    schema["items"] = {"type": "object", "anyOf": variants}
    return {"json": schema}


# tool parsers whose vLLM adjust_request leaves skip_special_tokens as the request set it (the others turn it off
# when tools may be called, so that call markers reach them)
PARSERS_LEAVING_SPECIAL_TOKENS: Final = frozenset({"llama3_json", "llama4_json", "deepseek_v31", "pythonic",
                                                   "llama4_pythonic"})


# vLLM's supports_required_and_named = False: a forced call is left to the model's own markup (no JSON constraint,
# which would have Muse write JSON inside its ATEM message) and read by the parser as under "auto"
PARSERS_READING_FORCED_CALLS_NATIVELY: Final = frozenset({"muse", "muse_glimmer", "musespark"})


def tool_call_constraint(tool_parser: str | None, tools: list[dict[str, Any]] | None, choice: str,
                         name: str | None, parallel_tool_calls: bool | None,
                         requested: dict[str, Any] | None, strict_level: str = "auto",
                         requested_explicitly: bool = False) -> dict[str, Any] | None:
    """The request's ``structured_outputs`` once its tool choice is applied, as vLLM's render sets them
    (``adjust_request``). With a parser whose family has a structural tag: a forced call's tag replaces what the
    request asked for; under "auto" the calls are constrained once a tool is strict (or the strict level asks),
    or-ed with a requested format. Other parsers: vLLM's JSON for a forced call, else the request's own.

    ``requested_explicitly``: the request set ``structured_outputs`` itself (not ``response_format``)."""
    if tool_parser in PARSERS_READING_FORCED_CALLS_NATIVELY:
        return requested
    family = FAMILIES.get(tool_parser or "")
    if family is None:
        if tool_parser == "mistral":
            if requested_explicitly:
                return requested
            return mistral_structured_outputs(tools, choice, name) or requested
        if requested is not None and "structural_tag" in requested:
            return requested
        return tool_choice_structured_outputs(tools, choice, name, parallel_tool_calls) or requested
    if not tools or choice not in ("auto", "required", NAMED):
        return requested
    is_auto = choice == "auto"
    level = TOOL_STRICT_LEVELS.index(strict_level)
    if strict_level == "auto" and family.default_strict_level is not None:
        level = TOOL_STRICT_LEVELS.index(family.default_strict_level)
    one_call = parallel_tool_calls is False
    if one_call and not (is_auto and requested is not None):
        level = max(level, 1)  # limiting the calls needs the call envelope in the grammar
    if is_auto and level == 0 and not any(_function(t).get("strict") is True for t in tools):
        return requested
    tag_tools = [TagTool(str(_function(t).get("name")), _function(t).get("parameters"),
                         level == 2 or _function(t).get("strict") is True) for t in tools]
    answer = None
    if is_auto and requested is not None:
        answer = output_format(requested)
        if answer is None:
            return requested  # a format we cannot put next to the calls (docs/compatibility.md)
    if choice == NAMED:
        tag_tools = [t for t in tag_tools if t.name == name]
    tag_choice: TagChoice = "forced" if choice == NAMED else "auto" if is_auto and answer is None else "required"
    fmt = family.build(tag_tools, tag_choice)
    if one_call:
        one_call_only(fmt)
    if answer is not None:
        fmt = one_of([fmt, answer])  # the model answers with calls (at least one) or in the requested format
    return {"structural_tag": structural_tag_text(fmt)}


def output_format(requested: dict[str, Any]) -> dict[str, Any] | None:
    """A requested constraint as the structural-tag element vLLM puts next to the calls; None for one we
    cannot express without xgrammar (a Lark grammar)."""
    if requested.get("json_object"):
        return json_schema({"type": "object"})
    if requested.get("json") is not None:
        schema = requested["json"]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                return None
        return json_schema(schema) if isinstance(schema, (dict, bool)) else None
    if isinstance(requested.get("regex"), str):
        return regex(requested["regex"])
    choices = requested.get("choice")
    if isinstance(choices, list) and all(isinstance(c, str) for c in choices):
        return one_of([const(c) for c in choices])
    ebnf = requested.get("grammar")
    if isinstance(ebnf, str) and not grammar_is_lark(ebnf):
        return grammar(ebnf)
    tag = requested.get("structural_tag")
    try:
        parsed = json.loads(tag) if isinstance(tag, str) else tag
    except ValueError:
        return None
    if not isinstance(parsed, dict):
        return None
    if "structures" in parsed:  # the legacy form: calls triggered in text, each a begin, a JSON schema, an end
        return _legacy_structures(parsed)
    fmt = parsed.get("format")
    return fmt if isinstance(fmt, dict) else None


def _legacy_structures(parsed: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM's conversion of a ``{"structures": [...], "triggers": [...]}`` tag into triggered tags; None for a
    malformed one (left for the engine to refuse)."""
    structures, triggers = parsed.get("structures"), parsed.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list):
        return None
    if not all(isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
               and "schema" in s for s in structures):
        return None
    return triggered(list(triggers), [tag(s["begin"], json_schema(s["schema"]), s["end"]) for s in structures],
                     False, [])


def grammar_is_lark(text: str) -> bool:
    """vLLM's test: a grammar is EBNF when a line (comments aside) defines a rule with ``::=``."""
    for line in text.split("\n"):
        if "::=" in re.sub(r"(#|//).*$", "", line).strip():
            return False
    return True


def _function(tool: Any) -> dict[str, Any]:
    fn = (tool or {}).get("function") if isinstance(tool, dict) else None
    return fn if isinstance(fn, dict) else {}
