"""Reasoning parsers: split detokenized text into reasoning and content.

One text state machine serves the ``<think>``-style family (parser-semantics.md §1, profile N):

* output starts in reasoning unless thinking is off or the prompt already closed reasoning;
* a ``<think>`` that the model writes before any reasoning text is removed, with the whitespace before it;
* the first ``</think>`` ends reasoning; everything after it is content (no more tag processing);
* ``qwen3`` also ends reasoning implicitly at ``<tool_call>`` followed (after whitespace) by ``<function=``
  or ``<function `` (Qwen3.5 emits tool calls inside an unterminated think block); the marker stays in content;
* a suffix that could still become a tag is held back and released as soon as it cannot;
* truncated output (no end tag) is reasoning.

Tags are matched on text, so a tag spelled with ordinary sub-tokens or split across chunks behaves the same
as the single added token. Batch is the fold of the stream, so the two never disagree.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from enum import IntEnum
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from render_service.parsers.base import ReasoningParserConfig, TextPiece

if TYPE_CHECKING:
    from render_service.tokenize.tokenizer import RenderTokenizer

THINK_START = "<think>"
THINK_END = "</think>"

class ThinkMode(IntEnum):
    """Where a think-tag stream is. Travels in stream_state as its int."""

    AWAIT_START = 0  # reasoning; nothing but whitespace seen yet, a leading <think> is still removable
    REASONING = 1
    CONTENT = 2


AWAIT_START, REASONING, CONTENT = ThinkMode  # module-level names: the hot loops compare against globals


class ThinkState(msgspec.Struct, omit_defaults=True):
    mode: ThinkMode = AWAIT_START
    held: str = ""  # text that may still turn out to be (part of) a tag


@functools.lru_cache(maxsize=32)
def _marker_shape(markers: tuple[str, ...]) -> tuple[int, str]:
    """(longest marker less one, the markers' first characters): fixed per parser, not per chunk."""
    return max(len(m) for m in markers) - 1, "".join(sorted({m[0] for m in markers}))


def _partial_suffix_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``."""
    longest, firsts = _marker_shape(markers)
    window = text[-longest:]
    # Only a suffix starting with a marker's first character can match (all our markers start with "<"),
    # and most chunks hold none: one find per first character instead of a loop over the characters.
    starts = [at for at in map(window.find, firsts) if at >= 0]
    if not starts:
        return 0
    for i in range(min(starts), len(window)):
        if window[i] in firsts:
            tail = window[i:]
            if any(m.startswith(tail) for m in markers):
                return len(tail)
    return 0


def _first_marker(buf: str, pos: int, markers: tuple[str, ...]) -> int:
    """Where the first of ``markers`` starts in ``buf[pos:]``, or -1."""
    found = [at for at in (buf.find(m, pos) for m in markers) if at >= 0]
    return min(found) if found else -1


class ThinkReasoningParser:
    """``<think>`` / ``</think>`` parser; subclasses set the name and the implicit-end rule."""

    name: ClassVar[str] = "think"
    State: ClassVar[type[msgspec.Struct]] = ThinkState
    # chat_template_kwargs key that switches thinking, and its default when absent.
    thinking_kwarg: ClassVar[str] = "enable_thinking"
    thinking_default: ClassVar[bool] = True
    implicit_end_at_tool_call: ClassVar[bool] = False
    tool_call_tag: ClassVar[str] = "<tool_call>"  # the call block's opener that implicit end looks for
    # Markers that end reasoning where the model starts a tool-call section without closing its think block
    # (Kimi-K2, DeepSeek-V4); the marker stays in the content for the tool parser.
    implicit_end_markers: ClassVar[tuple[str, ...]] = ()
    start_tag: ClassVar[str] = THINK_START
    end_tag: ClassVar[str] = THINK_END
    # True where a reply is content until the model opens reasoning (Magistral's [THINK], Granite's phrase):
    # text held back before that point is content, not reasoning
    starts_in_content: ClassVar[bool] = False

    def __init__(self, config: ReasoningParserConfig = ReasoningParserConfig()) -> None:
        self.config = config
        self._markers: tuple[str, ...] = (
            (self.end_tag, self.tool_call_tag) if self.implicit_end_at_tool_call else (self.end_tag,)
        ) + self.implicit_end_markers
        firsts = {m[0] for m in self._markers}
        # Text without this character holds no marker and no start of one (None: the markers start differently).
        self._marker_first: str | None = firsts.pop() if len(firsts) == 1 else None

    @classmethod
    def enable_thinking_from(cls, chat_template_kwargs: dict[str, Any] | None) -> bool:
        value = (chat_template_kwargs or {}).get(cls.thinking_kwarg, cls.thinking_default)
        return bool(value)

    def initial_state(self) -> ThinkState:
        cfg = self.config
        if not cfg.enable_thinking or not cfg.reasoning_open_at_start:
            return ThinkState(mode=CONTENT)
        return ThinkState(mode=AWAIT_START)

    def feed(self, state: ThinkState, text: str) -> list[TextPiece]:
        if not state.held and state.mode != AWAIT_START and self._marker_first is not None \
                and self._marker_first not in text:
            # The per-token common case: text that holds no marker and cannot start one is all of the
            # current channel.
            return [TextPiece("content" if state.mode == CONTENT else "reasoning", text)] if text else []
        if state.mode == CONTENT and not state.held:
            return [TextPiece("content", text)] if text else []
        buf = state.held + text if state.held else text
        state.held = ""
        out: list[TextPiece] = []
        if state.mode == AWAIT_START:
            buf = self._opening(state, buf, out)
            if state.mode == AWAIT_START:
                return out
        if state.mode == REASONING:
            buf = self._reasoning(state, buf, out)
        if state.mode == CONTENT and buf:
            out.append(TextPiece("content", buf))
        return out

    def finish(self, state: ThinkState) -> list[TextPiece]:
        held, state.held = state.held, ""
        if not held:
            return []
        as_content = state.mode == CONTENT or (state.mode == AWAIT_START and self.starts_in_content)
        return [TextPiece("content" if as_content else "reasoning", held)]

    # ------------------------------------------------------------------------------------------------

    def _opening(self, state: ThinkState, buf: str, out: list[TextPiece]) -> str:
        """Before reasoning opened: returns the text after the opening (mode REASONING or CONTENT then), or
        holds what may still open it (mode stays AWAIT_START). Families that start in content emit into ``out``."""
        return self._await_start(state, buf)

    def _await_start(self, state: ThinkState, buf: str) -> str:
        stripped = buf.lstrip()
        if stripped.startswith(self.start_tag):
            state.mode = REASONING
            return stripped[len(self.start_tag):]
        if self.start_tag.startswith(stripped):
            state.held = buf  # only whitespace and maybe a partial <think> so far
            return ""
        state.mode = REASONING
        return buf

    def _reasoning(self, state: ThinkState, buf: str, out: list[TextPiece]) -> str:
        """Emit reasoning from ``buf``; return the content remainder if reasoning ended."""
        pos = 0
        while True:
            end = buf.find(self.end_tag, pos)
            if self.implicit_end_markers:
                implicit = _first_marker(buf, pos, self.implicit_end_markers)
                if implicit >= 0 and (end < 0 or implicit < end):
                    if implicit:
                        out.append(TextPiece("reasoning", buf[:implicit]))
                    state.mode = CONTENT
                    return buf[implicit:]
            call = buf.find(self.tool_call_tag, pos) if self.implicit_end_at_tool_call else -1
            if call >= 0 and (end < 0 or call < end):
                verdict = self._tool_call_verdict(buf, call)
                if verdict == "end":
                    if call:
                        out.append(TextPiece("reasoning", buf[:call]))
                    state.mode = CONTENT
                    return buf[call:]
                if verdict == "wait":
                    if call:
                        out.append(TextPiece("reasoning", buf[:call]))
                    state.held = buf[call:]
                    return ""
                pos = call + len(self.tool_call_tag)
                continue
            if end >= 0:
                if end:
                    out.append(TextPiece("reasoning", buf[:end]))
                state.mode = CONTENT
                return buf[end + len(self.end_tag):]
            keep = _partial_suffix_len(buf, self._markers)
            emit = buf[:len(buf) - keep]
            if emit:
                out.append(TextPiece("reasoning", emit))
            state.held = buf[len(buf) - keep:]
            return ""

    def _tool_call_verdict(self, buf: str, at: int) -> str:
        rest = buf[at + len(self.tool_call_tag):].lstrip()
        if rest.startswith("<function=") or rest.startswith("<function "):
            return "end"
        if "<function".startswith(rest):
            return "wait"  # only whitespace and a prefix of "<function" so far
        return "no"


class Qwen3ReasoningParser(ThinkReasoningParser):
    name = "qwen3"
    implicit_end_at_tool_call = True


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    name = "deepseek_r1"
    thinking_kwarg = "thinking"  # no switch in vLLM; R1 always thinks
    thinking_default = True

    @classmethod
    def enable_thinking_from(cls, chat_template_kwargs: dict[str, Any] | None) -> bool:
        return True


class DeepSeekV3ReasoningParser(ThinkReasoningParser):
    """deepseek_r1 rules when ``chat_template_kwargs.thinking`` is true, otherwise everything is content."""

    name = "deepseek_v3"
    thinking_kwarg = "thinking"
    thinking_default = False


REASONING_PARSERS: dict[str, type[ThinkReasoningParser]] = {
    cls.name: cls for cls in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser, DeepSeekV3ReasoningParser)
}


def reasoning_open_at_prompt_end(
    prompt_token_ids: Sequence[int] | None, tokenizer: RenderTokenizer, parser_cls: type[ThinkReasoningParser]
) -> bool | None:
    """What the prompt's tail says about reasoning at the start of the output.

    Scans back from the end of the prompt and stops at the first special token (a turn boundary such as
    ``<|im_start|>``), so ``</think>`` of earlier turns never counts (vLLM PR #32490). True: the template
    opened ``<think>``; False: it closed reasoning (``<think>\\n\\n</think>``); None: the tail says nothing.
    """
    if not prompt_token_ids:
        return None
    start_id = tokenizer.token_to_id(parser_cls.start_tag)
    end_id = tokenizer.token_to_id(parser_cls.end_tag)
    special = tokenizer.special_token_ids
    for t in reversed(prompt_token_ids[-63:]):  # (a slice: a PromptIds view reads it from its last pieces)
        if t == end_id:
            return False
        if t == start_id:
            return True
        if t in special:
            return None
    return None
