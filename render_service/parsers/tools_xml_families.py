"""More families on the shared XML engine (``tools_xml``): each is its tags, declared.

* ``poolside_v1``: GLM-4.5's markup exactly (``<tool_call>NAME`` ``<arg_key>K</arg_key><arg_value>V</arg_value>``
  ``</tool_call>``); values typed by the schema, undeclared ones read as JSON/Python literals, as upstream.
"""

from __future__ import annotations

from typing import ClassVar

from render_service.parsers.tools_glm import Glm45ToolParser


class PoolsideV1ToolParser(Glm45ToolParser):
    name: ClassVar[str] = "poolside_v1"
