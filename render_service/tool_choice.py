"""tool_choice: vLLM's rules for the request field, read once for render and derender (same errors), and the
constraint render puts on the output for it.

The constraint follows vLLM 0.32 per tool parser. hermes: a structural tag in the model's own call syntax
(``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>``, at least one call, only one for a named tool
or ``parallel_tool_calls: false``; a call's arguments pinned to the tool's schema only when the tool says
``strict: true``), and under ``tool_choice: "auto"`` the same calls when any tool is strict. Other parsers
without a native forced path: vLLM's JSON (a bare array of ``{"name", "parameters"}`` for "required", the
tool's arguments object when named). docs/compatibility.md lists the parsers vLLM gives an xgrammar-built
structural tag that we do not.
"""

from __future__ import annotations

import json
from typing import Any, Final

from render_service.errors import bad_request
from render_service.parsers.pipeline import ToolChoiceMode
from render_service.protocol import ChatCompletionRequest

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
    if choice == NAMED and not any(((t or {}).get("function") or {}).get("name") == name for t in req.tools or []):
        raise bad_request(f"Tool '{name}' has not been passed in `tools`.", "tool_choice")
    return choice, name


def tool_choice_structured_outputs(tools: list[dict[str, Any]] | None, choice: str,
                                   name: str | None) -> dict[str, Any] | None:
    """Named and "required" tool choice constrain the output to the tool's JSON, as vLLM does."""
    if choice == NAMED:
        tool = next(t for t in tools or [] if (t.get("function") or {}).get("name") == name)
        return {"json": tool["function"].get("parameters") or {"type": "object", "properties": {}}}
    if choice == "required":
        variants = []
        for tool in tools or []:
            fn = tool.get("function") or {}
            variants.append({
                "properties": {
                    "name": {"type": "string", "enum": [fn.get("name")]},
                    "parameters": fn.get("parameters") or {"type": "object", "properties": {}},
                },
                "required": ["name", "parameters"],
            })
        return {"json": {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}}
    return None


# Tool parsers whose forced calls vLLM 0.32 constrains with its own hermes-style structural tag.
HERMES_STRUCTURAL_TAG_PARSERS = {"hermes": ("<tool_call>", "</tool_call>")}


def tool_call_constraint(tool_parser: str | None, tools: list[dict[str, Any]] | None, choice: str,
                         name: str | None, parallel_tool_calls: bool | None,
                         requested: dict[str, Any] | None, strict_level: str = "auto") -> dict[str, Any] | None:
    """The request's ``structured_outputs`` once its tool choice is applied (vLLM's ``adjust_request``): a forced
    call's constraint replaces what the request asked for; "auto" keeps the request's, else (hermes, a strict
    tool or ``--tool-strict-level function|parameter``) constrains the calls the model may make."""
    tags = HERMES_STRUCTURAL_TAG_PARSERS.get(tool_parser or "")
    if tags is not None and tools and choice in ("required", NAMED, "auto"):
        if strict_level == "parameter":  # every tool's arguments pinned, as if each said strict: true
            tools = [{**t, "function": {**((t or {}).get("function") or {}), "strict": True}} for t in tools]
        if parallel_tool_calls is False and strict_level == "auto" and (choice != "auto" or requested is None):
            strict_level = "function"  # vLLM: limiting the calls needs the call envelope in the grammar
        if choice != "auto":
            return {"structural_tag": hermes_structural_tag(tools, choice, name, parallel_tool_calls, *tags)}
        if strict_level == "auto" and not any(_strict(t) is True for t in tools):
            return requested
        if requested is None:
            return {"structural_tag": hermes_structural_tag(tools, choice, name, parallel_tool_calls, *tags)}
        # the model answers either with calls (at least one) or in the requested format
        answer = _output_format(requested)
        if answer is None:
            return requested  # a format we do not compose with calls (vLLM does for regex, choice, grammar)
        calls = json.loads(hermes_structural_tag(tools, "required", None, parallel_tool_calls, *tags))["format"]
        return {"structural_tag": json.dumps({"type": "structural_tag",
                                              "format": {"type": "or", "elements": [calls, answer]}})}
    return tool_choice_structured_outputs(tools, choice, name) or requested


def _output_format(requested: dict[str, Any]) -> dict[str, Any] | None:
    """A json / json_object constraint as the structural-tag element vLLM puts next to the calls."""
    schema: Any = {"type": "object"} if requested.get("json_object") else requested.get("json")
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            return None
    if not isinstance(schema, (dict, bool)):
        return None
    return _json_schema_format(schema)


def _json_schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema, "style": "json", "any_order": False,
            "max_whitespace_cnt": None, "excludes": []}


def _strict(tool: dict[str, Any]) -> Any:
    return ((tool or {}).get("function") or {}).get("strict")


def hermes_structural_tag(tools: list[dict[str, Any]], choice: str, name: str | None,
                          parallel_tool_calls: bool | None, start: str, end: str) -> str:
    """vLLM 0.32's hermes structural tag, as the JSON text its render writes (json.dumps of xgrammar's model)."""
    if choice == NAMED:
        tools = [t for t in tools if ((t or {}).get("function") or {}).get("name") == name]
    tags = []
    for tool in tools:
        fn = (tool or {}).get("function") or {}
        params = fn.get("parameters") if _strict(tool) is True else None
        schema: Any = params if params is not None else True
        for begin, finish in ((start + '\n{"name": "', "}\n" + end), (start + '{"name": "', "}" + end)):
            tags.append({"type": "tag", "begin": begin + str(fn.get("name")) + '", "arguments": ',
                         "content": _json_schema_format(schema), "end": finish})
    one_call = choice == NAMED or parallel_tool_calls is False
    if choice == "auto":
        fmt: dict[str, Any] = {"type": "triggered_tags", "triggers": [start], "tags": tags, "at_least_one": False,
                               "stop_after_first": one_call, "excludes": []}
    else:
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "", "at_least_one": True,
               "stop_after_first": one_call}
    return json.dumps({"type": "structural_tag", "format": fmt})
