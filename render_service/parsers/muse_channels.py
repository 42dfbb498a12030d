"""Muse's channel-scoped messages (``muse``, its alias ``musespark``, ``muse_glimmer``): the reading both stages share.

After the prompt's ``<|start|>assistant`` the model writes a sequence of messages::

     to=self<|message|>reasoning<|eom|>
    <|start|>assistant to=commentary<|message|>an update for the user<|eom|>
    <|start|>assistant to=get_weather<|message|><atem:function_calls>...</atem:function_calls><|eom|>
    <|start|>assistant to=user<|message|>the answer<|eot|>

A header (``[<|start|>AUTHOR][ to=RECIPIENT]``, ended by ``<|message|>``) says where the body goes. A body ends
at ``<|eom|>``, ``<|eot|>``, the next ``<|start|>``, or at a ``<|message|>`` that the model writes without ending
the message first (``...to=get_weather<|message|>``, seen after reasoning): the ``to=NAME`` right before that
``<|message|>`` is the next header, not text. Recipients, as vLLM 0.34's parsers route them:

* ``muse`` / ``musespark``: none or ``self`` -> reasoning; ``user``, ``commentary`` -> content;
  ``developer`` -> dropped; any other recipient is a tool (its body holds ATEM calls);
* ``muse_glimmer``: ``self`` -> reasoning; none or ``user`` -> content; any other recipient is a tool.

Two stages, as upstream splits them: the reasoning stage takes the reasoning messages out and passes every other
message on as content, its markup included; the tool stage (``tools_muse``; the pipeline runs it after a Muse
reasoning stage whatever the tool choice) reads those messages: content bodies, tool calls. Used without the
reasoning stage, the tool stage routes reasoning messages itself, as upstream's does.

Text that is no header (a reply written without any framing, or words between messages) is content. Work per
feed is O(new text): the state holds a header (at most ``MAX_HEADER`` characters) or the end of a body that may
still become a marker or a ``to=NAME`` header (at most ``MAX_HOLD``).
"""

from __future__ import annotations

import re
from enum import IntEnum
from typing import Annotated, Any, ClassVar, Literal, cast

import msgspec

from render_service.parsers.base import Piece, ReasoningParserConfig, TextPiece
from render_service.parsers.reasoning import CONTENT as THINK_CONTENT
from render_service.parsers.reasoning import ThinkReasoningParser, ThinkState

MESSAGE = "<|message|>"
START = "<|start|>"
EOM = "<|eom|>"
EOT = "<|eot|>"
BODY_MARKERS = (EOM, EOT, START, MESSAGE)
MAX_HEADER = 512
MAX_NAME = 256
MAX_HOLD = MAX_NAME + len("to=") + len(MESSAGE)


class MuseMode(IntEnum):
    """Reading a header or a body (in stream_state: its int)."""

    HEADER = 0
    BODY = 1


class MuseTarget(IntEnum):
    """Where the current body goes (in stream_state: its int)."""

    REASONING = 0
    CONTENT = 1
    CALL = 2
    DROP = 3
    PASS = 4  # the reasoning stage: the message, markup and all, goes on to the tool stage as content


HEADER, BODY = MuseMode
REASONING, CONTENT, CALL, DROP, PASS = MuseTarget

# a header before its <|message|>: [<|start|>assistant] [to=recipient], whitespace around (upstream's)
_HEADER = re.compile(r"\s*(?:<\|start\|>\s*assistant)?[^\S\n]*(?:to=(?P<to>[A-Za-z0-9_.\-]*))?[^\S\n]*")
# what may still grow into one (any word after <|start|>: a superset, so holding never stops early)
_HEADER_SO_FAR = re.compile(r"\s*(?:<\|start\|>\s*[A-Za-z0-9_]*)?[^\S\n]*(?:to=[A-Za-z0-9_.\-]*)?[^\S\n]*")
# the end of a body that is a header's recipient (when <|message|> follows), or may still become one
_HEADER_TAIL = re.compile(rf"to=([A-Za-z0-9_.\-]{{1,{MAX_NAME}}})$")
_MAYBE_TAIL = re.compile(rf"(?:to=[A-Za-z0-9_.\-]{{0,{MAX_NAME}}}|to?)$")


def header_prefix(text: str) -> bool:
    """Whether ``text`` may still become a header (it has no ``<|message|>`` yet): some ending completes it. (A
    greedy match would not do: in ``<|start|> to=x`` the author may be empty or ``to``, so fullmatch decides.)"""
    k = _marker_prefix_len(text)
    if k:
        head, part = text[:len(text) - k], text[len(text) - k:]
        return (MESSAGE.startswith(part) and _HEADER_SO_FAR.fullmatch(head) is not None) or (
            START.startswith(part) and not head.strip())
    return any(_HEADER_SO_FAR.fullmatch(text + end) is not None for end in ("", "=", "o="))


def recipient_of(header: str) -> tuple[bool, str | None]:
    """(is a header, its recipient) for the text before a ``<|message|>``."""
    m = _HEADER.fullmatch(header)
    if m is None:
        return False, None
    return True, (m.group("to") or None)


def _marker_prefix_len(text: str) -> int:
    """Length of the suffix of ``text`` that is a proper prefix of a body marker."""
    at = text.rfind("<", max(0, len(text) - len(MESSAGE) + 1))
    if at >= 0 and any(m.startswith(text[at:]) and m != text[at:] for m in BODY_MARKERS):
        return len(text) - at
    return 0


class MuseState(ThinkState, omit_defaults=True):
    """ThinkState's ``mode`` stays CONTENT (there is no think block to close); ``held`` is a body's held end."""

    channel: MuseMode = HEADER
    header: Annotated[str, msgspec.Meta(max_length=MAX_HEADER)] = ""
    target: MuseTarget = CONTENT

    def __post_init__(self) -> None:
        # stream_state comes from clients: what is held is bounded, and only a body holds text
        if len(self.held) > MAX_HOLD + len(MESSAGE) or (self.held and self.channel != BODY):
            raise ValueError("inconsistent Muse state: held text out of bounds")
        if self.header and self.channel != HEADER:
            raise ValueError("inconsistent Muse state: a header outside the header")


class _Out:
    """Pieces with adjacent runs of one channel merged."""

    __slots__ = ("pieces",)

    def __init__(self) -> None:
        self.pieces: list[Piece] = []

    def text(self, channel: Literal["reasoning", "content"], text: str) -> None:
        if not text:
            return
        last = self.pieces[-1] if self.pieces else None
        if type(last) is TextPiece and last.channel == channel:
            self.pieces[-1] = TextPiece(channel, last.text + text)
        else:
            self.pieces.append(TextPiece(channel, text))

    def extend(self, pieces: list[Piece]) -> None:
        for p in pieces:
            if type(p) is TextPiece:
                self.text(p.channel, p.text)
            else:
                self.pieces.append(p)


class MuseChannels:
    """The message reader; a stage says where each recipient's body goes and what a call body does."""

    REASONING_RECIPIENTS: ClassVar[tuple[str | None, ...]] = (None, "self")
    CONTENT_RECIPIENTS: ClassVar[tuple[str | None, ...]] = ("user", "commentary")
    DROPPED_RECIPIENTS: ClassVar[tuple[str | None, ...]] = ("developer",)

    def target_of(self, recipient: str | None) -> MuseTarget:
        if recipient in self.REASONING_RECIPIENTS:
            return REASONING
        if recipient in self.CONTENT_RECIPIENTS:
            return CONTENT
        if recipient in self.DROPPED_RECIPIENTS:
            return DROP
        return CALL

    # what a stage does with text, a header, a message's end (overridden by the stages) --------------------

    def deliver(self, state: MuseState, text: str, out: _Out) -> None:
        target = state.target
        if target == REASONING:
            out.text("reasoning", text)
        elif target != DROP:
            out.text("content", text)

    def opened(self, state: MuseState, header: str, out: _Out) -> None:
        """A message was opened by ``header`` (its text, ``<|message|>`` included)."""

    def closed(self, state: MuseState, marker: str, out: _Out) -> None:
        """The current message ended at ``marker`` ("" at the end of output or at a header in its body)."""

    def unframed(self) -> MuseTarget:
        return CONTENT

    # reading -----------------------------------------------------------------------------------------------

    def body_text(self, state: MuseState, text: str) -> list[Piece]:
        """The per-token case: body text with no marker or header in sight."""
        target = state.target
        if target == REASONING:
            return [TextPiece("reasoning", text)]
        if target == DROP:
            return []
        if target == CALL or not text:
            out = _Out()
            self.deliver(state, text, out)
            return out.pieces
        return [TextPiece("content", text)]

    def run(self, state: MuseState, text: str, final: bool) -> list[Piece]:
        if not final and state.channel == BODY:
            if state.held:  # mostly a "t" held back in case it begins "to=": the next token says it does not
                text, state.held = state.held + text, ""
            if "<" not in text and not state.header:
                if "to=" not in text and not text.endswith(("t", "to")):
                    return self.body_text(state, text)
                # _body's own no-marker case, without its buffers: hold what may still become "to=NAME"
                keep = _hold_len(text)
                if keep:
                    text, state.held = text[:len(text) - keep], text[len(text) - keep:]
                return self.body_text(state, text) if text else []
        out = _Out()
        buf = state.header + state.held + text
        state.header = state.held = ""
        pos = 0
        while pos < len(buf) or (final and state.channel == BODY):
            if state.channel == HEADER:
                pos = self._header(state, buf, pos, final, out)
                if pos < 0:
                    break
            else:
                pos = self._body(state, buf, pos, final, out)
                if pos < 0:
                    break
        return out.pieces

    def _header(self, state: MuseState, buf: str, pos: int, final: bool, out: _Out) -> int:
        at = buf.find(MESSAGE, pos, pos + MAX_HEADER + len(MESSAGE))
        if at >= 0:
            is_header, recipient = recipient_of(buf[pos:at])
            if is_header:
                state.channel, state.target = BODY, self.target_of(recipient)
                self.opened(state, buf[pos:at + len(MESSAGE)], out)
                return at + len(MESSAGE)
        elif len(buf) - pos <= MAX_HEADER and header_prefix(buf[pos:]):
            if final:
                self._dangling(state, buf[pos:], out)
                return -1
            state.header = buf[pos:]
            return -1
        # no header: text, read as a body of its own; a <|start|> that opens no header is markup, dropped (read
        # again as a body's end, it would stop the reading here)
        state.channel, state.target = BODY, self.unframed()
        at = buf.find(START, pos, pos + MAX_HEADER)
        if at >= 0 and not buf[pos:at].strip():
            return at + len(START)
        return pos

    def _dangling(self, state: MuseState, header: str, out: _Out) -> None:
        """A header the output ended in (cut off by max_tokens): no message was opened; its text is content."""
        if not header.strip():
            return
        state.channel, state.target = BODY, self.unframed()
        self.deliver(state, header, out)
        state.channel = HEADER

    def _body(self, state: MuseState, buf: str, pos: int, final: bool, out: _Out) -> int:
        n = len(buf)
        while True:
            j = buf.find("<", pos)
            if j < 0:
                seg = buf[pos:]
                keep = 0 if final else _hold_len(seg)
                self.deliver(state, seg[:len(seg) - keep], out)
                state.held = seg[len(seg) - keep:]
                if final:
                    self.closed(state, "", out)
                    state.channel = HEADER
                return -1
            marker = next((m for m in BODY_MARKERS if buf.startswith(m, j)), None)
            if marker is None:
                if not final and n - j < len(MESSAGE) and any(m.startswith(buf[j:]) for m in BODY_MARKERS):
                    seg = buf[pos:j]
                    keep = _hold_len(seg)
                    self.deliver(state, seg[:len(seg) - keep], out)
                    state.held = seg[len(seg) - keep:] + buf[j:]
                    return -1
                self.deliver(state, buf[pos:j + 1], out)
                pos = j + 1
                continue
            seg = buf[pos:j]
            if marker == MESSAGE:
                tail = _HEADER_TAIL.search(seg, max(0, len(seg) - MAX_NAME - 3))
                head_at = tail.start() if tail is not None else len(seg)
                self.deliver(state, seg[:head_at], out)
                self.closed(state, "", out)
                state.target = self.target_of(tail.group(1) if tail is not None else None)
                self.opened(state, seg[head_at:] + MESSAGE, out)
                pos = j + len(MESSAGE)
                continue
            self.deliver(state, seg, out)
            self.closed(state, "" if marker == START else marker, out)
            state.channel = HEADER
            return j if marker == START else j + len(marker)


def _hold_len(seg: str) -> int:
    """How much of a body's end may still become a ``to=NAME`` header (once ``<|message|>`` follows)."""
    if "t" not in seg[-MAX_NAME - 3:]:
        return 0
    m = _MAYBE_TAIL.search(seg, max(0, len(seg) - MAX_NAME - 3))
    return len(seg) - m.start() if m is not None else 0


class MuseReasoningParser(MuseChannels, ThinkReasoningParser):
    """``--reasoning-parser muse``: reasoning messages out; every other message on to the Muse tool stage."""

    name = "muse"
    State = MuseState
    tool_stage: ClassVar[str] = "muse"  # the tool parser that reads what this stage passes on
    # no think tags: these spell no token, so the prompt's tail never says reasoning is open or closed
    start_tag = " to=self<|message|>"
    end_tag = "<|eom|><|start|>assistant to=user<|message|>"

    def __init__(self, config: ReasoningParserConfig = ReasoningParserConfig()) -> None:
        super().__init__(config)

    @classmethod
    def enable_thinking_from(cls, chat_template_kwargs: dict[str, Any] | None) -> bool:
        return True  # Muse always writes its channels (reasoning_strength sets how much it reasons)

    def initial_state(self) -> MuseState:
        return MuseState(mode=THINK_CONTENT)

    def target_of(self, recipient: str | None) -> MuseTarget:
        return REASONING if recipient in self.REASONING_RECIPIENTS else PASS

    def unframed(self) -> MuseTarget:
        return PASS

    def opened(self, state: MuseState, header: str, out: _Out) -> None:
        if state.target == PASS:
            out.text("content", header)

    def closed(self, state: MuseState, marker: str, out: _Out) -> None:
        if state.target == PASS:
            out.text("content", marker)

    def _dangling(self, state: MuseState, header: str, out: _Out) -> None:
        out.text("content", header)  # the tool stage decides

    def feed(self, state: ThinkState, text: str) -> list[TextPiece]:
        # (state is the MuseState initial_state made, or stream_state restored as State: no cast call per token)
        return self.run(state, text, final=False)  # type: ignore[arg-type, return-value]  # text pieces only

    def finish(self, state: ThinkState) -> list[TextPiece]:
        return self.run(_muse(state), "", final=True)  # type: ignore[return-value]


class MuseSparkReasoningParser(MuseReasoningParser):
    name = "musespark"  # upstream's alias of muse


class MuseGlimmerReasoningParser(MuseReasoningParser):
    """``--reasoning-parser muse_glimmer``: only ``to=self`` is reasoning."""

    name = "muse_glimmer"
    tool_stage = "muse_glimmer"
    REASONING_RECIPIENTS = ("self",)
    CONTENT_RECIPIENTS = (None, "user")
    DROPPED_RECIPIENTS = ()


def _muse(state: ThinkState) -> MuseState:
    return cast(MuseState, state)  # the state this parser's initial_state made (or stream_state restored as State)


MUSE_REASONING_PARSERS: dict[str, type[ThinkReasoningParser]] = {
    cls.name: cls for cls in (MuseReasoningParser, MuseSparkReasoningParser, MuseGlimmerReasoningParser)
}
