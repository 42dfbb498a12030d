"""A conversation that grew renders only its new messages: the template's message loop resumes where a recent
render of the same leading messages left it (the plan: loop_plan.py).

The compiled template calls ``loop_entry`` where its message loop starts. With no ``LoopSession`` active (the
plain render) that returns the messages unchanged. A session records, per iteration, where its output starts and
the state of every namespace the iterations read (``LoopRecord``); given the record of an earlier render whose
messages are the first ``k`` of this one's, it instead

1. checks that the same loop starts at the same message (a template may loop over a tail of the messages, in one
   of several ``if`` branches), that the head rendered the same text and that every outside name the iterations
   read has the same value as then (namespaces by their attributes);
2. restores the namespaces to what they held before iteration ``s = k - reach`` (the last iterations before the new
   messages may look at the next message, which is new now);
3. runs the loop from ``s`` with the loop's counters as a full run has them there; the text is the earlier text up
   to iteration ``s`` and everything rendered from there.

Iterations before ``s`` would write what they wrote then: each reads only its message, those up to ``reach``
ahead and those at constant indices (all among the first ``k``), counters that do not depend on the list's length,
the names checked in 1 and the namespaces restored in 2. A threshold (loop_plan.index_thresholds: a value only
compared with the loop's index) may differ from the record's: ``s`` is then at most ``min(old, new) - 1``, and the
restored namespaces keep its new value. A read of the messages at a negative index (which Python
takes from the end) makes the render's record unusable. Any check that fails leaves the render a full one.
"""

from __future__ import annotations

import itertools
import operator
import threading
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import jinja2.runtime
import jinja2.utils

from render_service.caches.byte_lru import ByteLRU, CacheStats

_ATTRS = "_Namespace__attrs"
_get_attrs = object.__getattribute__
# values an iteration may read from outside the loop and that a render can compare with an earlier one's
_PLAIN = (str, int, float, bool, type(None))


class TrackedMessages(list[Any]):
    """The messages a session's loop iterates, from ``start``; ``on_item(index0)`` runs as each iteration begins
    (inline.LoopContext steps it)."""

    start: int = 0
    on_item: Callable[[int], None] | None = None


@dataclass
class LoopRecord:
    """What one render left for the next: the messages it got (the caller's objects, compared by identity), its
    output as the blocks the template yielded (a resumed render joins the kept ones with its own, one copy of the
    text as a full render's join), how many blocks the head wrote, and per loop iteration the block its output
    starts at and its namespaces' attributes."""

    messages: tuple[Any, ...]
    blocks: list[str]
    head_blocks: int
    text_bytes: int  # the text's size in CPython (1 or 4 bytes a character)
    offset: int  # messages before the loop's first item (``loop_messages = messages[1:]``)
    names: list[Any]
    starts: list[int]
    # the text's characters before each iteration's first block, and the first block that is not ASCII
    # (len(blocks): none): a render resumed from here sizes the blocks it keeps without reading them
    start_chars: list[int]
    first_wide: int
    states: list[list[dict[str, Any]]]
    reach: int
    max_index: int
    loop: int  # which of the template's message loops (loop_plan.LoopPlan.ident)
    marks: list[Any] = field(default_factory=list)  # the thresholds' values (loop_plan.LoopPlan.thresholds)
    # per head scan (last_match_scan.py): the index of the last message it matched, None where it matched none
    scans: dict[int, int | None] = field(default_factory=dict)

    def nbytes(self) -> int:
        # the text's blocks, and the messages it keeps alive (about as large as the text, and kept even once the
        # message memo has let them go)
        return 2 * self.text_bytes + 56 * len(self.blocks) + 160 * len(self.messages) + 256


@dataclass
class LoopSession:
    """One render's view of its message loop: the output so far (``blocks``), and the record it may resume."""

    blocks: list[str]
    resume: LoopRecord | None = None
    same: int = 0  # how many leading messages are the record's own objects
    entered: bool = False
    resumed_at: int = -1  # loop index the loop started at (resumed), -1: from the start
    base_block: int = 0  # the record's blocks kept before the loop's first new block
    entry_block: int = 0
    offset: int = 0
    names: list[Any] = field(default_factory=list)
    marks: list[Any] = field(default_factory=list)
    namespaces: list[jinja2.utils.Namespace] = field(default_factory=list)
    item_blocks: list[int] = field(default_factory=list)
    states: list[list[dict[str, Any]]] = field(default_factory=list)
    reach: int = 1
    max_index: int = -1
    loop: int = 0
    unusable: bool = False  # a read at a negative index, or a value no render can compare
    # head scans (last_match_scan.py): per scan, whether it searched and the record's answer it may take; this
    # render's answers; how many scans iterated only the messages after the shared ones
    scan_starts: dict[int, tuple[bool, Any]] = field(default_factory=dict)
    scan_answers: dict[int, int | None] = field(default_factory=dict)
    scans_shortened: int = 0

    def at_item(self, index0: int) -> None:
        self.item_blocks.append(len(self.blocks))
        self.states.append([dict(_get_attrs(ns, _ATTRS)) for ns in self.namespaces])


SESSION: ContextVar[LoopSession | None] = ContextVar("template_loop_session", default=None)


def _comparable(value: Any) -> Any:
    """A value of an outside name as renders compare it (raises TypeError for one they cannot). Containers and
    callables compare as they are: everything a render gets is a plain copy (chat_template.plain_copy) and the
    sandbox changes no container, so a container holding anything with state of its own (a namespace, a joiner)
    is a new object in each render, and equal only to itself: such a render is never resumed."""
    kind = type(value)
    if kind in _PLAIN or kind is list or kind is dict or kind is tuple:
        return value
    if isinstance(value, jinja2.utils.Namespace):
        return ("namespace", dict(_get_attrs(value, _ATTRS)))
    if isinstance(value, jinja2.runtime.Undefined):
        return ("undefined", kind)
    if isinstance(value, jinja2.runtime.Macro):
        return ("macro", value._func.__code__)  # the same template's code; what it reads is among the names
    if isinstance(value, (list, dict, tuple, str)) or callable(value):
        return value
    raise TypeError(kind.__name__)


def loop_entry(items: Any, context: jinja2.runtime.Context, names: dict[str, Any], reach: int, max_index: int,
               loop: int, thresholds: tuple[tuple[str, str], ...] = ()) -> Any:
    """Called by a compiled template where its message loop starts: what the loop iterates."""
    session = SESSION.get()
    if session is None or session.entered:
        return items
    session.entered = True
    # the messages the render was given (the template may have set its own `messages` to a tail of them)
    messages = context.parent.get("messages")
    if type(items) is not list or type(messages) is not list:
        session.unusable = True
        return items
    offset = len(messages) - len(items)
    if offset < 0 or (items and (items[0] is not messages[offset] or items[-1] is not messages[-1])):
        session.unusable = True
        return items
    try:
        values = [_comparable(names[name]) for name in sorted(names)]
        marks = _thresholds_apart(values, sorted(names), thresholds)
    except TypeError:
        session.unusable = True
        return items
    session.names, session.marks, session.offset = values, marks, offset
    session.reach, session.max_index, session.loop = reach, max_index, loop
    session.namespaces = [v for _, v in sorted(names.items()) if isinstance(v, jinja2.utils.Namespace)]
    session.entry_block = len(session.blocks)
    start = _resume_point(session, values, offset, len(items))
    tracked = TrackedMessages(items)
    tracked.on_item = session.at_item
    if start > 0:
        record = session.resume
        assert record is not None
        for ns, attrs in zip(session.namespaces, record.states[start], strict=True):
            kept = _get_attrs(ns, _ATTRS)
            now = {attr: kept[attr] for name, attr in thresholds if attr and names[name] is ns and attr in kept}
            kept.clear()
            kept.update(attrs)
            kept.update(now)  # (the loop never sets a threshold: its value is the one the loop started with)
        session.resumed_at = start
        session.base_block = record.starts[start]
        session.states = record.states[:start]
        tracked.start = start
    return tracked


def _thresholds_apart(values: list[Any], names: list[str], thresholds: tuple[tuple[str, str], ...]) -> list[Any]:
    """Takes the thresholds' values out of ``values`` (comparable values of ``names``, in place) and returns them."""
    marks: list[Any] = []
    for name, attr in thresholds:
        at = names.index(name)
        value = values[at]
        if not attr:
            marks.append(value)
            values[at] = ("threshold",)
        elif type(value) is tuple and value[0] == "namespace" and attr in value[1]:
            attrs = dict(value[1])
            marks.append(attrs.pop(attr))
            values[at] = ("namespace", attrs)
        else:
            marks.append(None)  # (not a namespace holding it this time: compared as the other names are)
    return marks


def _threshold_limit(kept: list[Any], now: list[Any]) -> int | None:
    """The first loop index that may compare differently with the thresholds moved from ``kept`` to ``now`` (None:
    none moved); -1 where one moved and is not an integer both times."""
    limit: int | None = None
    for old, new in zip(kept, now, strict=True):
        if type(old) is type(new) and old == new:
            continue
        if type(old) is not int or type(new) is not int:
            return -1
        limit = min(old, new) - 1 if limit is None else min(limit, old - 1, new - 1)
    return limit


def _resume_point(session: LoopSession, values: list[Any], offset: int, count: int) -> int:
    """The loop index this render may start at (0: from the start), after the checks the module's docstring lists."""
    record = session.resume
    if record is None:
        return 0
    start = session.same - offset - session.reach
    # (a constant index may be the loop's own list's, ``loop_messages[c]``: messages[offset + c])
    if start <= 0 or start > count or start >= len(record.starts) or session.same <= offset + session.max_index:
        return 0
    if record.loop != session.loop or record.offset != offset or record.reach != session.reach \
            or record.head_blocks != len(session.blocks) \
            or record.blocks[:record.head_blocks] != session.blocks or record.names != values \
            or len(record.marks) != len(session.marks):
        return 0
    limit = _threshold_limit(record.marks, session.marks)
    if limit is not None:
        start = min(start, limit)
        if start <= 0:
            return 0
    if len(record.states[start]) != len(session.namespaces):
        return 0
    return start


def namespace_attrs(value: Any) -> dict[str, Any] | None:
    """The attributes of a template's namespace (what ``{% set ns.x = ... %}`` writes); None for anything else."""
    if not isinstance(value, jinja2.utils.Namespace):
        return None
    attrs: dict[str, Any] = _get_attrs(value, _ATTRS)
    return attrs


def checked_index(index: Any) -> Any:
    """The index of ``messages[loop.index0 - c]`` in the message loop; a negative one (Python reads it from the end,
    so what it reads depends on the conversation's length) makes this render's record unusable."""
    if type(index) is int and index < 0:
        session = SESSION.get()
        if session is not None:
            session.unusable = True
    return index


@dataclass
class LoopOutput:
    """A session render's output as the blocks the template yielded (never joined here), and where each iteration
    of its message loop starts: ``starts[i]``, the block of the iteration over ``messages[offset + i]`` (None when
    the render ran no message loop)."""

    blocks: list[str]
    starts: list[int] | None
    offset: int
    chars: int
    # what the loop's iterations read besides their messages (as a record keeps them; None without a usable one):
    # the outside names' values, each iteration's namespaces at its start, how far ahead it reads, the largest
    # constant index it reads
    names: list[Any] | None = None
    marks: list[Any] | None = None  # (the thresholds' values, kept out of ``names``)
    states: list[list[dict[str, Any]]] | None = None
    reach: int = 1
    max_index: int = -1

    def text(self) -> str:
        return "".join(self.blocks)

    def text_from(self, block: int) -> str:
        return "".join(self.blocks[block:])


def finish(session: LoopSession, messages: tuple[Any, ...]) -> tuple[LoopOutput, LoopRecord | None]:
    """The render's output from the session's blocks, and the record a later render may resume (None: none).
    What a resumed render keeps of its record is sized from the record; only its own blocks are read."""
    own_from = 0  # the session's first block that this render wrote after what it keeps
    kept_chars = 0
    first_wide = -1  # (-1: not among the kept blocks)
    blocks = session.blocks
    record = session.resume if session.resumed_at > 0 else None
    if record is not None:
        # the record's blocks up to the resume point, then this render's own from the loop on
        own_from = session.entry_block
        shift = session.base_block - own_from
        blocks = record.blocks[:session.base_block]
        blocks += itertools.islice(session.blocks, own_from, None)
        starts = record.starts[:session.resumed_at] + [b + shift for b in session.item_blocks]
        kept_chars = record.start_chars[session.resumed_at]
        if record.first_wide < session.base_block:
            first_wide = record.first_wide
    else:
        shift = 0
        starts = session.item_blocks
    own = session.blocks
    ends = list(itertools.accumulate(map(len, itertools.islice(own, own_from, None)), initial=kept_chars))
    chars = ends[-1]
    output = LoopOutput(blocks, starts if session.entered else None, session.offset, chars)
    if not session.entered or session.unusable:
        return output, None
    output.names, output.marks, output.states = session.names, session.marks, session.states
    output.reach, output.max_index = session.reach, session.max_index
    if first_wide < 0:
        # (str.isascii reads a flag CPython keeps per string)
        wide = next(itertools.compress(itertools.count(own_from), map(operator.not_, map(
            str.isascii, itertools.islice(own, own_from, None)))), None)
        first_wide = len(blocks) if wide is None else wide + shift
    start_chars = (record.start_chars[:session.resumed_at] if record is not None else []) + \
        [ends[b - own_from] for b in session.item_blocks]
    text_bytes = chars * (1 if first_wide == len(blocks) else 4)
    return output, LoopRecord(messages=messages, blocks=blocks, head_blocks=session.entry_block,
                              text_bytes=text_bytes, offset=session.offset, names=session.names, starts=starts,
                              start_chars=start_chars, first_wide=first_wide, states=session.states,
                              marks=session.marks,
                              reach=session.reach, max_index=session.max_index, loop=session.loop,
                              scans=dict(session.scan_answers))


class _Lineage:
    """The newest record of one conversation: each of its records extends the one before by identity, so the index's
    entries for the messages they share stay, pointing here, and a turn files only its new messages."""

    __slots__ = ("record",)

    def __init__(self, record: LoopRecord) -> None:
        self.record = record


class LoopRecords:
    """Recent renders' records, found by the identity of their leading messages: each record is filed under every
    prefix length, so a conversation that grew (or the extend's probes, which change one message) finds the record
    of its longest shared head. Bounded by bytes, least recently used dropped first; a record whose messages a newer
    record starts with is dropped at once (the conversation's earlier turn). The index files a conversation's
    records through its ``_Lineage``: a record that extends the one it replaces (the same message objects first)
    takes that record's entries over and files only the messages it adds."""

    def __init__(self, max_bytes: int) -> None:
        self._records: ByteLRU[int, LoopRecord] = ByteLRU(max_bytes, on_evict=self._forget)
        self._index: dict[tuple[int, int], _Lineage] = {}
        self._lineages: dict[int, _Lineage] = {}  # id(record) -> its lineage, for the records kept
        self._lock = threading.Lock()
        self.hits = 0  # a record found
        self.misses = 0
        self.resumed = 0  # renders that resumed their loop from a record
        self.scans_shortened = 0  # head scans that iterated only the messages after a record's (last_match_scan.py)

    def _forget(self, record: LoopRecord) -> None:
        lineage = self._lineages.pop(id(record), None)
        if lineage is None:
            return
        index = self._index
        for i, message in enumerate(record.messages):
            if index.get((i + 1, id(message))) is lineage:
                del index[(i + 1, id(message))]

    def stats(self) -> CacheStats:
        """For /metrics (caches/budget.py): a hit is a render that resumed, a miss one that looked and did not."""
        kept = self._records.stats()
        return kept._replace(hits=self.resumed, misses=self.hits + self.misses - self.resumed)

    def clear(self) -> None:
        """Drops every record, and the counters' counts (the template's proof at load leaves none behind)."""
        with self._lock:
            self._records.drop_oldest_while(lambda _: True)
            self.hits = self.misses = self.resumed = self.scans_shortened = 0

    def find(self, messages: list[Any]) -> tuple[LoopRecord | None, int]:
        """The record sharing the most leading messages (by identity) with ``messages``, and how many it shares."""
        index = self._index
        tries = 0
        for k in range(len(messages), 0, -1):
            lineage = index.get((k, id(messages[k - 1])))
            if lineage is None:
                continue
            record = lineage.record
            kept = record.messages
            if all(map(operator.is_, itertools.islice(kept, k - 1), itertools.islice(messages, k - 1))):
                self.hits += 1
                self._records.get(id(record))  # (recently used)
                return record, k
            tries += 1
            if tries >= 4:
                break
        self.misses += 1
        return None, 0

    def put(self, record: LoopRecord, replaces: LoopRecord | None) -> None:
        with self._lock:
            lineage, filed = None, 0
            # (the same objects first is the common case: checked without copying, before equality)
            same = replaces is not None and len(replaces.messages) <= len(record.messages) \
                and all(map(operator.is_, replaces.messages, record.messages))
            if replaces is not None and (same or replaces.messages == record.messages[:len(replaces.messages)]) \
                    and self._records.pop(id(replaces)) is not None:
                if same:
                    # the same objects first: replaces' entries stay valid, reaching the new record through the
                    # lineage (which keeps those objects alive, so their ids are not reused meanwhile)
                    lineage = self._lineages.pop(id(replaces), None)
                    filed = len(replaces.messages) if lineage is not None else 0
                else:
                    self._forget(replaces)
            if lineage is None:
                lineage = _Lineage(record)
            lineage.record = record
            self._lineages[id(record)] = lineage
            if not self._records.put(id(record), record, record.nbytes()):
                self._forget(record)
                return
            index = self._index
            for i in range(filed, len(record.messages)):
                index[(i + 1, id(record.messages[i]))] = lineage

