"""A request's ``response_format`` (or its ``structured_outputs``) as the structured-outputs constraint render
puts on the engine request, as vLLM translates it; Harmony's render and the chat/completion render share it."""

from __future__ import annotations

import json
from typing import Any

from render_service.http.errors import bad_request
from render_service.wire.protocol import ChatCompletionRequest, CompletionRequest


def requested_structured_outputs(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any] | None:
    """The structured-outputs constraint the request asks for: ``structured_outputs`` as given, else its
    ``response_format`` as vLLM translates it (None: unconstrained)."""
    if req.structured_outputs is not None:
        return req.structured_outputs
    fmt = req.response_format
    if not fmt:
        return None
    kind = fmt.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema") or {}
        if not isinstance(spec, dict):
            raise bad_request("response_format.json_schema must be an object", "response_format")
        schema = spec.get("schema")
        if schema is None:
            raise bad_request("response_format.json_schema.schema is required", "response_format")
        return {"json": schema}
    if kind == "structural_tag":
        return {"structural_tag": _structural_tag_text(fmt)}
    if kind in (None, "text"):
        return None
    raise bad_request(f"Unsupported response_format type {kind!r}", "response_format")


def _structural_tag_text(fmt: dict[str, Any]) -> str:
    """A ``structural_tag`` response format as vLLM passes it on (``json.dumps`` of its model): the legacy
    ``structures``/``triggers`` form, else xgrammar's ``format``. The engine compiles (or refuses) it."""
    invalid = bad_request("Invalid response_format structural_tag specification.", "response_format")
    structures, triggers = fmt.get("structures"), fmt.get("triggers")
    if structures is not None or triggers is not None:
        if not isinstance(structures, list) or not isinstance(triggers, list) \
                or not all(isinstance(t, str) for t in triggers) \
                or not all(isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
                           and isinstance(s.get("schema"), dict) for s in structures):
            raise invalid
        legacy = [{"begin": s["begin"], "schema": s["schema"], "end": s["end"]} for s in structures]
        return json.dumps({"type": "structural_tag", "structures": legacy, "triggers": triggers})
    if "format" not in fmt:
        raise invalid
    return json.dumps({"type": "structural_tag", "format": fmt["format"]})
