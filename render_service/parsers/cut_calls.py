"""A tool call cut off by ``max_tokens`` is not handed out as a call.

A streamed call has gone out fragment by fragment before the output ended; the stream's last chunk says
``finish_reason: "length"``, which is how a streaming client learns the call is unfinished. A whole answer
can do better, and does what vLLM's batch parsers do: when the output was cut (``length``) and the tool parser
had to close the last call's arguments itself (the model never wrote their end), that call is withdrawn and
its text, markup included, is content. Earlier calls, which the model finished, stay. ``finish_reason`` stays
``length``.

The text of the cut call is found without any family-specific code: the tool stage's input is parsed again
by prefixes (a binary search, so about log2(n) parses, only for cut answers), and the longest prefix that
still yields only the finished calls marks where the cut call's text begins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from render_service.parsers.base import TextPiece, ToolCallPiece

if TYPE_CHECKING:
    from render_service.parsers.pipeline import Pipeline


def _parse(pipeline: Pipeline, text: str) -> tuple[str, int]:
    """(content, number of calls) of the tool parser over ``text`` as a whole output."""
    parser = pipeline._make_tool_parser(pipeline.config)
    state = parser.initial_state()
    pieces = [*parser.feed(state, text), *parser.finish(state)]
    content = "".join(p.text for p in pieces if type(p) is TextPiece and p.channel == "content")
    calls = max((p.index + 1 for p in pieces if type(p) is ToolCallPiece), default=0)
    return content, calls


def withdraw_cut_call(pipeline: Pipeline, message: dict[str, Any], engine_finish: str | None) -> dict[str, Any]:
    """``message`` with a call cut off by ``max_tokens`` given back as content (see the module's docstring)."""
    cut = pipeline.closed_at_finish
    text_parts = pipeline.tool_text
    calls = message.get("tool_calls") or []
    if engine_finish != "length" or cut is None or text_parts is None or pipeline.config.tool_choice != "auto":
        return message
    if cut != len(calls) - 1:
        return message  # not the last call (cannot happen with an ordered parser): leave the answer as parsed
    text = "".join(text_parts)
    lo, hi = 0, len(text)  # _parse(text[:lo]) has at most `cut` calls; _parse(text[:hi]) has more
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _parse(pipeline, text[:mid])[1] <= cut:
            lo = mid
        else:
            hi = mid
    before, _ = _parse(pipeline, text[:lo])
    out = dict(message)
    out["content"] = (before + text[lo:]) or None
    out["tool_calls"] = calls[:cut]
    return out
