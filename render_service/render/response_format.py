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
        return {"json": json_schema_format(fmt.get("json_schema") or {}, "response_format.json_schema",
                                           "response_format")}
    if kind == "structural_tag":
        return {"structural_tag": _structural_tag_text(fmt)}
    if kind in (None, "text"):
        return None
    raise bad_request(f"Unsupported response_format type {kind!r}", "response_format")


def json_schema_format(spec: Any, field: str, param: str) -> dict[str, Any]:
    """The schema of a ``json_schema`` format, its fields checked as vLLM checks them (its request model for chat,
    openai's ``ResponseFormatTextJSONSchemaConfig`` for Responses): a string ``name``, an object ``schema``,
    ``description`` a string and ``strict`` a boolean where given. ``field`` names the format in the 400's
    message (``response_format.json_schema``, ``text.format``), ``param`` is its request parameter."""
    if not isinstance(spec, dict):
        raise bad_request(f"{field} must be an object", param)
    if not isinstance(spec.get("name"), str):
        raise bad_request(f"{field}.name is required and must be a string", param)
    schema = spec.get("schema")
    if schema is None:
        raise bad_request(f"{field}.schema is required", param)
    if not isinstance(schema, dict):
        raise bad_request(f"{field}.schema must be an object", param)
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise bad_request(f"{field}.description must be a string", param)
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise bad_request(f"{field}.strict must be a boolean", param)
    return schema


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
