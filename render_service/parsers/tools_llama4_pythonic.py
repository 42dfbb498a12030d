"""llama4_pythonic: Llama 4's pythonic calls, ``[get_weather(city='Paris')]``, optionally wrapped in
``<|python_start|>`` ... ``<|python_end|>`` (Llama 4 sometimes writes those control tokens around the list).

The markers are removed wherever they appear (they are control tokens, never text the model means) and the
rest goes to the ``pythonic`` parser, whose rules then hold unchanged: tool mode when the output starts with
``[``, keyword arguments only, literals converted to JSON. Upstream strips ``<|python_start|>`` only at the
very start; a marker elsewhere would reach its Python parser and fail the whole list.

A call cut off by the end of output is closed here (``{}`` for a call with no arguments yet, the open string's
quote and the object's ``}`` otherwise), so its arguments are a JSON object (the first invariant of the
parser-hardening issue). The arguments streamed so far are followed with ``json_scan``'s depth and in-string
flags; once ``pythonic`` closes cut-off calls itself, this sees every object complete and adds nothing.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

from render_service.parsers.base import Piece, ToolCallPiece, ToolParserConfig
from render_service.parsers.json_scan import JsonScan, scan_json_value
from render_service.parsers.tags import find_tag
from render_service.parsers.tools_pythonic import PythonicState, PythonicToolParser

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
_MARKERS = (PYTHON_START, PYTHON_END)


class Llama4PythonicState(msgspec.Struct):
    held: str = ""  # a possible partial marker
    inner: PythonicState = msgspec.field(default_factory=PythonicState)
    call: int = -1  # the index of the last call that was named (-1: none yet)
    args: JsonScan = msgspec.field(default_factory=JsonScan)  # how far that call's arguments got

    def __post_init__(self) -> None:
        if len(self.held) >= len(PYTHON_START):
            raise ValueError("inconsistent tool parser state: held text longer than a marker")


class Llama4PythonicToolParser:
    name: ClassVar[str] = "llama4_pythonic"
    State: ClassVar[type[msgspec.Struct]] = Llama4PythonicState

    def __init__(self, config: ToolParserConfig) -> None:
        self.inner = PythonicToolParser(config)

    def initial_state(self) -> Llama4PythonicState:
        return Llama4PythonicState()

    def feed(self, state: Llama4PythonicState, text: str) -> list[Piece]:
        if not state.held and "<" not in text:  # the per-token common case: no marker can start here
            return self._follow(state, self.inner.feed(state.inner, text)) if text else []
        buf = state.held + text if state.held else text
        state.held = ""
        kept: list[str] = []
        pos = 0
        while True:
            at, tag = find_tag(buf, pos, _MARKERS)
            kept.append(buf[pos:at])
            if tag is None:
                state.held = buf[at:]
                break
            pos = at + len(tag)
        clean = "".join(kept)
        return self._follow(state, self.inner.feed(state.inner, clean)) if clean else []

    def finish(self, state: Llama4PythonicState) -> list[Piece]:
        held, state.held = state.held, ""
        pieces = self.inner.feed(state.inner, held) if held else []
        pieces = self._follow(state, pieces + self.inner.finish(state.inner))
        scan = state.args
        if state.call >= 0 and not scan.done:
            closing = "{}" if not scan.started else ('"' if scan.in_string else "") + "}" * max(scan.depth, 1)
            pieces.append(ToolCallPiece(index=state.call, arguments=closing))
            scan.done = True
        return pieces

    @staticmethod
    def _follow(state: Llama4PythonicState, pieces: list[Piece]) -> list[Piece]:
        """Track the last call's arguments (O(their new text)), to close it if the output stops inside it."""
        for p in pieces:
            if not isinstance(p, ToolCallPiece):
                continue
            if p.name is not None:
                state.call = p.index
                state.args = JsonScan()
            if p.arguments and p.index == state.call and not state.args.done:
                scan_json_value(state.args, p.arguments, 0, len(p.arguments), False)
        return pieces
