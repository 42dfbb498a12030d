"""Anthropic Messages bodies through the message memo (wire/message_memo.py), so that an agent resending its
conversation converts and prepares only the messages that are new.

``decode_messages_request`` decodes a body with its messages left as raw JSON and looks each one up by its bytes;
``messages.chat_messages`` then takes each message's chat messages as converted before (``AnthropicEntry.chat``,
memo entries themselves, so their prepared forms and the template's loop records carry over as a chat body's do),
and ``messages.chat_tools`` the tools likewise.
A message converts the same wherever it sits, except for which tool_use ids came before it: each conversion lists
the ids its tool_result blocks name, and the request checks them against the ids of the messages before. Anything
else (a message that does not convert, a system-role message, an id not seen before) goes the plain way, so every
error is the plain path's, word for word.

Recent bodies are filed in the body store with what their messages converted to (apis/converted_memo.py): a body
that starts with a filed one takes those messages without scanning them, their chat messages and tool_use ids as
that body's render left them, and their prepared forms through the chat messages filed with it, so a growing
conversation converts and walks only its new messages.
"""

from __future__ import annotations

from typing import Any

import msgspec

from render_service.apis.converted_memo import ConvertedItems, decode_items
from render_service.apis.messages_protocol import MessagesRequest
from render_service.wire.message_memo import MemoEntry, MessageMemo

_API = "anthropic messages"  # the body store's name for these bodies
_KIND = "anthropic message"
_FIELDS = msgspec.structs.fields(MessagesRequest)
assert _FIELDS[0].name == "messages"

_TOOLS_KIND = "anthropic tools"
_NULL = msgspec.Raw(b"null")

# MessagesRequest with its messages and tools left as raw JSON; every other field as it is there.
_RawMessagesRequest = msgspec.defstruct(
    "_RawMessagesRequest",
    [("messages", list[msgspec.Raw])]
    + [(f.name, msgspec.Raw, _NULL) if f.name == "tools" else (f.name, f.type, f.default) for f in _FIELDS[1:]],
    kw_only=True,
    rename={f.name: f.encode_name for f in _FIELDS},
    forbid_unknown_fields=MessagesRequest.__struct_config__.forbid_unknown_fields,
)
_decode_raw_request = msgspec.json.Decoder(_RawMessagesRequest).decode
_decode_message = msgspec.json.Decoder(_FIELDS[0].type.__args__[0]).decode  # one element of ``messages``
_decode_tools = msgspec.json.Decoder(next(f.type for f in _FIELDS if f.name == "tools")).decode


class _ConvertedEntry(MemoEntry):
    """An Anthropic value's entry that also keeps, once a request converted it, the memo entries of what it
    converts to (``chat``), released with it."""

    __slots__ = ("chat",)

    def __init__(self, data: bytes, value: Any) -> None:
        super().__init__(data, value)
        self.chat: tuple[MemoEntry, ...] | None = None
        self.size *= 2  # what it converts to holds about as much again

    def keep(self, chat: tuple[MemoEntry, ...]) -> None:
        """Keeps a conversion. Two lanes may both convert the value: the first kept stays, since a render may
        already hold its entries (and have them lend ``tojson`` texts, taken back only through this entry)."""
        if self.chat is None:
            self.chat = chat

    def release(self) -> None:
        super().release()
        for entry in self.chat or ():
            entry.release()


class AnthropicEntry(_ConvertedEntry):
    """One Anthropic message: its JSON, its decoded value and, once a request converted it, its chat messages
    (``chat``), the tool_use ids its tool_result blocks name (``needs``) and those of its tool_use blocks
    (``adds``)."""

    __slots__ = ("needs", "adds")

    def __init__(self, data: bytes) -> None:
        super().__init__(data, _decode_message(data))
        self.needs: frozenset[str] = frozenset()
        self.adds: frozenset[str] = frozenset()

    def converted(self, chat: list[dict[str, Any]], needs: list[str]) -> None:
        adds = frozenset(call["id"] for message in chat for call in message.get("tool_calls") or ())
        if self.chat is None:  # (set before ``chat``: whoever sees the conversion sees its ids)
            self.needs, self.adds = frozenset(needs), adds
        self.keep(tuple(MemoEntry(b"", message) for message in chat))


class AnthropicToolsEntry(_ConvertedEntry):
    """A tools array: its JSON, its decoded value and, once a request converted it, the chat tools' entry
    (``chat``, one; its prepared form kept as a chat body's tools keep theirs)."""

    __slots__ = ()

    def __init__(self, data: bytes) -> None:
        super().__init__(data, _decode_tools(data))

    def converted(self, chat: list[dict[str, Any]]) -> None:
        self.keep((MemoEntry(b"", chat),))


class MemoAnthropicTools(list[Any]):
    """``MessagesRequest.tools`` decoded through the memo: shared values (read-only), with their entry."""

    __slots__ = ("entry",)

    def __init__(self, entry: AnthropicToolsEntry) -> None:
        super().__init__(entry.value)
        self.entry = entry


def decode_messages_request(body: bytes, memo: MessageMemo | None) -> MessagesRequest | None:
    """The request ``msgspec.json.decode(body, type=MessagesRequest)`` gives, its messages from the memo where
    seen before; None without a memo or where anything fails to decode (the caller decodes the usual way, for the
    error)."""
    if memo is None:
        return None
    try:
        raw, entries, messages, found, filed = decode_items(body, memo, _API, _KIND, AnthropicEntry,
                                                            _decode_raw_request, "messages")
        tools: Any = None if raw.tools == _NULL else memo.entries_by_bytes(_TOOLS_KIND, [raw.tools],
                                                                             AnthropicToolsEntry)[0]
    except (msgspec.DecodeError, RecursionError):
        return None
    values = msgspec.structs.asdict(raw)
    values["messages"] = ConvertedItems(entries, messages, memo, found, filed)
    values["tools"] = None if tools is None or tools.value is None else MemoAnthropicTools(tools)
    return MessagesRequest(**values)
