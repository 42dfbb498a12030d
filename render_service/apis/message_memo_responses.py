"""Responses bodies through the body store (apis/converted_memo.py), so that an agent resending its whole input every
turn (stateless, as Codex does with ``store: false``) converts and prepares only its new items.

``decode_responses_request`` decodes a body of 32 KiB or more with its ``input`` items left as raw JSON, takes the
items a recent body shares from the body store and decodes the others one by one. Items fold into chat messages (a
reasoning item, an assistant message and function calls make one assistant turn), so an item converts the same
only where what came before it is the same: ``responses.remembered_input_messages`` takes the chat messages of the
shared items up to the last one after which no assistant turn was open, as that body's render made them, with the
call ids they hold, and converts the rest. A conversation's first body is only filed (its items go the plain way);
a shorter body, an input given as a string, or anything that does not convert goes the plain way too, so every
error is the plain path's, word for word.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import msgspec

from render_service.apis.converted_memo import ConvertedItems, decode_items
from render_service.apis.responses_protocol import ResponsesRequest
from render_service.wire.message_memo import MemoEntry, MessageMemo

_API = "responses"  # the body store's name for these bodies
_FIELDS = msgspec.structs.fields(ResponsesRequest)

# ResponsesRequest with its input items left as raw JSON; every other field as it is there.
_RawResponsesRequest = msgspec.defstruct(
    "_RawResponsesRequest",
    [("input", str | list[msgspec.Raw] | None, None) if f.name == "input" else (f.name, f.type, f.default)
     for f in _FIELDS],
    kw_only=True,
    rename={f.name: f.encode_name for f in _FIELDS},
    forbid_unknown_fields=ResponsesRequest.__struct_config__.forbid_unknown_fields,
)
_decode_raw_request = msgspec.json.Decoder(_RawResponsesRequest).decode
_decode_item = msgspec.json.Decoder().decode  # one input item, as ``input: list[Any]`` decodes it


_NO_FORMS: Mapping[str, Any] = MappingProxyType({})


class _ItemEntry(MemoEntry):
    """An input item as filed with its body: its JSON and its value. Items are never prepared for a template (their
    chat messages are) and their tool calls and images are never counted (the filed chat messages' are), so an entry
    is one object more than the value: a cold 128k body has hundreds of items, and every object made is one more for
    the collector to walk."""

    __slots__ = ()

    def __init__(self, data: bytes) -> None:  # (MemoEntry's own fields, without its per-entry dict and list)
        self.data = data
        self.value = _decode_item(data)
        self.prepared = _NO_FORMS  # type: ignore[assignment]
        self.lent = ()  # type: ignore[assignment]
        self.tool_calls = 0
        self.images = False
        self.size = 0


def decode_responses_request(body: bytes, memo: MessageMemo | None) -> ResponsesRequest | None:
    """The request ``msgspec.json.decode(body, type=ResponsesRequest)`` gives, its input items from the memo where
    seen before; None without a memo or where anything fails to decode (the caller decodes the usual way, for the
    error)."""
    if memo is None or memo.bodies is None or len(body) < memo.bodies.base:
        return None  # (too short to be filed or to find a filed body: nothing the memo would take)
    try:
        # (the items' entries in no memo: an item converts the same only after the same items, so what is kept
        # for them is kept with the body)
        raw, entries, items, found, filed = decode_items(body, memo, _API, None, _ItemEntry, _decode_raw_request,
                                                         "input")
    except (msgspec.DecodeError, RecursionError):
        return None
    values = msgspec.structs.asdict(raw)
    if isinstance(raw.input, list):
        # Only a conversation seen before takes the memo's conversion: for a body that shares no filed body's items
        # it would make chat messages and loop records that only a turn matching this body's filing could use,
        # and an API whose clients may write fields before ``input`` that change every turn may never match.
        # Its items go the plain way (filed, where long enough, for the next turn).
        values["input"] = ConvertedItems(entries, items, memo, found, filed) if found is not None else list(items)
    return ResponsesRequest(**values)
