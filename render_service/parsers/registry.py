"""Parser lookup by the names vLLM's flags use (``--reasoning-parser``, ``--tool-call-parser``).

Tool parser families are registered in ``tool_registry`` (owned with the ``tools_*.py`` files); this module
adds the reasoning parsers and lets tests or plugins register extra tool parsers at runtime.
"""

from __future__ import annotations

from render_service.parsers.reasoning import REASONING_PARSERS, ThinkReasoningParser

_EXTRA_TOOL_PARSERS: dict[str, type] = {}


class UnknownParserError(ValueError):
    pass


def register_tool_parser(cls: type, name: str | None = None) -> None:
    """Register a parser class at runtime (plugins, tests)."""
    _EXTRA_TOOL_PARSERS[name or cls.name] = cls


def _tool_registry():
    # imported lazily: the tool families are a separate module set that a server may not load at all
    from render_service.parsers import tool_registry

    return tool_registry


def tool_parser_names() -> list[str]:
    try:
        names = set(_tool_registry().tool_parser_names())
    except ImportError:
        names = set()
    return sorted(names | set(_EXTRA_TOOL_PARSERS))


def get_tool_parser(name: str) -> type:
    if name in _EXTRA_TOOL_PARSERS:
        return _EXTRA_TOOL_PARSERS[name]
    try:
        return _tool_registry().get_tool_parser(name)
    except (KeyError, ImportError) as exc:
        raise UnknownParserError(f"tool call parser {name!r} is not available: {exc}") from None


def get_reasoning_parser(name: str) -> type[ThinkReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise UnknownParserError(f"unknown reasoning parser {name!r}; known: {known}") from None


def reasoning_parser_names() -> list[str]:
    return sorted(REASONING_PARSERS)
