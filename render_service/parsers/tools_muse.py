"""muse, musespark (an alias), muse_glimmer: calls in ATEM markup inside a message to a tool.

    <|start|>assistant to=get_weather<|message|><atem:function_calls>
    <atem:invoke name="get_weather">
    <atem:parameter name="city">Paris</atem:parameter>
    <atem:parameter name="days">3</atem:parameter>
    </atem:invoke>
    </atem:function_calls><|eom|>

The messages are read by ``muse_channels`` (which recipient goes where); a tool message's body is read by the XML
engine. Values keep every character (Muse's template: "spaces for string values are not stripped"). ``muse``:
a value is typed by the tool's schema, one the schema does not declare is JSON when it parses (else its text);
``muse_glimmer`` keeps upstream's older rule, every value JSON when it parses. An invoke name that doubles a
declared bare name (``get_weather.get_weather``: the template advertises a bare tool as ``get_weather.*``) is
that tool, as upstream's. Calls are read only from tool messages, so a call quoted in reasoning or in the answer
is text.
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

import msgspec

from render_service.parsers.base import Piece, ToolParserConfig
from render_service.parsers.muse_channels import CALL, MuseChannels, MuseState, _Out
from render_service.parsers.tools_xml import XmlCallState, XmlFormat, XmlToolParser

ATEM_FORMAT = XmlFormat(
    block_open="<atem:function_calls>",
    block_end="</atem:function_calls>",
    call_open="<atem:invoke name=",
    head_ends=(">",),
    head_consumed=(">",),
    call_end="</atem:invoke>",
    key_open="<atem:parameter name=",
    key_end=">",
    value_open=None,
    value_end="</atem:parameter>",
    trim="none",
    undeclared="json",
    bare_call_open=True,  # upstream reads an invoke without the function_calls block too
    quoted_names=True,
)


class AtemCallsParser(XmlToolParser):
    name: ClassVar[str] = "muse_atem"
    FORMAT: ClassVar[XmlFormat] = ATEM_FORMAT

    def _call_name(self, name: str) -> str:
        # a bare tool is advertised as recipient "NAME.*", so the model may invoke NAME.NAME; another spelling
        # is passed on as written (matching a leaf alone could call the wrong tool)
        if not self.tools or name in self.tools:
            return name
        head, dot, tail = name.partition(".")
        return head if dot and head == tail and head in self.tools else name


class AtemGlimmerCallsParser(AtemCallsParser):
    name: ClassVar[str] = "muse_glimmer_atem"

    def _types(self, state: XmlCallState) -> frozenset[str] | None:
        return None  # every value JSON when it parses, whatever the schema says (upstream's older rule)


class MuseToolState(MuseState, omit_defaults=True):
    calls: XmlCallState = msgspec.field(default_factory=XmlCallState)


class MuseToolParser(MuseChannels):
    """``--tool-call-parser muse``: the messages' bodies as content, reasoning (when no reasoning stage took it
    out first) and calls."""

    name: ClassVar[str] = "muse"
    State: ClassVar[type[msgspec.Struct]] = MuseToolState
    CALLS: ClassVar[type[AtemCallsParser]] = AtemCallsParser
    channel_stage: ClassVar[bool] = True  # the pipeline runs it after a Muse reasoning stage, calls or not

    def __init__(self, config: ToolParserConfig | None = None, calls: bool = True) -> None:
        self.config = config or ToolParserConfig()
        self.calls = self.CALLS(self.config) if calls else None

    def initial_state(self) -> MuseToolState:
        return MuseToolState()

    def body_text(self, state: MuseState, text: str) -> list[Piece]:
        if state.target == CALL and self.calls is not None:
            return self.calls.feed(state.calls, text)  # type: ignore[attr-defined]  # the per-token case in a call
        return super().body_text(state, text)

    def deliver(self, state: MuseState, text: str, out: _Out) -> None:
        if state.target == CALL and self.calls is not None:
            out.extend(self.calls.feed(_tool_state(state).calls, text))
        else:
            super().deliver(state, text, out)

    def closed(self, state: MuseState, marker: str, out: _Out) -> None:
        if state.target == CALL and self.calls is not None:
            out.extend(self.calls.finish(_tool_state(state).calls))  # a call ends with its message

    def feed(self, state: Any, text: str) -> list[Piece]:
        return self.run(state, text, final=False)  # (a MuseToolState: no cast call per token)

    def finish(self, state: Any) -> list[Piece]:
        return self.run(_tool_state(state), "", final=True)


class MuseSparkToolParser(MuseToolParser):
    name: ClassVar[str] = "musespark"  # upstream's alias of muse


class MuseGlimmerToolParser(MuseToolParser):
    """``--tool-call-parser muse_glimmer``: only ``to=self`` is reasoning; no recipient and ``user`` are content;
    every other recipient is a tool."""

    name: ClassVar[str] = "muse_glimmer"
    CALLS: ClassVar[type[AtemCallsParser]] = AtemGlimmerCallsParser
    REASONING_RECIPIENTS = ("self",)
    CONTENT_RECIPIENTS = (None, "user")
    DROPPED_RECIPIENTS = ()


def _tool_state(state: Any) -> MuseToolState:
    return cast(MuseToolState, state)  # the state initial_state made (or stream_state restored as State)
