"""A growing Harmony conversation renders only its new messages: each render leaves a record the next turn extends.

A Harmony prompt is the preamble (system and developer messages), then each conversation message rendered on its
own, then ``<|start|>assistant``. A message's ids depend on nothing but the message and the function name its
tool result answers (harmony/render.py), so the ids of a turn's earlier messages are the ids the turn before
rendered for them, with one exception: an analysis message before the conversation's last final answer is dropped
(vLLM's ``auto_drop_analysis_messages``), so a new final answer drops the analysis the turn before kept after its
own last final answer.

A record holds the kept messages' ids as one chunk each (with the chunk's JSON: the answer is written from the
chunks, ``PromptIds``), where the ones after its last final answer start and which of those are analysis. A request
whose messages are a record's messages, the very objects (the message memo's, shared read-only between requests),
followed by new ones, converts and renders only the new ones, provided its preamble renders the same ids and no
new tool call takes an earlier call's id with another function's name (its earlier results would be renamed);
anything else renders whole. ``HarmonyRenderer`` proves when it is built (the first render of its tokenizer) that a
conversation built message by message this way renders the plain path's ids at every turn, and renders whole if
not.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from render_service.caches.byte_lru import ByteLRU, CacheStats
from render_service.caches.per_tokenizer import PerTokenizer

# A record is counted at its ids (four bytes each), their JSON and the message texts it keeps alive (about four
# characters an id); its chunks are shared with the record it extended, which is dropped when it is filed. And
# this much a message, and this much besides.
RECORD_BYTES_PER_ID = 8
RECORD_BYTES_PER_MESSAGE = 256
RECORD_OVERHEAD = 512
# How far back from a request's last message a record's last message is looked for when the message memo names
# no earlier body (a turn adds a few messages).
LOOKBACK_MESSAGES = 8


@dataclass(frozen=True)
class Part:
    """One rendered Harmony message: its ids, their JSON (no brackets), and what the drop rule reads of it."""

    ids: Sequence[int]
    json: bytes
    analysis: bool  # an assistant message on the analysis channel
    final: bool  # an assistant message on the final channel


@dataclass(eq=False)
class TurnRecord:
    """What one render of a conversation leaves for its next turn."""

    messages: tuple[Any, ...]  # the request's messages (compared by identity)
    preamble: tuple[int, ...]
    preamble_json: bytes
    names: dict[Any, str]  # call id -> function name over the conversation's messages
    chunks: list[Sequence[int]]  # the kept messages' ids, in order (without the preamble and generation prompt)
    json_parts: list[bytes]
    count: int  # ids in ``chunks``
    open_at: int  # the chunks from here come after the last final answer
    analysis: list[bool]  # per chunk from ``open_at``: an analysis message (a later final answer drops it)

    def nbytes(self) -> int:
        return (RECORD_BYTES_PER_ID * self.count + sum(map(len, self.json_parts))
                + RECORD_BYTES_PER_MESSAGE * len(self.messages) + RECORD_OVERHEAD)


def extended(record: TurnRecord | None, parts: list[Part]) -> tuple[list[Sequence[int]], list[bytes], int,
                                                                      list[bool]]:
    """The chunks, JSON parts, ``open_at`` and ``analysis`` of ``record`` (None: an empty conversation) with the
    rendered ``parts`` of its new messages appended, after the drop rule: where a new part is a final answer, every
    analysis message before the last such part is dropped (the record's kept ones are all after its last final)."""
    last_final = max((i for i, part in enumerate(parts) if part.final), default=-1)
    if record is None:
        chunks: list[Sequence[int]] = []
        json_parts: list[bytes] = []
        open_at, analysis = 0, []
    elif last_final < 0:
        chunks, json_parts = list(record.chunks), list(record.json_parts)
        open_at, analysis = record.open_at, list(record.analysis)
    else:
        chunks, json_parts = record.chunks[:record.open_at], record.json_parts[:record.open_at]
        for at, dropped in enumerate(record.analysis, record.open_at):
            if not dropped:
                chunks.append(record.chunks[at])
                json_parts.append(record.json_parts[at])
        open_at, analysis = len(chunks), []
    for i, part in enumerate(parts):
        if i < last_final and part.analysis:
            continue
        chunks.append(part.ids)
        json_parts.append(part.json)
        if i == last_final:
            open_at, analysis = len(chunks), []
        elif i > last_final:
            analysis.append(part.analysis)
    return chunks, json_parts, open_at, analysis


class TurnRecords:
    """Recent renders' records, each found by its messages' count and the identity of its last message, bounded by
    bytes (least recently used dropped first). A record that a newer one extends is dropped when the newer one is
    filed (the conversation's earlier turn)."""

    def __init__(self, max_bytes: int) -> None:
        self.lru: ByteLRU[tuple[int, int], TurnRecord] = ByteLRU(max_bytes)
        self._lock = threading.Lock()
        self.extended = 0  # renders that extended a record

    def stats(self) -> CacheStats:
        """For /metrics (caches/budget.py): a hit is a render that extended a record, a miss one that looked and
        found none or could not use the one it found."""
        kept = self.lru.stats()
        return kept._replace(hits=self.extended, misses=kept.hits + kept.misses - self.extended)

    def find(self, messages: Sequence[Any], shared: int | None) -> TurnRecord | None:
        """The record whose messages are the first of ``messages`` (the same objects), looked for at ``shared``
        messages (the count the message memo found shared with an earlier body, if any) and then back from the
        last; None where none is."""
        n = len(messages)
        tries = [shared] if shared is not None and 0 < shared <= n else []
        tries += range(n, max(n - LOOKBACK_MESSAGES, 0), -1)
        lru = self.lru
        for k in tries:
            record = lru.peek((k, id(messages[k - 1])))
            if record is None:
                continue
            kept = record.messages
            if len(kept) == k and all(map(operator.is_, kept, messages)):
                lru.get((k, id(messages[k - 1])))  # (recently used, and counted)
                return record
        lru.misses += 1
        return None

    def put(self, record: TurnRecord, replaces: TurnRecord | None) -> None:
        with self._lock:
            key = (len(replaces.messages), id(replaces.messages[-1])) if replaces is not None else None
            if key is not None and self.lru.peek(key) is replaces:
                self.lru.pop(key)
            if record.messages:
                self.lru.put((len(record.messages), id(record.messages[-1])), record, record.nbytes(), replace=True)


_RECORDS: PerTokenizer[TurnRecords] = PerTokenizer(lambda: TurnRecords(0), lambda records: records.lru, 4)


def keep_turn_records(tokenizer: object, max_bytes: int) -> TurnRecords | None:
    """The records of ``tokenizer``'s Harmony renders, bounded by the largest ``max_bytes`` asked for (0 asks for
    none); None where none was asked for."""
    return _RECORDS.keep(tokenizer, max_bytes)


def turn_records(tokenizer: object) -> TurnRecords | None:
    return _RECORDS.of(tokenizer)
