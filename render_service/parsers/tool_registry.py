"""Tool-call parser names (as vLLM's ``--tool-call-parser`` spells them) -> parser classes."""

from __future__ import annotations

import importlib

from render_service.parsers.base import ToolParser

# name -> (module, class); imported on first use so that a server loads only the parser it runs
_TOOL_PARSERS: dict[str, tuple[str, str]] = {
    "hermes": ("render_service.parsers.tools_hermes", "HermesToolParser"),
    "qwen3_coder": ("render_service.parsers.tools_qwen3_coder", "Qwen3CoderToolParser"),
    "qwen3_xml": ("render_service.parsers.tools_qwen3_coder", "Qwen3CoderToolParser"),
    "llama3_json": ("render_service.parsers.tools_json", "Llama3JsonToolParser"),
    "mistral": ("render_service.parsers.tools_mistral", "MistralToolParser"),
    "deepseek_v31": ("render_service.parsers.tools_deepseek", "DeepSeekV31ToolParser"),
    "pythonic": ("render_service.parsers.tools_pythonic", "PythonicToolParser"),
    "kimi_k2": ("render_service.parsers.tools_kimi", "KimiK2ToolParser"),
}


def tool_parser_names() -> list[str]:
    return sorted(_TOOL_PARSERS)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered under ``name``; KeyError (listing the known names) if there is none."""
    try:
        module, cls = _TOOL_PARSERS[name]
    except KeyError:
        raise KeyError(f"unknown tool call parser {name!r}; known: {', '.join(tool_parser_names())}") from None
    return getattr(importlib.import_module(module), cls)
