"""llama4_pythonic: Llama 4's pythonic calls, ``[get_weather(city='Paris')]``, optionally wrapped in
``<|python_start|>`` ... ``<|python_end|>`` (Llama 4 sometimes writes those control tokens around the list).

The markers are removed wherever they appear (they are control tokens, never text the model means) and the
rest goes to the ``pythonic`` parser, whose rules then hold unchanged: tool mode when the output starts with
``[``, keyword arguments only, literals converted to JSON. Upstream strips ``<|python_start|>`` only at the
very start; a marker elsewhere would reach its Python parser and fail the whole list.

Both invariants of the parser-hardening issue come from ``pythonic`` (a cut-off call is closed there).
"""

from __future__ import annotations

from typing import Any, ClassVar

from render_service.parsers.tools_pythonic import PythonicToolParser
from render_service.parsers.tools_wrapped import DroppedMarkersToolParser

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"


class Llama4PythonicToolParser(DroppedMarkersToolParser):
    name: ClassVar[str] = "llama4_pythonic"
    DROPPED: ClassVar[tuple[str, ...]] = (PYTHON_START, PYTHON_END)
    INNER: ClassVar[Any] = PythonicToolParser
