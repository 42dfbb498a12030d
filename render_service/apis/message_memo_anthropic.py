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

Recent bodies are filed in the body store as chat bodies are (wire/body_prefix_store.py, under their own API), with
what their messages converted to (``ChatConversion``): a body that starts with a filed one takes those messages
without scanning them, their chat messages and tool_use ids as that body's render left them, and their prepared
forms through the chat messages filed with it, so a growing conversation converts and walks only its new messages.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from render_service.apis.messages_protocol import MessagesRequest
from render_service.wire.body_prefix_store import StoredBody
from render_service.wire.message_memo import MemoEntry, MemoMessages, MessageMemo, entry_counts

_API = "anthropic messages"  # the body store's name for these bodies
_KIND = "anthropic message"
_SYSTEM_KIND = "anthropic system prompt"
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


class ChatConversion(NamedTuple):
    """What a filed Messages body's messages converted to: its chat messages filed as a chat body's are (no body:
    their prepared forms follow from turn to turn), how many of them the system prompt and the messages up to each
    one's end make, the tool_use ids of all its messages, and the system prompt's entry (None: none)."""

    chat: StoredBody
    ends: tuple[int, ...]
    known: frozenset[str]
    system: MemoEntry | None


class MemoAnthropicMessages(list[Any]):
    """``MessagesRequest.messages`` decoded through the memo: shared values (read-only), with their entries;
    ``shared_with``: the filed body whose first messages these are, and how many; ``filed``: this body as filed
    for the next turn (each None where there is none)."""

    __slots__ = ("entries", "memo", "shared_with", "filed")

    def __init__(self, entries: list[AnthropicEntry], values: tuple[Any, ...], memo: MessageMemo,
                 shared_with: tuple[StoredBody, int] | None = None, filed: StoredBody | None = None) -> None:
        super().__init__(values)
        self.entries = entries
        self.memo = memo
        self.shared_with = shared_with
        self.filed = filed

    def system_entry(self, text: str) -> MemoEntry:
        """The chat system message of this prompt text, the same object every turn that sends it (the loop
        records of the template compare messages by identity)."""
        data = text.encode()
        return self.memo.entries_by_bytes(_SYSTEM_KIND, [data], lambda _: MemoEntry(
            data, {"role": "system", "content": text}))[0]

    def earlier_conversion(self, system: MemoEntry | None) -> tuple[ChatConversion, int] | None:
        """The conversion of the filed body these messages start with, and how many of its messages they share,
        where its chat messages start with the same system prompt (None: none to take)."""
        if self.shared_with is None:
            return None
        stored, common = self.shared_with
        conversion = (stored.converted or {}).get("chat")
        if conversion is None or conversion.system is not system:
            return None
        return conversion, common

    def file_conversion(self, chat: list[MemoEntry], ends: list[int], known: set[str], system: MemoEntry | None,
                        shared: tuple[StoredBody, int] | None) -> MemoMessages:
        """The chat messages as ``MemoMessages``, filed with this body (where it was) for the next turn.
        ``shared``: the earlier conversion's chat messages these start with, and how many."""
        values = tuple(entry.value for entry in chat) if shared is None else \
            shared[0].values[:shared[1]] + tuple(entry.value for entry in chat[shared[1]:])
        whole = shared[0] if shared is not None and shared[1] == len(shared[0].entries) else None
        filed = StoredBody(b"", (), (), tuple(chat), {}, values, *entry_counts(chat, whole))
        if self.filed is not None and self.filed.converted is not None:
            self.filed.converted["chat"] = ChatConversion(filed, tuple(ends), frozenset(known), system)
        return MemoMessages(chat, values, shared, filed)


def decode_messages_request(body: bytes, memo: MessageMemo | None) -> MessagesRequest | None:
    """The request ``msgspec.json.decode(body, type=MessagesRequest)`` gives, its messages from the memo where
    seen before; None without a memo or where anything fails to decode (the caller decodes the usual way, for the
    error)."""
    if memo is None:
        return None

    def entries_of(items: list[msgspec.Raw]) -> list[Any]:
        return memo.entries_by_bytes(_KIND, items, AnthropicEntry)

    bodies = memo.bodies if type(body) is bytes else None
    try:
        found = bodies.find(body, _API) if bodies is not None else None
        decoded = memo.decode_after(body, *found, _decode_raw_request, entries_of) if found is not None else None
        tail_start = 0
        if decoded is None:
            found = None
            raw: Any = _decode_raw_request(body)
            entries: list[Any] = entries_of(raw.messages)
        else:
            raw, entries, tail_start = decoded
        tools: Any = None if raw.tools == _NULL else memo.entries_by_bytes(_TOOLS_KIND, [raw.tools],
                                                                             AnthropicToolsEntry)[0]
    except (msgspec.DecodeError, RecursionError):
        return None
    if found is not None and len(found[0].values) >= found[1]:
        messages = found[0].values[:found[1]] + tuple(entry.value for entry in entries[found[1]:])
    else:
        messages = tuple(entry.value for entry in entries)
    filed = memo.keep_body(body, raw, entries, messages, found, tail_start, _API) if bodies is not None else None
    values = msgspec.structs.asdict(raw)
    values["messages"] = MemoAnthropicMessages(entries, messages, memo, found, filed)
    values["tools"] = None if tools is None or tools.value is None else MemoAnthropicTools(tools)
    return MessagesRequest(**values)
