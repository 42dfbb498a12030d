"""tool_choice: vLLM's rules for the request field, read once for render and derender (same errors)."""

from __future__ import annotations

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
