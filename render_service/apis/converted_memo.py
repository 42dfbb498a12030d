"""Another API's request bodies through the message memo and the body store, converted to chat messages once.

An Anthropic Messages or Responses body holds its conversation as an array of its own items (messages, input
items), which the render converts to chat messages. ``decode_items`` decodes such a body with the array left as
raw JSON, takes each item's entry from the memo by its bytes where the API keeps its items there
(wire/message_memo.py) and, for a body that starts with a recent one, the items the two share from the body store
without scanning them (wire/body_prefix_store.py, under the API's own name, so that one API's filed bodies are never
read as another's); the body is filed for the next turn. ``ConvertedItems`` is the decoded array: the items'
values, their entries, and what the filed body it shares items with converted them to (``ChatConversion``), so
that the conversion of a growing conversation walks only its new items, and hands the template the same chat
message objects every turn (their prepared forms and the loop's records carry over as a chat body's do).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec

from render_service.wire.body_prefix_store import StoredBody
from render_service.wire.message_memo import MemoEntry, MemoMessages, MessageMemo, entry_counts

_SYSTEM_KIND = "converted system prompt"


class ChatConversion(NamedTuple):
    """What a filed body's items converted to: its chat messages filed as a chat body's are (no body: their
    prepared forms follow from turn to turn), how many of them there are after each item (-1 where the item left a
    chat message open, so that the next item could still change it), the tool call ids its items hold, and the
    system prompt's entry the chat messages start with (None: none)."""

    chat: StoredBody
    ends: tuple[int, ...]
    known: frozenset[str]
    system: MemoEntry | None


class ConvertedItems(list[Any]):
    """An API's item array decoded through the memo: shared values (read-only), with their entries;
    ``shared_with``: the filed body whose first items these are, and how many; ``filed``: this body as filed for
    the next turn (each None where there is none)."""

    __slots__ = ("entries", "memo", "shared_with", "filed")

    def __init__(self, entries: list[Any], values: tuple[Any, ...], memo: MessageMemo,
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
        """The conversion of the filed body these items start with, and how many of its items they share, where
        its chat messages start with the same system prompt (None: none to take)."""
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


def decode_items(body: bytes, memo: MessageMemo, api: str, kind: str | None, make: Callable[[bytes], MemoEntry],
                 decode_raw: Callable[[bytes], Any], field: str
                 ) -> tuple[Any, list[Any], tuple[Any, ...], tuple[StoredBody, int] | None, StoredBody | None]:
    """``body`` decoded by ``decode_raw`` with its item array ``field`` as raw JSON, each item's memo entry
    (under ``kind``, made by ``make`` where new; with no ``kind``, made by ``make`` and kept only with the filed
    body), their values, the filed body it shares items with and how many (or None), and the body as filed for the
    next turn (or None). Raises ``msgspec.DecodeError`` (or ``RecursionError``) where it does not decode."""
    def entries_of(items: list[msgspec.Raw]) -> list[Any]:
        if kind is None:
            return [make(bytes(item)) for item in items]
        return memo.entries_by_bytes(kind, items, make)

    raw, entries, values, found, tail_start = memo.decode_items(body, api, decode_raw, entries_of, field)
    return raw, entries, values, found, memo.keep_body(body, raw, entries, values, found, tail_start, api, field)
