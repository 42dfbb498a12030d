"""gpt-oss's Harmony output as reasoning, content and tool calls (vLLM: ``openai_gptoss`` + ``openai``).

The model writes messages after the prompt's ``<|start|>assistant``::

    <|channel|>analysis<|message|>...<|end|>
    <|start|>assistant<|channel|>commentary<|message|>preamble<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>answer<|return|>

One stage does what upstream splits over a reasoning and a tool parser, because the channel and the
recipient of every message are in one header: the header (everything up to ``<|message|>``) picks where the
message body goes, exactly as vLLM's Harmony streaming does:

- ``analysis`` without a recipient -> reasoning;
- ``final`` -> content; ``commentary`` without a recipient (a preamble) -> content;
- a recipient ``functions.NAME`` (on commentary or analysis) -> tool call NAME, the body its JSON arguments
  (when the request allows tool calls; otherwise the body is content, so nothing is lost);
- any other recipient (gpt-oss's built-in browser/python tools, which chat requests never declare) -> dropped.

``<|end|>``, ``<|call|>`` and ``<|return|>`` end a message. The engine stops at ``<|call|>`` and
``<|return|>`` (the bundle's EOS ids), so they are usually hidden, and finish_reason follows from whether a
call was made (``tool_calls``) or not (``stop``).

It works on the detokenized text (special tokens kept), like every other stage: the state is the current
mode, a header of at most ``MAX_HEADER`` characters and a body suffix that may start a marker, so a chunk
costs O(chunk) and batch is the fold of the stream. A header that outgrows ``MAX_HEADER`` is not a header:
its text becomes content. A header still open at the end carries no message and is dropped, as upstream.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from enum import IntEnum
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import msgspec

from render_service.parsers.base import (
    Piece,
    ReasoningParserConfig,
    TextPiece,
    ToolCallPiece,
)

if TYPE_CHECKING:
    from render_service.tokenize.tokenizer import RenderTokenizer

MESSAGE = "<|message|>"
START = "<|start|>"
# what ends a message body (<|start|> too: a model that skipped <|end|> starts the next header)
BODY_ENDS = ("<|end|>", "<|call|>", "<|return|>", START)
MAX_HEADER = 512
MAX_NAME = 256
MAX_CALLS = 1024  # calls per reply; more are content (and a client's state cannot claim more)
_LONGEST_END = max(len(m) for m in BODY_ENDS)


class HarmonyMode(IntEnum):
    """Reading a message's header or its body (in stream_state: its int)."""

    HEADER = 0
    BODY = 1


class HarmonyTarget(IntEnum):
    """Where the current message's body goes (in stream_state: its int)."""

    REASONING = 0
    CONTENT = 1
    CALL = 2
    DROP = 3


HEADER, BODY = HarmonyMode  # module-level names: the hot loop compares against globals
REASONING, CONTENT, CALL, DROP = HarmonyTarget

_CHANNEL_RE = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT_RE = re.compile(r"(?:^|\s)to=([^\s<]+)")


class HarmonyState(msgspec.Struct, omit_defaults=True):
    mode: HarmonyMode = HEADER
    header: Annotated[str, msgspec.Meta(max_length=MAX_HEADER)] = ""
    target: HarmonyTarget = CONTENT
    held: Annotated[str, msgspec.Meta(max_length=_LONGEST_END)] = ""
    calls: Annotated[int, msgspec.Meta(ge=0, le=MAX_CALLS)] = 0
    # a call the prompt opened (forced tool choice) whose name is announced with the first output
    pending_call: Annotated[str, msgspec.Meta(max_length=MAX_NAME)] = ""

    def __post_init__(self) -> None:
        # stream_state comes from clients: a body routed to a call needs that call to exist (or be pending)
        if self.target == CALL and self.mode == BODY and self.calls == 0 and not self.pending_call:
            raise ValueError("inconsistent Harmony state: arguments for a call that was never opened")
        if self.held and self.mode != BODY:
            raise ValueError("inconsistent Harmony state: held text outside a message body")


_ROLE_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_:.-"


def without_author(header: str) -> str:
    """The header after its last ``<|start|>`` and the author's name (assistant) that follows it."""
    at = header.rfind(START)
    if at < 0:
        return header
    header = header[at + len(START):]
    return header[len("assistant"):] if header.startswith("assistant") else header.lstrip(_ROLE_CHARS)


def parse_header(header: str) -> tuple[str | None, str | None]:
    """(channel, recipient) of a header: ``[<|start|>role][ to=R]<|channel|>C[ to=R][ <|constrain|>json]``."""
    header = without_author(header)
    channel = _CHANNEL_RE.search(header)
    recipient = _RECIPIENT_RE.search(header)
    return (channel.group(1) if channel else None), (recipient.group(1) if recipient else None)


class _Out:
    """Pieces with adjacent runs of one destination merged."""

    __slots__ = ("pieces",)

    def __init__(self) -> None:
        self.pieces: list[Piece] = []

    def text(self, channel: Literal["reasoning", "content"], text: str) -> None:
        if not text:
            return
        last = self.pieces[-1] if self.pieces else None
        if isinstance(last, TextPiece) and last.channel == channel:
            self.pieces[-1] = TextPiece(channel, last.text + text)
        else:
            self.pieces.append(TextPiece(channel, text))

    def arguments(self, index: int, text: str) -> None:
        if not text:
            return
        last = self.pieces[-1] if self.pieces else None
        if isinstance(last, ToolCallPiece) and last.index == index:
            self.pieces[-1] = msgspec.structs.replace(last, arguments=(last.arguments or "") + text)
        else:
            self.pieces.append(ToolCallPiece(index=index, arguments=text))


class HarmonyParser:
    """The Harmony stage; the pipeline runs it in the reasoning slot and skips the tool slot."""

    name: ClassVar[str] = "openai_gptoss"
    State: ClassVar[type[msgspec.Struct]] = HarmonyState

    def __init__(self, config: ReasoningParserConfig = ReasoningParserConfig(), *, tool_calls: bool = False) -> None:
        self.config = config
        self.tool_calls = tool_calls

    @classmethod
    def enable_thinking_from(cls, kwargs: dict[str, Any]) -> bool:
        return True  # Harmony always reasons; reasoning_effort sets how much

    @classmethod
    def for_pipeline(cls, config: Any) -> HarmonyParser:
        """From a PipelineConfig: calls are parsed when the request lets the model call its tools."""
        calls = bool(config.tools) and config.tool_choice in ("auto", "required", "named")
        return cls(tool_calls=calls)

    # state ---------------------------------------------------------------------------------------------

    def initial_state(self, prompt_token_ids: Sequence[int] | None = None,
                      tokenizer: RenderTokenizer | None = None) -> HarmonyState:
        """Where the prompt left off: normally a header after ``<|start|>assistant``; a message body when the
        prompt opened one (our earlier renders did for a forced tool call or a structured final answer)."""
        state = HarmonyState()
        tail = _prompt_tail(prompt_token_ids, tokenizer) if prompt_token_ids and tokenizer is not None else None
        if tail is None:
            return state
        at = tail.find(MESSAGE)
        if at < 0:
            state.header = tail[-MAX_HEADER:]
            return state
        out = _Out()
        self._open(state, tail[:at], out, announce=False)
        return state

    # feeding -------------------------------------------------------------------------------------------

    def feed(self, state: HarmonyState, text: str) -> list[Piece]:
        out = _Out()
        if state.pending_call:
            self._announce(state, state.pending_call, out)
            state.pending_call = ""
        if state.mode == BODY and not state.held and "<" not in text:
            self._emit(state, text, out)  # the per-token case: body text with no marker in sight
            return out.pieces
        if state.held:
            text, state.held = state.held + text, ""
        pos, n = 0, len(text)
        while pos < n:
            if state.mode == HEADER:
                pos = self._header(state, text, pos, out)
                continue
            j = text.find("<", pos)
            if j < 0:
                self._emit(state, text[pos:], out)
                break
            self._emit(state, text[pos:j], out)
            end = next((m for m in BODY_ENDS if text.startswith(m, j)), None)
            if end is not None:
                pos = j + len(end)
                state.mode, state.header = HEADER, (START if end == START else "")
            elif any(m.startswith(text[j:]) for m in BODY_ENDS):
                state.held = text[j:]  # may still become a marker
                break
            else:
                self._emit(state, "<", out)
                pos = j + 1
        return out.pieces

    def finish(self, state: HarmonyState) -> list[Piece]:
        out = _Out()
        if state.pending_call:
            self._announce(state, state.pending_call, out)
            state.pending_call = ""
        if state.mode == BODY and state.held:
            self._emit(state, state.held, out)
        state.held = ""
        state.header = ""  # an unfinished header opened no message
        return out.pieces

    # internals -----------------------------------------------------------------------------------------

    def _header(self, state: HarmonyState, text: str, pos: int, out: _Out) -> int:
        """Consume header text from ``pos``; returns where body text starts (or len(text))."""
        prior = len(state.header)
        combined = state.header + text[pos:]
        at = combined.find(MESSAGE, max(0, prior - len(MESSAGE) + 1))
        if at < 0:
            if len(combined) > MAX_HEADER:  # no header is this long: it was text all along
                state.mode, state.target, state.header = BODY, CONTENT, ""
                combined = without_author(combined)
                held = _partial_end_len(combined)
                self._emit(state, combined[:len(combined) - held], out)
                state.held = combined[len(combined) - held:]
            else:
                state.header = combined
            return len(text)
        self._open(state, combined[:at], out, announce=True)
        return pos + (at - prior) + len(MESSAGE)

    def _open(self, state: HarmonyState, header: str, out: _Out, announce: bool) -> None:
        channel, recipient = parse_header(header)
        state.mode, state.header = BODY, ""
        if recipient in ("assistant", "all"):
            recipient = None
        if recipient is None:
            state.target = REASONING if channel == "analysis" else CONTENT
        elif recipient.startswith("functions.") and self.tool_calls and state.calls < MAX_CALLS:
            name = recipient[len("functions."):][:MAX_NAME]
            state.target = CALL
            if announce:
                self._announce(state, name, out)
            else:
                state.pending_call = name
        elif recipient.startswith("functions."):
            state.target = CONTENT  # tools not allowed here: the arguments stay visible
        else:
            state.target = DROP  # a built-in tool (browser, python) chat completions cannot express

    def _announce(self, state: HarmonyState, name: str, out: _Out) -> None:
        out.pieces.append(ToolCallPiece(index=state.calls, name=name))
        state.calls += 1

    def _emit(self, state: HarmonyState, text: str, out: _Out) -> None:
        if not text:
            return
        target = state.target
        if target == CONTENT:
            out.text("content", text)
        elif target == REASONING:
            out.text("reasoning", text)
        elif target == CALL:
            out.arguments(state.calls - 1, text)


def _partial_end_len(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a body end marker."""
    at = text.rfind("<", max(0, len(text) - _LONGEST_END))
    if at >= 0 and any(m.startswith(text[at:]) and m != text[at:] for m in BODY_ENDS):
        return len(text) - at
    return 0


def _prompt_tail(prompt_token_ids: Sequence[int], tokenizer: RenderTokenizer, window: int = 96) -> str | None:
    """The prompt's text from its last ``<|start|>`` (None when the window holds none)."""
    start_id = tokenizer.token_to_id(START)
    tail = list(prompt_token_ids[-window:])
    for i in range(len(tail) - 1, -1, -1):
        if tail[i] == start_id:
            return tokenizer.decode(tail[i:], skip_special_tokens=False)
    return None


class HarmonyToolCalls:
    """``--tool-call-parser openai``: accepted so command lines carry over; HarmonyParser does the work."""

    name: ClassVar[str] = "openai"
    State: ClassVar[type[msgspec.Struct]] = HarmonyState

    def __init__(self, config: Any = None) -> None:
        self.config = config

    def initial_state(self) -> HarmonyState:
        return HarmonyState()

    def feed(self, state: Any, text: str) -> list[Piece]:
        return [TextPiece("content", text)] if text else []

    def finish(self, state: Any) -> list[Piece]:
        return []
