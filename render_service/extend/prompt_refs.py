"""Recent answers' prompt ids, named by a reference the answer carries, so the next turn's extend need not resend them.

An RL rollout's next prompt starts with its previous prompt. Sending that prompt back as ids costs the render
linear work every turn (a 200k-token prompt is 1.4 MB of JSON to decode and check). A render asked for
``return_prompt_ref`` files its ids here and answers a ``prompt_ref``; the next turn's ``previous_turn.prompt_ref``
takes them back. An extend files its own prompt without copying the earlier one: an entry holds its ids (and
their JSON, and the masks' JSON where the answer had masks) as the chunks they were made of, the earlier
entry's chunks shared, so filing and answering cost what the new turn adds.

A reference is random (144 bits) and is found only for the client that filed it: it names nothing another
client or another replica can use, and says nothing of the prompt. An unknown reference is a 404 that tells the
client to send the ids instead.

Bounded by bytes: each entry counts all of its ids (4 bytes each, its JSON, 5 more a token with masks, and the
messages it keeps: the template's, with masks, and the request's, for a next turn that sends only its new ones),
even those it shares with an earlier entry, so the bound holds whatever is dropped first.
Each client may hold at most ``client_bytes`` (its own oldest dropped first), and all clients ``max_bytes`` (the
oldest dropped first).
"""

from __future__ import annotations

import array
import secrets
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from render_service.caches.byte_lru import CacheStats
from render_service.tokenize.ids_json import ids_json
from render_service.tokenize.incremental_tokenizer import PromptIds
from render_service.wire.body_prefix_store import StoredBody

_ENTRY_OVERHEAD = 512
# The messages an entry with masks keeps alive (the message memo may have dropped them): a slot and a dict each,
# and their text, about 4 bytes for each token it encodes to.
_BYTES_PER_MESSAGE = 256
_MESSAGE_BYTES_PER_TOKEN = 4


class IdRun:
    """Integers (token ids, message indices or mask flags) as the chunks they were made of, with each chunk's JSON
    array body (no brackets). A run is a link of a chain: its own chunks and the run it extends, so appending
    costs the appended ids alone, every run of a conversation shares the chunks before it, and nothing walks the
    earlier chunks until the whole run is read (``view``'s chunks, ``tolist``). Immutable once made."""

    __slots__ = ("before", "own_chunks", "own_parts", "count", "json_bytes")

    def __init__(self, before: IdRun | None = None, own_chunks: tuple[Sequence[int], ...] = (),
                 own_parts: tuple[bytes, ...] = (), count: int = 0, json_bytes: int = 0) -> None:
        self.before = before
        self.own_chunks = own_chunks
        self.own_parts = own_parts
        self.count = count  # ids in the whole run
        self.json_bytes = json_bytes  # the whole run's JSON parts' length

    def then(self, ids: Sequence[int]) -> IdRun:
        """The run with ``ids`` appended (kept as a 32-bit array where they fit: 4 bytes an id)."""
        if not ids:
            return self
        chunk: Sequence[int]
        try:
            chunk = ids if isinstance(ids, array.array) else array.array("i", ids)
        except (OverflowError, TypeError):
            chunk = tuple(ids)
        part = ids_json(ids)
        return IdRun(self if self.count else None, (chunk,), (part,), self.count + len(ids),
                     self.json_bytes + len(part))

    def _links(self) -> list[IdRun]:
        """The chain's runs, oldest first (iteratively: a rollout's chain is two links a turn)."""
        links: list[IdRun] = []
        run: IdRun | None = self
        while run is not None:
            links.append(run)
            run = run.before
        links.reverse()
        return links

    def listed(self) -> tuple[list[Sequence[int]], list[bytes]]:
        chunks: list[Sequence[int]] = []
        parts: list[bytes] = []
        for run in self._links():
            chunks += run.own_chunks
            parts += run.own_parts
        return chunks, parts

    def newest_chunks(self) -> Iterator[Sequence[int]]:
        run: IdRun | None = self
        while run is not None:
            yield from reversed(run.own_chunks)
            run = run.before

    def view(self) -> PromptIds:
        """A ``PromptIds`` over the chunks (written to JSON from the parts; its ids never copied into one list)."""
        return PromptIds.of_chain(self, self.count)

    def tolist(self) -> list[int]:
        out: list[int] = []
        for chunk in self.listed()[0]:
            out.extend(chunk)
        return out


def id_run(ids: Sequence[int]) -> IdRun:
    """``ids`` as a run: a ``PromptIds`` keeps its chunks (one link), anything else becomes one chunk."""
    if isinstance(ids, PromptIds) and ids.json_parts:
        return IdRun(None, tuple(ids.chunks), tuple(ids.json_parts), len(ids), sum(map(len, ids.json_parts)))
    return IdRun().then(list(ids) if isinstance(ids, PromptIds) else ids)


@dataclass(frozen=True)
class ChatHistory:
    """The request messages a chat prompt was rendered from, so that the next turn may send only the messages from
    its sampled turn on (``previous_turn.messages: "new"``, extend/history.py). ``values`` are the messages as
    decoded; ``memo``, where they came through the message memo, the same messages as the body store files them
    but without the body (their entries, their prepared forms as the render left them, their tool calls and image
    messages counted), so that the next turn walks only what it adds."""

    values: tuple[Any, ...]
    memo: StoredBody | None = None


@dataclass(frozen=True)
class StoredPrompt:
    """One answer's prompt ids; where the answer had masks, their runs too, and the template messages they
    attribute tokens to (found again by identity, or equality); ``history``: the request messages it was
    rendered from, where a chat render filed it."""

    ids: IdRun
    messages: tuple[Any, ...] = ()
    indices: IdRun | None = None
    flags: IdRun | None = None
    history: ChatHistory | None = None

    @property
    def size(self) -> int:
        masks = 0
        if self.indices is not None and self.flags is not None:
            masks = 5 * self.ids.count + self.indices.json_bytes + self.flags.json_bytes
        messages = 0
        for kept in (self.messages, self.history.values if self.history is not None else ()):
            if kept:
                messages += _BYTES_PER_MESSAGE * len(kept) + _MESSAGE_BYTES_PER_TOKEN * self.ids.count
        return _ENTRY_OVERHEAD + 4 * self.ids.count + self.ids.json_bytes + masks + messages


class PromptRefs:
    """Prompts by reference, bounded per client and in all (the module's docstring says how)."""

    def __init__(self, max_bytes: int, client_bytes: int | None = None) -> None:
        if max_bytes < 0:
            raise ValueError("the prompt references' bound must be >= 0 bytes")
        self.max_bytes = max_bytes
        self.client_bytes = max_bytes if client_bytes is None else min(client_bytes, max_bytes)
        self._lock = threading.Lock()
        self._all: OrderedDict[str, tuple[str, StoredPrompt]] = OrderedDict()  # ref -> (client, entry)
        self._by_client: dict[str, OrderedDict[str, int]] = {}  # client -> ref -> size, oldest first
        self._client_totals: dict[str, int] = {}
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def file(self, client: str, stored: StoredPrompt) -> str | None:
        """Files ``stored`` for ``client``; its reference, or None where it is larger than a client may hold."""
        size = stored.size
        if size > self.client_bytes:
            return None
        ref = "pr-" + secrets.token_urlsafe(18)
        with self._lock:
            own = self._by_client.setdefault(client, OrderedDict())
            while own and self._client_totals.get(client, 0) + size > self.client_bytes:
                self._drop(next(iter(own)), evicted=True)
            while self._all and self.bytes + size > self.max_bytes:
                self._drop(next(iter(self._all)), evicted=True)
            own = self._by_client.setdefault(client, OrderedDict())
            self._all[ref] = (client, stored)
            own[ref] = size
            self._client_totals[client] = self._client_totals.get(client, 0) + size
            self.bytes += size
        return ref

    def get(self, client: str, ref: str) -> StoredPrompt | None:
        with self._lock:
            found = self._all.get(ref)
            if found is None or found[0] != client:
                self.misses += 1
                return None
            self._all.move_to_end(ref)
            self._by_client[client].move_to_end(ref)
            self.hits += 1
            return found[1]

    def _drop(self, ref: str, evicted: bool = False) -> None:
        client, _ = self._all.pop(ref)
        own = self._by_client[client]
        size = own.pop(ref)
        self.bytes -= size
        self._client_totals[client] -= size
        if not own:
            del self._by_client[client]
            del self._client_totals[client]
        if evicted:
            self.evictions += 1

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self.hits, self.misses, self.evictions, self.bytes, self.max_bytes, len(self._all))
