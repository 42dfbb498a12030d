"""Prompt tokenization whose cost follows what is new in the prompt.

Agents resend a growing conversation every turn. ``IncrementalEncoder`` cuts the rendered prompt at the
tokenizer's added tokens (``<|im_start|>``, ``<tool_response>``, ...), looks each piece between them up in
a bytes-bounded LRU keyed by the piece's text, and tokenizes only the pieces it has not seen. Before that, a
stored earlier prompt that shares its head (prompt_prefix_store.py: the same conversation's previous turn)
gives the ids up to its last cut inside the common head, and only the rest is cut and looked up.

Why the pieces are independent (``independence_violation`` checks each step on the loaded tokenizer):
``tokenizers`` itself first cuts the text at every added token that matches on raw text (leftmost, then
longest), and runs the rest of its pipeline (normalizer, normalized added tokens, pre-tokenizer, model) on
each piece separately. So encode(a + T + b) == encode(a) + [id(T)] + encode(b) whenever the cut at T is one
``tokenizers`` makes, which holds when the cutter matches the same token set the same way and no step looks
beyond its piece. The steps that could: an added token that strips whitespace or matches single words only
(it reaches into its neighbours), a Metaspace pre-tokenizer with ``prepend_scheme: first`` (it treats the
piece at offset 0 differently), BPE dropout (random), and anything of a type we have not checked. The
tiktoken fast path (tiktoken_fast_path.TiktokenEncoder) is built the same way and cuts with the same
splitter class over the same tokens. The property tests in tests/test_incremental_tokenizer.py check the
result against ``tokenizers`` and transformers on every tokenizer kind above.
"""

from __future__ import annotations

import array
import itertools
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol, overload

import msgspec

from render_service.caches.byte_lru import ByteLRU
from render_service.tokenize.ids_json import ids_json
from render_service.tokenize.prompt_prefix_store import PrefixStore, StoredPrompt
from render_service.tokenize.tokenizer import TextTokenizer

# Pre-tokenizers and normalizers that act on each piece alone (tokenizers 0.2x); Metaspace is checked further.
PIECEWISE_PRE_TOKENIZERS = frozenset({
    "ByteLevel", "Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit", "BertPreTokenizer",
    "CharDelimiterSplit", "UnicodeScripts", "Metaspace", "Sequence",
})
PIECEWISE_NORMALIZERS = frozenset({
    "NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Strip", "StripAccents", "Replace", "Prepend", "BertNormalizer",
    "Precompiled", "Nmt", "ByteLevel", "Sequence",
})
DEFAULT_CACHE_BYTES = 256 * 1024 * 1024
# How far before a position ``tail_ids`` looks for a provable cut (a chat template writes an added token at least
# once a message).
TAIL_SEARCH_CHARS = 16 * 1024
# Rough CPython sizes: a list slot plus an int object per token id, a str header, a dict/LRU slot per entry.
_BYTES_PER_ID = 36
_BYTES_PER_PACKED_ID = 4
_ARRAY_OVERHEAD = 80
_ENTRY_OVERHEAD = 200


def _ids_bytes(ids: Sequence[int]) -> int:
    """What a piece's ids hold: 4 bytes an id in a 32-bit array (as fastokens' batch gives them), else an int
    object and a slot each."""
    if type(ids) is array.array:
        return _ARRAY_OVERHEAD + _BYTES_PER_PACKED_ID * len(ids)
    return (_BYTES_PER_ID + 8) * len(ids)


def _step_violation(step: dict[str, Any] | None, allowed: frozenset[str], kind: str) -> str | None:
    if not step:
        return None
    name = step.get("type")
    if name not in allowed:
        return f"{kind} {name} is not known to act on each piece alone"
    if name == "Sequence":
        for inner in step.get("pretokenizers") or step.get("normalizers") or []:
            violation = _step_violation(inner, allowed, kind)
            if violation:
                return violation
    if name == "Metaspace" and step.get("prepend_scheme", "always") == "first":
        return "Metaspace prepends its replacement to the first piece only (prepend_scheme: first)"
    return None


def independence_violation(tokenizer: TextTokenizer) -> str | None:
    """None when pieces cut at raw-matched added tokens tokenize independently; else why not."""
    spec = tokenizer.pipeline_spec
    if spec is None:
        return "the tokenizer.json could not be read as a plain spec"
    if getattr(tokenizer.hf, "encode_special_tokens", False):
        return "encode_special_tokens is set (added tokens are not cut out)"
    for token in tokenizer.hf.get_added_tokens_decoder().values():
        if not token.normalized and (token.lstrip or token.rstrip or token.single_word):
            return f"added token {token.content!r} strips whitespace or matches single words"
    model = spec.get("model") or {}
    if model.get("dropout"):
        return "BPE dropout is random"
    return (_step_violation(spec.get("normalizer"), PIECEWISE_NORMALIZERS, "normalizer")
            or _step_violation(spec.get("pre_tokenizer"), PIECEWISE_PRE_TOKENIZERS, "pre_tokenizer"))


class SegmentCache:
    """Token ids of prompt pieces, least recently used dropped first once ``max_bytes`` (estimated) is reached: a
    ``ByteLRU`` (caches/byte_lru.py) of text -> (ids, their JSON array's inside: b"1,2,3").

    Keyed by the piece's text: a dict hashes it and compares it in full on a hit, so a hit is never a
    collision. One per process (not shared between workers). Ids are kept as 32-bit arrays (fastokens' batch
    path: 4 bytes an id, and no int object is made for an id until the ids are read) or tuples (the other
    paths): a collection visits an array as one object holding no references, and a tuple of ints not at
    all, where a list's every id would be walked (about half a second for a few million)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("the render cache size must be >= 0 bytes")
        # one huge piece must not flush everything else (ByteLRU's eighth)
        self.lru: ByteLRU[str, tuple[Sequence[int], bytes]] = ByteLRU(max_bytes)
        self._entries = self.lru._entries
        self._lock = self.lru._lock  # the two render lanes share the cache

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, text: str) -> tuple[Sequence[int], bytes] | None:
        """(ids, their JSON array's inside: b"1,2,3") of a piece seen before, else None."""
        return self.get_many([text])[0]

    def get_many(self, texts: list[str]) -> list[tuple[Sequence[int], bytes] | None]:
        """The (ids, JSON) of each text seen before, else None (always for ""); one lock for all of them (a
        prompt has hundreds of pieces)."""
        entries = self._entries
        get = entries.get
        touch = entries.move_to_end
        found: list[tuple[Sequence[int], bytes] | None] = []
        append = found.append
        hits = misses = 0
        lru = self.lru
        with self._lock:
            for text in texts:
                entry = get(text) if text else None
                if entry is not None:
                    touch(text)
                    hits += 1
                    append(entry[0])
                else:
                    if text:
                        misses += 1
                    append(None)
            lru.hits += hits
            lru.misses += misses
        return found

    def put(self, text: str, ids: Sequence[int], json: bytes) -> None:
        self.put_many([(text, ids, json)])

    def put_many(self, pieces: list[tuple[str, Sequence[int], bytes]]) -> None:
        """Keeps (text, ids, JSON) of each piece that fits, dropping the least recently used past the bound."""
        self.lru.put_many([(text, (ids, json), _ENTRY_OVERHEAD + len(text) * (1 if text.isascii() else 4)
                            + len(json) + _ids_bytes(ids)) for text, ids, json in pieces])

    # (after the methods: a property named ``bytes`` would hide the type from their annotations)
    @property
    def max_bytes(self) -> int:
        return self.lru.max_bytes

    @property
    def bytes(self) -> int:
        return self.lru.bytes

    @property
    def evictions(self) -> int:
        return self.lru.evictions


class ChunkChain(Protocol):
    """Ids kept as a chain of chunks (extend/prompt_refs.IdRun): listed whole only when read whole."""

    def listed(self) -> tuple[list[Sequence[int]], list[bytes]]:
        """Every chunk and its JSON array body, oldest first."""
        ...

    def newest_chunks(self) -> Iterator[Sequence[int]]:
        """The chunks from the last back, without listing them all."""
        ...


class PromptIds(Sequence[int]):
    """A prompt's token ids as the pieces they were cut in, without a list of every id: the render server
    writes them to JSON from the pieces' cached JSON (``json_array``: a 128k-token prompt's ids cost a join
    instead of 128k integer conversions) and reads only their count and the tail (prompt_ends_reasoning),
    so a prompt the cache mostly holds never copies its ids. ``tolist()`` gives them as a list (built once).
    Made ``of_chain``, the chunks are listed on first read: an answer that writes only its tail never lists
    the ones it shares with earlier prompts."""

    __slots__ = ("_chunks", "_json_parts", "_count", "_list", "_chain")

    def __init__(self, chunks: list[Sequence[int]], json_parts: list[bytes], count: int) -> None:
        self._chunks: list[Sequence[int]] | None = chunks
        self._json_parts: list[bytes] | None = json_parts
        self._count = count
        self._list: list[int] | None = None
        self._chain: ChunkChain | None = None

    @classmethod
    def of_chain(cls, chain: ChunkChain, count: int) -> PromptIds:
        ids = cls.__new__(cls)
        ids._chunks = ids._json_parts = ids._list = None
        ids._count, ids._chain = count, chain
        return ids

    def _listed(self) -> None:
        assert self._chain is not None
        self._chunks, self._json_parts = self._chain.listed()

    @property
    def chunks(self) -> list[Sequence[int]]:
        if self._chunks is None:
            self._listed()
        assert self._chunks is not None
        return self._chunks

    @property
    def json_parts(self) -> list[bytes]:
        if self._json_parts is None:
            self._listed()
        assert self._json_parts is not None
        return self._json_parts

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist()) if self._list is not None else itertools.chain.from_iterable(self.chunks)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if type(index) is slice and index.step is None and index.stop is None and index.start is not None \
                and -self._count <= index.start < 0 and self._list is None:
            return self._tail(-index.start)  # the tail: from the last pieces alone
        return self.tolist()[index]

    def _tail(self, n: int) -> list[int]:
        parts: list[Sequence[int]] = []
        newest: Iterator[Sequence[int]]
        if self._chunks is not None:
            newest = reversed(self._chunks)
        else:
            assert self._chain is not None
            newest = self._chain.newest_chunks()
        for chunk in newest:
            if len(chunk) >= n:
                parts.append(chunk[len(chunk) - n:])
                break
            parts.append(chunk)
            n -= len(chunk)
        tail: list[int] = []
        for part in reversed(parts):
            tail.extend(part)
        return tail

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PromptIds):
            other = other.tolist()
        return self.tolist() == other

    __hash__ = None  # type: ignore[assignment]  # (as a list's: equal to one, so not hashable)

    def __repr__(self) -> str:
        return f"PromptIds({self.tolist()!r})"

    def tolist(self) -> list[int]:
        if self._list is None:
            ids: list[int] = []
            extend = ids.extend
            for chunk in self.chunks:
                extend(chunk)
            self._list = ids
        return self._list

    def json_array(self) -> msgspec.Raw:
        return msgspec.Raw(b"[" + b",".join(self.json_parts) + b"]")


_EMPTY_ENTRY: tuple[Sequence[int], bytes] = ((), b"")


def _check_unicode(piece: str, text: str) -> None:
    try:
        piece.encode("utf-8")
    except UnicodeEncodeError:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # the index in the whole prompt, as the tokenizer's encode says
            raise ValueError(f"text is not valid Unicode (lone surrogate at index {exc.start})") from None
        raise


def added_token_reach(token: str, added: Iterable[str]) -> int:
    """The most characters an added token holds after an occurrence of ``token`` (prompt_prefix_store: how
    much common text a cut after ``token`` needs beyond it); 0 when no other added token contains it."""
    reach = 0
    for other in added:
        at = other.find(token)
        while at >= 0:
            reach = max(reach, len(other) - at - len(token))
            at = other.find(token, at + 1)
    return reach


class IncrementalEncoder:
    """``encode(text)``: the tokenizer's ids for a whole prompt, tokenizing only pieces not seen before.

    ``enabled`` is False (and ``reason`` says why) when the cache is off or the tokenizer's pieces are not
    provably independent; ``encode`` is then the tokenizer's own.
    """

    def __init__(self, tokenizer: TextTokenizer, cache_bytes: int = DEFAULT_CACHE_BYTES, *,
                 prefix_base: int = 1024) -> None:
        """``cache_bytes``: the bound of the piece cache (three quarters) and the prefix store (a quarter)
        together; ``prefix_base``: the shortest prompt the prefix store keeps, in characters."""
        self.tokenizer = tokenizer
        self.cache = SegmentCache(cache_bytes - cache_bytes // 4)
        violation = None if cache_bytes else "the render cache is off (--render-cache-bytes 0)"
        violation = violation or independence_violation(tokenizer)
        self.enabled = violation is None
        self.reason = violation or "pieces between added tokens are tokenized once and cached"
        raw = {tok.content: i for i, tok in tokenizer.hf.get_added_tokens_decoder().items()
               if tok.content and not tok.normalized}
        self._added_ids = raw
        self._added_chunks = {content: ((token_id,), b"%d" % token_id) for content, token_id in raw.items()}
        # Longest first: at one position Python's alternation takes the first branch that matches, so this
        # is the leftmost-longest match tokenizers' own added-token trie makes (as tiktoken_fast_path's).
        longest_first = sorted(raw, key=len, reverse=True)
        self._cutter = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")") if raw else None
        self.prefixes = PrefixStore(cache_bytes // 4, prefix_base) if self.enabled and raw else None
        self._reach = {token: added_token_reach(token, raw) for token in raw}
        self._longest_added = max(map(len, raw), default=0)
        self.reused_tokens = 0  # ids taken from a stored prompt's head, since start
        self.hit_tokens = 0  # since the last take_counts (the metrics read them after each render)
        self.miss_tokens = 0

    def take_counts(self) -> tuple[int, int]:
        """(tokens served from the cache, tokens tokenized) since the last call."""
        with self.cache._lock:
            counts = self.hit_tokens, self.miss_tokens
            self.hit_tokens = self.miss_tokens = 0
        return counts

    def encode(self, text: str) -> list[int]:
        if not self.enabled or self._cutter is None:
            return self.tokenizer.encode(text)
        return self._encode_view(text).tolist()

    def encode_ids(self, text: str) -> Sequence[int]:
        """``encode(text)``, as a ``PromptIds`` view (its ids never copied into one list) when the cache is on."""
        if not self.enabled or self._cutter is None:
            return self.tokenizer.encode(text)
        return self._encode_view(text)

    @property
    def cut_context_chars(self) -> int:
        """How many characters before a cut ``tail_ids`` reads to prove it (the longest added token's length)."""
        return self._longest_added

    def encode_part(self, text: str) -> list[int]:
        """``encode(text)`` for text that is not a whole prompt (what an extend appends to one): through the piece
        cache, neither looked up among nor filed with the prompts' prefixes."""
        if not self.enabled or self._cutter is None:
            return self.tokenizer.encode(text)
        chunks: list[Sequence[int]] = []
        json_parts: list[bytes] = []
        count, missed = self._encode_pieces(text, 0, 0, chunks, json_parts, ([], [], [], []))
        with self.cache._lock:
            self.miss_tokens += missed
            self.hit_tokens += count - missed
        return PromptIds(chunks, json_parts, count).tolist()

    def cuts_at(self, text: str, at: int, floor: int = 0) -> bool:
        """Whether the tokenizer provably cuts ``text`` at ``at`` (``encode(text)`` is ``encode(text[:at])`` and
        then ``encode(text[at:])``): an added token starts there, or one ends there that starts at such a cut,
        and no added token starting in the ``cut_context_chars`` before it reaches past it (``tail_ids`` says
        why that suffices). ``floor``: as in ``tail_ids`` (no cut is proved before it). False where the cache is
        off."""
        if not self.enabled or self._cutter is None or at < floor:
            return False
        if at >= len(text):
            return False
        cutter = self._cutter
        if self._no_crossing(text, at):
            match = cutter.match(text, at)
            if match is not None:
                return True
        # an added token that ends at ``at``, matched whole from a cut (the scan takes the longest match there)
        for length in range(1, min(self._longest_added, at - floor) + 1):
            start = at - length
            match = cutter.match(text, start)
            if match is not None and match.end() == at and self._no_crossing(text, start):
                return True
        return False

    def _no_crossing(self, text: str, p: int) -> bool:
        """No added token starting in the ``cut_context_chars - 1`` characters before ``p`` reaches past it."""
        cutter = self._cutter
        assert cutter is not None
        for q in range(max(0, p - self._longest_added + 1), p):
            m = cutter.match(text, q)
            if m is not None and m.end() > p:
                return False
        return True

    def tail_ids(self, text: str, before: int, floor: int = 0) -> list[int] | None:
        """The last ids of ``encode(text)``: those of ``text[p:]``, for a ``p`` at or before ``before`` where an
        added token starts that the tokenizer provably cuts at in the whole text; None where the cache is off or
        no such cut lies within ``TAIL_SEARCH_CHARS`` before ``before``. Costs what ``text[p:]`` costs.

        ``floor``: no cut is taken before it, so ``text`` may be the end of a longer text, ``cut_context_chars``
        or more of it before ``floor``: the ids are then that longer text's last ones.

        Why the cut at ``p`` is the tokenizer's: its cutter scans left to right, taking at each position the
        longest added token there. Where no added token starts in the ``longest - 1`` characters before ``p`` and
        reaches past ``p``, every match the scan takes before ``p`` ends at or before ``p``, so it arrives at ``p``
        and cuts there (``encode(text) == encode(text[:p]) + encode(text[p:])``, the pieces' independence)."""
        if not self.enabled or self._cutter is None:
            return None
        cutter = self._cutter
        longest = self._longest_added
        low = max(floor, before - TAIL_SEARCH_CHARS)
        starts = [m.start() for m in cutter.finditer(text, low, min(len(text), before + longest))
                  if m.start() <= before]
        for p in reversed(starts):
            crossing = False
            for q in range(max(0, p - longest + 1), p):
                m = cutter.match(text, q)
                if m is not None and m.end() > p:
                    crossing = True
                    break
            if crossing:
                continue
            chunks: list[Sequence[int]] = []
            json_parts: list[bytes] = []
            count, _ = self._encode_pieces(text, p, 0, chunks, json_parts, ([], [], [], []))
            return PromptIds(chunks, json_parts, count).tolist()
        return None

    def _encode_view(self, text: str) -> PromptIds:
        store = self.prefixes
        reuse = store.find(text) if store is not None else None
        if reuse is None:
            start = 0
            reused = 0
            chunks: list[Sequence[int]] = []
            json_parts: list[bytes] = []
            cuts: list[int] = []
            needs: list[int] = []
            part_counts: list[int] = []
        else:  # ids up to one of a stored prompt's cuts inside the common head (prompt_prefix_store.py)
            prompt, cut = reuse
            start = prompt.cuts[cut]
            kept = prompt.part_counts[cut]
            chunks = list(prompt.chunks[:kept])
            reused = prompt.id_counts[cut]
            json_parts = list(prompt.json_parts[:kept])
            cuts = list(prompt.cuts[:cut + 1])
            needs = list(prompt.needs[:cut + 1])
            part_counts = list(prompt.part_counts[:cut + 1])
            id_counts = list(prompt.id_counts[:cut + 1])
        if reuse is None:
            id_counts = []
        total, missed = self._encode_pieces(text, start, reused, chunks, json_parts,
                                            (cuts, needs, part_counts, id_counts))
        if store is not None:
            store.add(StoredPrompt(text, total, tuple(chunks), tuple(json_parts), tuple(cuts), tuple(needs),
                                   tuple(part_counts), tuple(id_counts)),
                      replaces=None if reuse is None or not store.exhausted(reuse) else reuse.prompt)
        with self.cache._lock:  # counted from both render lanes
            self.miss_tokens += missed
            self.hit_tokens += total - missed
            self.reused_tokens += reused
        return PromptIds(chunks, json_parts, total)

    def _encode_pieces(self, text: str, start: int, count: int, chunks: list[Sequence[int]],
                       json_parts: list[bytes], cut_lists: tuple[list[int], list[int], list[int], list[int]]
                       ) -> tuple[int, int]:
        """Appends the ids of ``text[start:]`` (``start``: 0 or just after an added token; ``count`` ids before
        it) to ``chunks`` a piece or an added token at a time, their JSON to ``json_parts``, and to
        ``cut_lists`` (StoredPrompt's cuts, needs, part_counts, id_counts) its cuts. Tokenizes the pieces the
        cache lacks; returns (the ids in all, how many it tokenized)."""
        cache = self.cache
        # split() with a group alternates [piece, token, piece, token, ..., piece]: pieces at even places
        parts = self._cutter.split(text[start:] if start else text)  # type: ignore[union-attr]
        pieces = parts[0::2]
        entries = cache.get_many(pieces)
        fresh: list[tuple[str, Sequence[int], bytes]] = []
        missed = 0
        new_at: list[int] = []
        for k, entry in enumerate(entries):
            if entry is None:
                piece = pieces[k]
                if piece:
                    if not piece.isascii():
                        # Lone surrogates: the tokenizer's ValueError. Only new pieces need the check: a hit
                        # is a piece that passed it, and added tokens are valid text.
                        _check_unicode(piece, text)
                    new_at.append(k)
                else:  # between two adjacent added tokens, or at either end
                    entries[k] = _EMPTY_ENTRY
        if new_at:  # every new piece in one tokenizer call (a cold prompt has hundreds)
            new_pieces = [pieces[k] for k in new_at]
            for k, piece, piece_ids in zip(new_at, new_pieces,
                                           self.tokenizer.encode_many_between_added(new_pieces), strict=True):
                piece_json = ids_json(piece_ids)
                fresh.append((piece, piece_ids, piece_json))
                missed += len(piece_ids)
                entries[k] = (piece_ids, piece_json)
        if fresh:
            cache.put_many(fresh)  # outside the lookup: another lane keeps finding hits meanwhile
        add_chunk = chunks.append
        add_json = json_parts.append
        cuts, needs, part_counts, id_counts = cut_lists
        add_cut = cuts.append
        add_need = needs.append
        add_part_count = part_counts.append
        add_id_count = id_counts.append
        reach = self._reach
        added = self._added_chunks
        at = start
        tokens = iter(parts[1::2])
        for k, entry in enumerate(entries):
            piece_ids, piece_json = entry or _EMPTY_ENTRY  # (every entry is filled in by now)
            if piece_json:  # (empty exactly when there are no ids)
                count += len(piece_ids)
                add_chunk(piece_ids)
                add_json(piece_json)
            token = next(tokens, None)
            if token is not None:
                token_chunk, token_json = added[token]
                count += 1
                add_chunk(token_chunk)
                add_json(token_json)
                at += len(pieces[k]) + len(token)
                add_cut(at)
                add_need(at + reach[token])
                add_part_count(len(json_parts))
                add_id_count(count)
        return count, missed
