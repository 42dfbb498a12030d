"""Chat messages and tools remembered by their raw JSON bytes, so that a turn decodes and prepares only what is new.

Agents resend their whole conversation every turn: all messages but the last few, and the tools, come back as
the same bytes. ``MessageMemo.decode_chat`` decodes a chat body with each message and the tools array left as raw
JSON (``msgspec.Raw``, a scan without building objects), then looks each one up by its bytes: a hit gives the
message as decoded before (and, through ``chat_messages.prepare_messages``/``prepare_tools``, its prepared form for
a content format), a miss decodes that message alone with the same type as ``ChatCompletionRequest.messages``.

- The key is the length and the first and last bytes (cheap; hashing the whole text would cost about as much as
  decoding it), and a hit is confirmed by comparing all the bytes: a key shared by different bytes is a miss.
- Anything that fails (bad JSON, a message that is not an object, a field of the wrong type) answers None, and
  the caller decodes the body as before: every error is today's, word for word, whatever order it comes in.
- What a hit hands out is shared between requests and threads: nothing downstream may change it (the chat
  templates run in an immutable sandbox; render/render.py, templates/chat_messages.py and templates/chat_template.py
  copy before they change).
- Bounded by an estimate of its bytes (a share of --render-cache-bytes, caches/budget.py), least recently used
  dropped first; the two render lanes share it (http/render_queue.py).
- With ``body_bytes``, recent bodies are kept with where each message sits (body_prefix_store.py): a body that
  starts with one of them takes its messages without the scan, and only the rest is decoded.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from render_service.caches.byte_lru import ByteLRU
from render_service.templates.tojson_cache import DEFAULT_TEXTS
from render_service.wire.body_prefix_store import BodyStore, StoredBody, element_offsets, skip_whitespace
from render_service.wire.protocol import ChatCompletionRequest

# Estimated bytes of an entry: its raw bytes, the decoded message and its prepared form(s) (strings mostly shared
# between the two), and the entry's own objects. Measured on agent traces: about 5x the JSON (tests check it).
BYTES_PER_JSON_BYTE = 5
ENTRY_OVERHEAD = 1024
# How many bytes of each end of the JSON the key holds: ids and text differ there between messages (the head is
# long enough to hold an assistant message's first tool call id whatever the key order). Messages alike in length
# and at both ends are told apart by their bytes, but take turns in the key's one place.
KEY_HEAD_BYTES = 128
KEY_TAIL_BYTES = 64

_MESSAGE, _TOOLS = 0, 1
_FIELDS = msgspec.structs.fields(ChatCompletionRequest)
_TOOLS_AT = [f.name for f in _FIELDS].index("tools")
assert _FIELDS[0].name == "messages"

# ChatCompletionRequest with its messages and tools left as raw JSON; every other field as it is there (same
# types, defaults and names), so that the two decode a body alike.
_RawChatRequest = msgspec.defstruct(
    "_RawChatRequest",
    [("messages", list[msgspec.Raw])]
    + [(f.name, msgspec.Raw, msgspec.Raw(b"null")) if f.name == "tools" else (f.name, f.type, f.default)
       for f in _FIELDS[1:]],
    rename={f.name: f.encode_name for f in _FIELDS},
    forbid_unknown_fields=ChatCompletionRequest.__struct_config__.forbid_unknown_fields,
)
_decode_raw_request = msgspec.json.Decoder(_RawChatRequest).decode
_DECODERS = {
    _MESSAGE: msgspec.json.Decoder(_FIELDS[0].type.__args__[0]).decode,  # one element of ``messages``
    _TOOLS: msgspec.json.Decoder(_FIELDS[_TOOLS_AT].type).decode,
}
_astuple = msgspec.structs.astuple
_VALUE = operator.attrgetter("value")
_TOOL_CALLS = operator.attrgetter("tool_calls")
_IMAGES = operator.attrgetter("images")
# The part types that carry an image in the three APIs' messages (multimodal.sources reads them)
IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image"})
_NULL = msgspec.Raw(b"null")


class MemoEntry:
    """One message (or tools array): its JSON, its decoded value, and its prepared forms by content format (or
    ``"tools"``), filled in by templates/chat_messages.py as renders ask for them. Read-only once handed out."""

    __slots__ = ("data", "value", "prepared", "size", "lent", "tool_calls", "images", "checks")

    def __init__(self, data: bytes, value: Any) -> None:
        self.data = data
        self.value = value
        # (what every turn asks of all its messages: a response's parse context counts the tool calls, the
        # server looks for image parts)
        self.tool_calls = tool_call_count(value)
        self.images = has_image_parts(value)
        self.prepared: dict[str, Any] = {}
        self.size = ENTRY_OVERHEAD + BYTES_PER_JSON_BYTE * len(data)
        self.lent: list[Any] = []  # values of its prepared forms whose tojson text is kept (tojson_cache.lend)
        # the checks this message passed, by name, where what a check refuses depends on the message alone (a
        # renderer that validates every message it is sent checks a resent one once: harmony/render.py)
        self.checks: tuple[str, ...] = ()

    def lend(self, value: Any) -> None:
        """Keeps the ``tojson`` text of ``value`` (a part of a prepared form) while this entry is kept."""
        if DEFAULT_TEXTS.lend(value):
            self.lent.append(value)

    def release(self) -> None:
        """Dropped from the memo: the texts it lent are taken back (their values may be let go now)."""
        for value in self.lent:
            DEFAULT_TEXTS.unlend(value)
        self.lent = []


class KeptEntry(MemoEntry):
    """A message that did not come through the memo (a Messages or Responses request's, converted; a chat body
    decoded whole), given an entry so that a turn sending only its new messages can share its prepared form with
    the next turn as the memo's are shared (extend/history.py). It is in no memo, so it keeps no ``tojson`` text:
    nothing would take it back."""

    __slots__ = ()

    def __init__(self, value: Any) -> None:
        super().__init__(b"", value)

    def lend(self, value: Any) -> None:
        return None


def tool_call_count(message: Any) -> int:
    """The tool calls of an assistant message (vLLM's ``history_tool_call_cnt`` adds them up); 0 for anything
    else."""
    if isinstance(message, dict) and message.get("role") == "assistant" and isinstance(message.get("tool_calls"),
                                                                                       list):
        return len(message["tool_calls"])
    return 0


def has_image_parts(message: Any) -> bool:
    """Whether a message's content holds an image part (``image_url``, Responses' ``input_image``, Anthropic's
    ``image``)."""
    content = message.get("content") if isinstance(message, Mapping) else None
    return isinstance(content, list) and any(isinstance(part, Mapping) and _is_image_type(part.get("type"))
                                             for part in content)


def _is_image_type(kind: Any) -> bool:
    # (a client's part type may be any JSON value: a list or object is no type, and no image)
    return isinstance(kind, str) and kind in IMAGE_PART_TYPES


def carries_image_parts(messages: list[Any]) -> bool:
    """Whether any of ``messages`` holds an image part: as their filed body counts them, else as each memo entry
    says where they came through the memo (an agent's turn need not look at every earlier message)."""
    if type(messages) is MemoMessages:
        filed = messages.filed
        if filed is not None and filed.image_messages >= 0:
            return filed.image_messages > 0
        return any(map(_IMAGES, messages.entries))
    return any(map(has_image_parts, messages))


def history_tool_calls(messages: list[Any]) -> int:
    """The tool calls of all of ``messages``: as their filed body counts them, else counted once per memo entry
    where they came through the memo."""
    if type(messages) is MemoMessages:
        filed = messages.filed
        if filed is not None and filed.tool_calls >= 0:
            return filed.tool_calls
        return sum(map(_TOOL_CALLS, messages.entries))
    return sum(map(tool_call_count, messages))


def entry_counts(entries: Sequence[MemoEntry], kept: StoredBody | None = None) -> tuple[int, int]:
    """The tool calls of ``entries`` and how many hold an image part. ``kept``: a filed body whose messages are
    the first of ``entries``; where it counted its own, only the entries after them are walked (a growing turn
    adds only its new messages')."""
    if kept is not None and kept.tool_calls >= 0 and kept.image_messages >= 0:
        added = entries[len(kept.entries):]
        return kept.tool_calls + sum(map(_TOOL_CALLS, added)), kept.image_messages + sum(map(_IMAGES, added))
    return sum(map(_TOOL_CALLS, entries)), sum(map(_IMAGES, entries))


class MemoMessages(list[dict[str, Any]]):
    """``ChatCompletionRequest.messages`` decoded through the memo: shared dicts (read-only), with their entries
    (``entries[i]`` is message i's) for ``chat_messages.prepare_messages``; ``shared_with``: the stored body whose
    first messages these are (body_prefix_store.py) and how many, ``filed``: this body as stored for the next
    turn (both None where there is none): the messages' prepared forms follow the bodies."""

    __slots__ = ("entries", "shared_with", "filed")

    def __init__(self, entries: Sequence[MemoEntry], values: tuple[Any, ...],
                 shared_with: tuple[StoredBody, int] | None, filed: StoredBody | None) -> None:
        super().__init__(values)  # (each entry's value: _message_values)
        self.entries = entries
        self.shared_with = shared_with
        self.filed = filed


class MemoTools(list[dict[str, Any]]):
    """``ChatCompletionRequest.tools`` decoded through the memo: shared (read-only), with its entry for
    ``chat_messages.prepare_tools``."""

    __slots__ = ("entry",)

    def __init__(self, entry: MemoEntry) -> None:
        super().__init__(entry.value)
        self.entry = entry


class MessageMemo:
    """A bytes-bounded LRU of ``MemoEntry`` by raw JSON, one per process, shared by the render lanes."""

    def __init__(self, max_bytes: int, body_bytes: int = 0) -> None:
        """``max_bytes``: the bound of the entries; ``body_bytes``: of the recent bodies (0: none kept)."""
        self.bodies = BodyStore(body_bytes) if body_bytes else None
        # messages and tools arrays looked up, and those decoded (not found), since start (tests and benches read
        # them; two lanes may lose a count now and then)
        self.lookups = 0
        self.misses = 0
        self.lru: ByteLRU[tuple[Hashable, int, bytes, bytes], MemoEntry] = ByteLRU(
            max_bytes, max_entry_bytes=max_bytes, on_evict=MemoEntry.release)
        self._entries = self.lru._entries

    def __len__(self) -> int:
        return len(self._entries)

    def decode_chat(self, body: bytes) -> ChatCompletionRequest | None:
        """The request ``msgspec.json.decode(body, type=ChatCompletionRequest)`` gives, its messages and tools
        from the memo where seen before; None where anything in the body fails to decode (the caller decodes
        it the usual way for the error). The messages a recent body holds at the same places are taken from it
        without being scanned again (body_prefix_store.py)."""
        try:
            raw, entries, messages, found, tail_start = self.decode_items(body, "chat", _decode_raw_request,
                                                                          self._message_entries)
            tools = None if raw.tools == _NULL else self._entries_of(_TOOLS, [raw.tools])[0]
        except (msgspec.DecodeError, RecursionError):
            return None
        filed = self.keep_body(body, raw, entries, messages, found, tail_start)
        values = list(_astuple(raw))
        values[0] = MemoMessages(entries, messages, found, filed)
        values[_TOOLS_AT] = None if tools is None or tools.value is None else MemoTools(tools)
        return ChatCompletionRequest(*values)

    def decode_items(self, body: bytes, api: str, decode_raw: Callable[[bytes], Any],
                     entries_of: Callable[[list[msgspec.Raw]], list[Any]], field: str = "messages"
                     ) -> tuple[Any, list[Any], tuple[Any, ...], tuple[StoredBody, int] | None, int]:
        """A body of ``api`` decoded by ``decode_raw`` (its messages, the array ``field``, as raw JSON): its decode,
        each message's entry (``entries_of`` gives those of the messages no stored body holds), their values, the
        stored body whose messages it starts with and how many (or None), and where the messages after those start
        (``keep_body`` files it from these). Raises ``msgspec.DecodeError`` (or ``RecursionError``) where it does
        not decode."""
        bodies = self.bodies
        found = bodies.find(body, api) if bodies is not None and type(body) is bytes else None
        decoded = self.decode_after(body, *found, decode_raw, entries_of, field) if found is not None else None
        if decoded is None:
            found, tail_start = None, 0
            raw = decode_raw(body)
            items = getattr(raw, field)
            entries = entries_of(items) if isinstance(items, list) else []
        else:
            raw, entries, tail_start = decoded
        return raw, entries, _message_values(entries, found), found, tail_start

    def decode_after(self, body: bytes, stored: StoredBody, common: int, decode_raw: Callable[[bytes], Any],
                     entries_of: Callable[[list[msgspec.Raw]], list[Any]], field: str = "messages"
                     ) -> tuple[Any, list[Any], int] | None:
        """The body decoded by ``decode_raw`` (its messages, the array ``field``, as raw JSON) with its messages 1 to
        ``common - 1`` (``stored``'s, at the same places) cut out, every message's entry (``entries_of`` gives those
        of the messages not cut), and where the messages after the common ones start (or the array closes); None
        where the cut does not apply (the usual decode then answers). The first message stays: that the decoded array's
        first element is the one at its place proves the array decoded is the one cut (a second ``messages`` key
        would otherwise go unseen)."""
        at = skip_whitespace(body, stored.ends[common - 1])
        if at >= len(body):
            return None
        first_end = stored.ends[0]
        if body[at] == 0x2C:  # ",": more messages follow
            at = skip_whitespace(body, at + 1)
            if at >= len(body) or body[at] == 0x5D:  # a trailing comma (", ]") the cut would hide
                return None
            document = body[:first_end] + b"," + body[at:]
        elif body[at] == 0x5D:  # "]"
            document = body[:first_end] + body[at:]
        else:
            return None
        raw: Any = decode_raw(document)
        items = getattr(raw, field)
        if not isinstance(items, list) or not items or _address(items[0]) - _address(document) != stored.starts[0] \
                or len(items[0]) != first_end - stored.starts[0]:
            return None
        entries = list(stored.entries[:common])  # (a tuple's slice of all of it is the tuple itself: no copy)
        entries += entries_of(items[1:])
        return raw, entries, at

    def keep_body(self, body: bytes, raw: Any, entries: list[MemoEntry], messages: tuple[Any, ...],
                  found: tuple[StoredBody, int] | None, tail_start: int, api: str = "chat", field: str = "messages"
                  ) -> StoredBody | None:
        """Files ``body`` (a request body of ``api``, ``raw`` its decode with the messages, the array ``field``, as
        raw JSON) with where its messages are, for the next turn (``tail_start``: where the messages after
        ``found``'s common ones start), and answers it; nothing where they cannot be placed for certain (the offsets
        are checked against the body byte for byte)."""
        bodies = self.bodies
        if bodies is None or type(body) is not bytes or not entries or len(body) < bodies.base:
            return None  # (no store, or too short to be filed: nothing to place)
        starts: tuple[int, ...]
        ends: tuple[int, ...]
        if found is None:  # where the first message is: a Raw is a view of the body it was decoded from
            first = _address(getattr(raw, field)[0]) - _address(body)
            offsets = element_offsets(body, first, [e.data for e in entries]) if 0 <= first < len(body) else None
            starts, ends = (tuple(offsets[0]), tuple(offsets[1])) if offsets is not None else ((), ())
        else:
            stored, common = found
            starts, ends = stored.starts[:common], stored.ends[:common]
            if len(entries) > common:
                tail = element_offsets(body, tail_start, [e.data for e in entries[common:]])
                if tail is None:
                    return None
                starts += tuple(tail[0])
                ends += tuple(tail[1])
        if len(starts) != len(entries):
            return None
        replaces = found[0] if found is not None and found[1] == len(found[0].entries) else None
        stored = StoredBody(body, starts, ends, tuple(entries), {}, messages, *entry_counts(entries, replaces),
                            api, {} if api != "chat" else None)
        bodies.add(stored, replaces)
        return stored

    def _message_entries(self, items: list[msgspec.Raw]) -> list[MemoEntry]:
        return self._entries_of(_MESSAGE, items)

    def _entries_of(self, kind: int, items: list[msgspec.Raw]) -> list[MemoEntry]:
        """The entry of each raw JSON value, found or decoded (``msgspec.DecodeError`` where one does not decode
        as ``kind``)."""
        decode = _DECODERS[kind]
        return self.entries_by_bytes(kind, items, lambda data: MemoEntry(data, decode(data)))

    def entries_by_bytes(self, kind: Hashable, items: Sequence[msgspec.Raw | bytes], make: Callable[[bytes], MemoEntry]
                         ) -> list[MemoEntry]:
        """The entry of each raw JSON value under ``kind`` (one of this module's, or another API's own), found or
        made by ``make`` from the value's bytes (whatever it raises, nothing is kept). One loop for all: a turn's
        messages are mostly hits, ~0.3 us each."""
        found = self._entries.get
        move_to_end = self._entries.move_to_end
        out = []
        new: list[tuple[tuple[Hashable, int, bytes, bytes], MemoEntry]] = []
        for item in items:
            data = bytes(item)  # our own copy: a Raw holds on to the whole body
            key = (kind, len(data), data[:KEY_HEAD_BYTES], data[-KEY_TAIL_BYTES:])
            # A hit takes no lock: OrderedDict's get and move_to_end are each one step under the GIL (these keys
            # run no Python code), and an entry another lane evicts in between is simply not moved.
            kept = found(key)
            entry = kept[0] if kept is not None else None
            if entry is None or entry.data != data:  # the same key for other bytes is a miss
                entry = make(data)
                new.append((key, entry))
            else:
                try:
                    move_to_end(key)
                except KeyError:
                    pass
            out.append(entry)
        if new:
            self._add(new)
        self.lookups += len(out)
        self.lru.hits += len(out) - len(new)  # (the lookups above read its dict directly)
        self.lru.misses += len(new)
        return out

    def _add(self, new: list[tuple[tuple[Hashable, int, bytes, bytes], MemoEntry]]) -> None:
        """Keeps the entries just decoded (all of them or none: a request that fails to decode adds nothing); the
        same key for other bytes: the newer stays."""
        self.misses += len(new)
        self.lru.put_many([(key, entry, entry.size) for key, entry in new], replace=True)

    # (last: a property named ``bytes`` would hide the type from the annotations above)
    @property
    def max_bytes(self) -> int:
        return self.lru.max_bytes

    @property
    def bytes(self) -> int:
        return self.lru.bytes


def _message_values(entries: list[MemoEntry], found: tuple[StoredBody, int] | None) -> tuple[Any, ...]:
    """Each entry's decoded message: those of the messages a stored body shares, as it keeps them."""
    if found is None:
        return tuple(map(_VALUE, entries))
    stored, common = found
    if len(stored.values) < common:  # (a body filed without them)
        return tuple(map(_VALUE, entries))
    return stored.values[:common] + tuple(map(_VALUE, entries[common:]))


def _address(buffer: Any) -> int:
    """Where a bytes-like object's memory starts (read-only buffers too)."""
    return int(np.frombuffer(buffer, dtype=np.uint8).__array_interface__["data"][0])


def decode_chat_request(body: bytes, memo: MessageMemo | None,
                        decode: Callable[[bytes, type], Any]) -> ChatCompletionRequest:
    """The body as a ``ChatCompletionRequest``: through ``memo`` where there is one and the body decodes, else
    by ``decode`` (the server's: its errors are the client's answer)."""
    req = memo.decode_chat(body) if memo is not None else None
    return req if req is not None else decode(body, ChatCompletionRequest)
