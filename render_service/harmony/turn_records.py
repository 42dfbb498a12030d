"""A growing Harmony conversation renders only its new messages: each render leaves a record the next turn extends.

A Harmony prompt is the preamble (system and developer messages), then each conversation message rendered on its
own, then ``<|start|>assistant``. A message's ids depend on nothing but the message and the function name its
tool result answers (harmony/render.py), so the ids of a turn's earlier messages are the ids the turn before
rendered for them, with one exception: an analysis message before the conversation's last final answer is dropped
(vLLM's ``auto_drop_analysis_messages``), so a new final answer drops the analysis the turn before kept after its
own last final answer.

A record holds the kept messages' ids as one chunk each (with the chunk's JSON: the answer is written from the
chunks, ``PromptIds``), where the ones after its last final answer start and which of those are analysis; the
record of a conversation's first render keeps that plain render's ids whole until a turn extends it. A request
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
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec
import numpy as np

from render_service.caches.byte_lru import ByteLRU, CacheStats
from render_service.caches.per_tokenizer import PerTokenizer

# A record is counted at its ids (four bytes each), their JSON and the message texts it keeps alive (about four
# characters an id); its chunks are shared with the record it extended, which is dropped when it is filed. And
# this much a message, and this much besides.
RECORD_BYTES_PER_ID = 8
JSON_BYTES_PER_ID = 7  # (a record not yet cut: its JSON to come, counted ahead)
RECORD_BYTES_PER_MESSAGE = 256
RECORD_OVERHEAD = 512
# How far back from a request's last message a record's last message is looked for when the message memo names
# no earlier body (a turn adds a few messages).
LOOKBACK_MESSAGES = 8
# Records kept under one key (a message count and the identity of the last message): conversations of one length
# that end in the same memo message (rollouts of one task whose tool returned the same result, a harness's fixed
# follow-up) each keep theirs, up to this many; the newest first.
RECORDS_PER_KEY = 4
_JSON = msgspec.json.Encoder()
_COMMA = ord(",")


class Part(NamedTuple):
    """One rendered Harmony message: its ids, their JSON (no brackets), and what the drop rule reads of it."""

    ids: Sequence[int]
    json: bytes
    analysis: bool  # an assistant message on the analysis channel
    final: bool  # an assistant message on the final channel


@dataclass(eq=False)
class TurnRecord:
    """What one render of a conversation leaves for its next turn. A conversation's first render is the plain one:
    its record keeps that render's ids as one array with where each message's end (``pending``), cut into chunks
    and written to JSON only when a later turn extends it (a conversation that never grows pays for neither)."""

    messages: tuple[Any, ...]  # the request's messages (compared by identity)
    preamble: tuple[int, ...]
    names: dict[Any, str]  # call id -> function name over the conversation's messages
    count: int  # ids of the kept messages (without the preamble and generation prompt)
    open_at: int  # the kept messages from here come after the last final answer
    analysis: list[bool]  # per kept message from ``open_at``: an analysis message (a later final answer drops it)
    chunks: list[Sequence[int]] | None = None  # the kept messages' ids, in order
    json_parts: list[bytes] | None = None
    pending: tuple[array[int], list[int]] | None = None  # (the ids, where each message ends) before they are cut
    preamble_json: bytes = b""  # (written by the first turn that extends the conversation, then carried)

    def listed(self) -> tuple[list[Sequence[int]], list[bytes]]:
        """The kept messages' ids and their JSON, one chunk a message (cut from ``pending`` the first time)."""
        if self.chunks is None or self.json_parts is None:
            assert self.pending is not None
            ids, ends = self.pending
            self.chunks, self.json_parts = cut(ids, ends)
        return self.chunks, self.json_parts

    def nbytes(self) -> int:
        json = sum(map(len, self.json_parts)) if self.json_parts is not None else JSON_BYTES_PER_ID * self.count
        return (RECORD_BYTES_PER_ID * self.count + json + RECORD_BYTES_PER_MESSAGE * len(self.messages)
                + RECORD_OVERHEAD)


def cut(ids: array[int], ends: list[int]) -> tuple[list[Sequence[int]], list[bytes]]:
    """``ids`` cut at ``ends`` (where each message's ids end), and each chunk's JSON (no brackets): the JSON is
    written once and cut at the comma after each chunk's last id."""
    if not ends:
        return [], []
    text = _JSON.encode(ids.tolist())
    commas = np.flatnonzero(np.frombuffer(text, np.uint8) == _COMMA)
    json_ends = commas[np.asarray(ends[:-1], dtype=np.intp) - 1].tolist() + [len(text) - 1]
    chunks: list[Sequence[int]] = []
    json_parts: list[bytes] = []
    start, json_start = 0, 1  # (after the opening bracket)
    for end, json_end in zip(ends, json_ends, strict=True):
        chunks.append(ids[start:end])
        json_parts.append(text[json_start:json_end])
        start, json_start = end, json_end + 1
    return chunks, json_parts


def first_record(messages: tuple[Any, ...], preamble: tuple[int, ...], names: dict[Any, str], ids: array[int],
                 ends: list[int], flags: list[tuple[bool, bool]]) -> TurnRecord:
    """The record of a conversation's plain render: ``ids`` its kept messages' ids, ``ends`` where each message's
    end and ``flags`` each message's (analysis, final), analysis before the last final answer already dropped."""
    last_final = max((i for i, (_, final) in enumerate(flags) if final), default=-1)
    return TurnRecord(messages, preamble, names, len(ids), last_final + 1,
                      [analysis for analysis, _ in flags[last_final + 1:]], pending=(ids, ends))


def extended(record: TurnRecord, parts: list[Part]) -> tuple[list[Sequence[int]], list[bytes], int, list[bool]]:
    """The chunks, JSON parts, ``open_at`` and ``analysis`` of ``record`` with the rendered ``parts`` of its new
    messages appended (their own analysis before their last final answer already dropped), after the drop rule:
    where a new part is a final answer, the analysis the record kept (all after its last final) is dropped."""
    last_final = max((i for i, part in enumerate(parts) if part.final), default=-1)
    kept_chunks, kept_json = record.listed()
    if last_final < 0:
        chunks, json_parts = list(kept_chunks), list(kept_json)
        open_at, analysis = record.open_at, list(record.analysis)
    else:
        chunks, json_parts = kept_chunks[:record.open_at], kept_json[:record.open_at]
        for at, dropped in enumerate(record.analysis, record.open_at):
            if not dropped:
                chunks.append(kept_chunks[at])
                json_parts.append(kept_json[at])
        open_at, analysis = len(chunks), []
    for i, part in enumerate(parts):
        chunks.append(part.ids)
        json_parts.append(part.json)
        if i == last_final:
            open_at, analysis = len(chunks), []
        elif i > last_final:
            analysis.append(part.analysis)
    return chunks, json_parts, open_at, analysis


class TurnRecords:
    """Recent renders' records, found by their messages' count and the identity of their last message (a few
    under one such key), bounded by bytes (least recently used keys dropped first). A record that a newer one
    extends is dropped when the newer one is filed (the conversation's earlier turn)."""

    def __init__(self, max_bytes: int) -> None:
        self.lru: ByteLRU[tuple[int, int], tuple[TurnRecord, ...]] = ByteLRU(max_bytes)
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
            key = (k, id(messages[k - 1]))
            for record in lru.peek(key) or ():
                kept = record.messages
                if len(kept) == k and all(map(operator.is_, kept, messages)):
                    lru.get(key)  # (recently used, and counted)
                    return record
        lru.misses += 1
        return None

    def put(self, record: TurnRecord, replaces: TurnRecord | None) -> None:
        with self._lock:
            if replaces is not None:
                self._file(_key(replaces), lambda kept: kept is not replaces)
            if record.messages:
                self._file(_key(record), lambda kept: not _same_messages(kept, record), record)

    def _file(self, key: tuple[int, int], keep: Callable[[TurnRecord], bool], first: TurnRecord | None = None
              ) -> None:
        """The records under ``key``: ``first`` (if any), then those kept before that ``keep`` keeps, at most
        RECORDS_PER_KEY and the cache's largest entry (the oldest dropped first); the key dropped when none is
        left."""
        bucket = ((first,) if first is not None else ()) + tuple(filter(keep, self.lru.peek(key) or ()))
        sizes = [kept.nbytes() for kept in bucket]
        if sizes and sizes[0] > self.lru.max_entry_bytes:  # (too large to keep at all: the others stay)
            bucket, sizes = bucket[1:], sizes[1:]
        count = min(len(bucket), RECORDS_PER_KEY)
        while count and sum(sizes[:count]) > self.lru.max_entry_bytes:
            count -= 1
        if count:
            self.lru.put(key, bucket[:count], sum(sizes[:count]), replace=True)
        else:
            self.lru.pop(key)


def _key(record: TurnRecord) -> tuple[int, int]:
    return len(record.messages), id(record.messages[-1])


def _same_messages(a: TurnRecord, b: TurnRecord) -> bool:
    return len(a.messages) == len(b.messages) and all(map(operator.is_, a.messages, b.messages))


_RECORDS: PerTokenizer[TurnRecords] = PerTokenizer(lambda: TurnRecords(0), lambda records: records.lru, 4)


def keep_turn_records(tokenizer: object, max_bytes: int) -> TurnRecords | None:
    """The records of ``tokenizer``'s Harmony renders, bounded by the largest ``max_bytes`` asked for (0 asks for
    none); None where none was asked for."""
    return _RECORDS.keep(tokenizer, max_bytes)


def turn_records(tokenizer: object) -> TurnRecords | None:
    return _RECORDS.of(tokenizer)
