"""llama4_pythonic: Llama 4's pythonic calls, ``[get_weather(city='Paris')]``, optionally wrapped in
``<|python_start|>`` ... ``<|python_end|>`` (Llama 4 sometimes writes those control tokens around the list).

The markers are removed wherever they appear (they are control tokens, never text the model means) and the
rest goes to the ``pythonic`` parser, whose rules then hold unchanged: tool mode when the output starts with
``[``, keyword arguments only, literals converted to JSON. Upstream strips ``<|python_start|>`` only at the
very start; a marker elsewhere would reach its Python parser and fail the whole list.

Both invariants of the parser-hardening issue come from ``pythonic`` (a cut-off call is closed there).
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

from render_service.parsers.base import Piece, ToolParserConfig
from render_service.parsers.tags import find_tag
from render_service.parsers.tools_pythonic import PythonicState, PythonicToolParser

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
_MARKERS = (PYTHON_START, PYTHON_END)


class Llama4PythonicState(msgspec.Struct):
    held: str = ""  # a possible partial marker
    inner: PythonicState = msgspec.field(default_factory=PythonicState)

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
            return self.inner.feed(state.inner, text) if text else []
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
        return self.inner.feed(state.inner, clean) if clean else []

    def finish(self, state: Llama4PythonicState) -> list[Piece]:
        held, state.held = state.held, ""
        pieces = self.inner.feed(state.inner, held) if held else []
        return pieces + self.inner.finish(state.inner)
