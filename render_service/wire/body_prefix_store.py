"""Recent chat request bodies with where each message sits in them, found again by the bytes a new body starts with.

An agent's next request is its previous body with messages added before the array closes. ``BodyStore`` keeps
recent bodies with the byte range of each message of their ``messages`` array and the message memo's entry for
it (message_memo.py). For a new body it finds a stored one sharing a long head (one memory comparison on the
usual turn) and says how many of its messages lie wholly inside the common head: those need no decoding, nor
even the scan that finds a message's bytes.

Why that is exact: a JSON parser reads left to right, so after ``common`` equal bytes it is in the same state in
both bodies. At the end of a stored message ``k - 1`` that state is "inside the messages array, after an element";
what follows in the new body is either ``]`` or ``,`` and the next element. Cutting the first ``k`` messages out
(``head + tail``: the bytes before the first message, then those from the new body's message ``k`` on) leaves a
document a parser reads in the same states from there on, so it decodes to the same fields and the remaining
messages, while the first ``k`` are the stored bytes (message_memo.MessageMemo.decode_chat). A trailing comma
(``, ]``), which the cut would hide, is refused here, and anything else that does not decode falls back to the
usual decode with its usual error.

Found through checkpoints of the body (head_index.HeadIndex, as prompt_prefix_store finds prompts). Least recently
used bodies are dropped past ``max_bytes`` (estimated: the body and the memo entries it holds on to), and at once a
body whose messages a newer one reused in full (the same conversation's earlier turn).
"""

from __future__ import annotations

import builtins
from typing import Any, NamedTuple

from render_service.tokenize.head_index import HeadStore

WINDOW = 256
# The body, plus the memo entries it keeps alive (decoded and prepared messages: ~5x their JSON,
# message_memo.BYTES_PER_JSON_BYTE), plus its offsets, the lists of prepared messages it keeps and its own objects.
_BYTES_PER_BODY_BYTE = 6
_ENTRY_OVERHEAD = 512
_JSON_WHITESPACE = b" \t\n\r"


class StoredBody(NamedTuple):
    body: bytes
    starts: tuple[int, ...]  # where each message's JSON starts in ``body``
    ends: tuple[int, ...]  # and just past where it ends
    entries: tuple[Any, ...]  # message_memo.MemoEntry of each message
    # the messages prepared for a template, by content format, as the body's render left them
    # (chat_messages.PreparedLineage): the next turn's render takes those of the messages the two share
    prepared: dict[str, Any] | None = None
    values: tuple[Any, ...] = ()  # each entry's decoded message (the next turn takes those it shares)
    tool_calls: int = -1  # its messages' tool calls (-1: not counted); a turn holding them all adds only its own
    image_messages: int = -1  # of its messages, those holding an image part (-1: not counted); likewise
    # the API whose request bodies these are: a body is found again only for a body of the same API
    api: str = "chat"
    # another API's body: what its messages convert to, once a render converted them (apis/converted_memo.py)
    converted: dict[str, Any] | None = None


def skip_whitespace(body: bytes, at: int) -> int:
    while at < len(body) and body[at] in _JSON_WHITESPACE:
        at += 1
    return at


def element_offsets(body: bytes, first: int, items: list[bytes]) -> tuple[list[int], list[int]] | None:
    """Start and end offsets of the consecutive array elements ``items``, the first at ``first``; None where the
    body does not hold them there separated by a comma and JSON whitespace alone. (An element is a JSON value, never
    whitespace or a comma: between two elements the next one's first occurrence is its own.)"""
    compact = _compact_offsets(body, first, items)
    if compact is not None:
        return compact
    starts: list[int] = []
    ends: list[int] = []
    at = first
    for index, item in enumerate(items):
        if index:
            at = skip_whitespace(body, at)
            if at >= len(body) or body[at] != 0x2C:  # ","
                return None
            at = skip_whitespace(body, at + 1)
        if not body.startswith(item, at):
            return None
        starts.append(at)
        at += len(item)
        ends.append(at)
    return starts, ends


def _compact_offsets(body: bytes, first: int, items: list[bytes]) -> tuple[list[int], list[int]] | None:
    """``element_offsets`` for elements separated by a bare comma (how most clients write JSON): each element's
    bytes compared where the one before ends, past one comma; None at the first that is not there (the walk then
    places them, whitespace and all)."""
    starts: list[int] = []
    ends: list[int] = []
    at = first
    startswith = body.startswith
    for item in items:
        if not startswith(item, at):
            return None
        starts.append(at)
        at += len(item)
        ends.append(at)
        at += 1
    if any(body[end] != 0x2C for end in ends[:-1]):  # ","
        return None
    return starts, ends


def _size(stored: StoredBody) -> int:
    return _ENTRY_OVERHEAD + _BYTES_PER_BODY_BYTE * len(stored.body) + 48 * len(stored.starts)


# Below this a body is decoded whole: finding, cutting and filing it costs about what the scan it saves costs
# (bench/message_memo_bench.py: a 21 KB body took 0.020 ms longer, a 60-80 KB one 0.018 ms less, 374 KB 0.145 ms).
DEFAULT_BASE = 32 * 1024


class BodyStore(HeadStore[StoredBody, builtins.bytes]):
    """Per process, shared by the render lanes; bodies shorter than ``base`` bytes are neither kept nor looked up."""

    def __init__(self, max_bytes: int, base: int = DEFAULT_BASE) -> None:
        super().__init__(max_bytes, base, WINDOW)

    def find(self, body: builtins.bytes, api: str = "chat") -> tuple[StoredBody, int] | None:
        """A stored body of ``api`` and how many of its first messages ``body`` holds byte for byte at the same
        places (at least one), the most such messages of any candidate; None when none shares a message."""
        for candidates in self._index.candidates(body):
            best: tuple[StoredBody, int] | None = None
            # The longest first (newest first among equals), so the comparisons (each reads the whole shared
            # head) stop once no later candidate can share more; of two that share as many, one held in full wins
            # (the body filed next replaces it). Stored bodies never change: compared outside the lock.
            for stored in sorted(candidates, key=_message_count, reverse=True):
                if stored.api != api:
                    continue
                count = len(stored.ends)
                if best is not None and (best[1] > count or best[1] == len(best[0].ends)):
                    break
                common = _messages_in_common(body, stored)
                if common and (best is None or common > best[1] or common == best[1] == count):
                    best = (stored, common)
            if best is not None:
                self._index.touch(best[0])
                return best
        return None

    def add(self, stored: StoredBody, replaces: StoredBody | None = None) -> None:
        """Keeps ``stored`` (if long enough to be filed, and it fits); drops ``replaces``, a body all of whose
        messages ``stored`` holds at the same places (any body shares at least as many with ``stored``)."""
        self._index.add(stored, stored.body, _size(stored), replaces)


def _message_count(stored: StoredBody) -> int:
    return len(stored.ends)


def _messages_in_common(body: bytes, stored: StoredBody) -> int:
    """How many of ``stored``'s first messages ``body`` holds at the same places: the largest k whose messages'
    bytes, and everything before them, are equal (a binary search of prefix comparisons, the whole on the usual
    turn)."""
    view = memoryview(stored.body)
    ends = stored.ends
    if not ends or not body.startswith(view[:ends[0]]):
        return 0
    if body.startswith(view[:ends[-1]]):
        return len(ends)
    low, high = 1, len(ends)  # the first ``low`` are common, the first ``high`` are not
    while high - low > 1:
        middle = (low + high) // 2
        if body.startswith(view[:ends[middle - 1]]):
            low = middle
        else:
            high = middle
    return low
