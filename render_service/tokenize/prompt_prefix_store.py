"""Recent rendered prompts, found again by the text a new prompt starts with.

An agent's next turn is its previous prompt plus what is new. ``PrefixStore`` keeps recent prompts with their
token ids and the places where ``IncrementalEncoder`` cut them (just after each added token, with the number
of ids and JSON parts before each cut). For a new prompt it finds a stored one sharing a long head (one string
comparison on the usual turn), and the encoder reuses the stored ids up to the last cut inside the common
head, tokenizing only what follows.

Why that is exact: the cutter scans left to right; at each position it tries the added tokens, longest first,
reading only the characters a token would cover, and after a match goes on at its end. Take a cut ``c`` of a
stored prompt P, just after its added token M (which starts at ``s``), and a new text T with
``T[:n] == P[:n]``, ``n >= c``. The scan of T makes P's decisions at every position up to ``s``, unless some
added token X matches in T at such a position and not in P: X would then reach past ``n``, so past ``c``, and
so hold all of M (everything before ``c`` is common text) with characters after it. ``reach(M)``, the most
characters any added token holds after an occurrence of M (0 for the usual tokenizer: none contains
another), bounds how far past ``c`` that can read: with ``n >= c + reach(M)`` (the cut's ``need``) T is cut
the same way up to ``c``, the pieces before it are the same strings, and their ids are the same (encoding
is deterministic; pieces are independent: incremental_tokenizer's proof). The rest is cut and tokenized
afresh.

Found through checkpoints of the prompt's text (head_index.HeadIndex: the ``WINDOW`` characters before each of
base, 2 * base, 4 * base ...), so prompts that share only a system prompt and tools do not crowd one another out.
The store drops least recently used prompts past ``max_bytes`` (estimated), and at once a prompt whose ids a
newer one reused up to the last cut it could give (the same conversation's earlier turn).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import NamedTuple

from render_service.tokenize.head_index import HeadStore

WINDOW = 256
# Rough CPython sizes: a tuple slot plus an int object per id at most (the chunks are the piece cache's, counted
# again: they outlive an eviction there; fastokens' are 32-bit arrays, 4 bytes an id, so this overcounts them),
# two pointers per chunk (it and its JSON), four ints per cut.
_BYTES_PER_ID = 36
_BYTES_PER_PART = 16
_BYTES_PER_CUT = 4 * 36
_ENTRY_OVERHEAD = 400


class StoredPrompt(NamedTuple):
    text: str
    id_count: int
    # The ids a piece or an added token at a time (the piece cache's own tuples: a tuple of tuples of ints
    # leaves the garbage collector's tracking, a list of a prompt's ids would be walked by every collection).
    chunks: tuple[Sequence[int], ...]
    json_parts: tuple[bytes, ...]  # the JSON of each chunk's ids
    cuts: tuple[int, ...]  # offsets just after each added token, ascending
    needs: tuple[int, ...]  # the common head each cut needs: cut + reach of its token
    part_counts: tuple[int, ...]  # chunks (and JSON parts) before each cut
    id_counts: tuple[int, ...]  # ids before each cut


class Reuse(NamedTuple):
    """The ids of ``prompt`` before its cut number ``cut`` are the new text's too."""

    prompt: StoredPrompt
    cut: int


def common_head(text: str, other: str) -> int:
    """The length of the longest common head of ``text`` and ``other``. Compares memory (a binary search of
    ``startswith`` on slices), never characters one by one; copies at most ``len(other)`` characters."""
    if text.startswith(other):
        return len(other)
    if other.startswith(text):
        return len(text)
    low, high = 0, min(len(text), len(other))  # text[:low] == other[:low], text[:high] != other[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if text.startswith(other[low:middle], low):
            low = middle
        else:
            high = middle
    return low


def last_cut_within(prompt: StoredPrompt, common: int) -> int:
    """The index of ``prompt``'s last cut whose need is met by ``common`` characters of common head; -1: none.
    (A need exceeds its cut by less than the longest added token, so the walk back is short.)"""
    cut = bisect_right(prompt.cuts, common) - 1
    needs = prompt.needs
    while cut >= 0 and needs[cut] > common:
        cut -= 1
    return cut


def _size(prompt: StoredPrompt) -> int:
    text = prompt.text
    return (_ENTRY_OVERHEAD + len(text) * (1 if text.isascii() else 4) + _BYTES_PER_ID * prompt.id_count
            + _BYTES_PER_PART * len(prompt.chunks) + _BYTES_PER_CUT * len(prompt.cuts))


class PrefixStore(HeadStore[StoredPrompt, str]):
    """Per process, shared by the render lanes; prompts shorter than ``base`` characters are not kept."""

    def __init__(self, max_bytes: int, base: int = 1024) -> None:
        super().__init__(max_bytes, base, WINDOW)

    def find(self, text: str) -> Reuse | None:
        """The stored prompt and cut that reuse the most of ``text``; None when nothing worth a lookup is found."""
        for candidates in self._index.candidates(text):
            best: Reuse | None = None
            best_at = -1
            for prompt in candidates:  # stored prompts are never changed: compared outside the lock
                cut = last_cut_within(prompt, common_head(text, prompt.text))
                if cut >= 0 and prompt.cuts[cut] > best_at:
                    best, best_at = Reuse(prompt, cut), prompt.cuts[cut]
            if best is not None:
                self._index.touch(best.prompt)
                return best
        return None

    def exhausted(self, reuse: Reuse) -> bool:
        """Whether ``reuse`` took the last cut its prompt can ever give (one whose need fits in the prompt)."""
        return reuse.cut >= last_cut_within(reuse.prompt, len(reuse.prompt.text))

    def add(self, prompt: StoredPrompt, replaces: StoredPrompt | None = None) -> None:
        """Keeps ``prompt`` (if it is long enough to be filed and fits); drops ``replaces``, a prompt whose ids
        ``prompt`` reused up to the last cut it can give (``exhausted``): ``prompt`` has the same cuts up to
        there and the same text a margin beyond, so any text reuses at least as much of ``prompt`` (the same
        conversation's earlier turn)."""
        self._index.add(prompt, prompt.text, _size(prompt), replaces)
