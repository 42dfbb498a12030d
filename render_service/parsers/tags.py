"""Tag search with hold-back: find a marker in streamed text, and keep back a suffix that may start one."""

from __future__ import annotations

import functools
import re
from typing import Any

from render_service.parsers.tools_common import WHITESPACE


@functools.lru_cache(maxsize=64)
def _partial_tag_pattern(tags: tuple[str, ...]) -> tuple[re.Pattern[str], int]:
    # every proper prefix of every tag, anchored at the end of the text; the leftmost match is the longest
    prefixes = {t[:k] for t in tags for k in range(1, len(t))}
    alternation = "|".join(re.escape(p) for p in sorted(prefixes, key=len, reverse=True))
    return re.compile(f"(?:{alternation})\\Z"), max(len(t) for t in tags) - 1


def partial_tag_len(buf: str, start: int, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of buf[start:] that is a proper prefix of one of ``tags``."""
    pattern, longest = _partial_tag_pattern(tags)
    m = pattern.search(buf, max(start, len(buf) - longest))
    return len(buf) - m.start() if m else 0


def find_tag(buf: str, start: int, tags: tuple[str, ...]) -> tuple[int, str | None]:
    """Earliest complete tag at or after ``start``: (its position, the tag).

    When there is none: (the end of the text that is certainly not part of a tag, None); the rest may be
    the beginning of a tag and must be held back.
    """
    best, best_tag = -1, ""
    for tag in tags:
        i = buf.find(tag, start)
        if i != -1 and (best == -1 or i < best or (i == best and len(tag) > len(best_tag))):
            best, best_tag = i, tag
    if best != -1:
        return best, best_tag
    return len(buf) - partial_tag_len(buf, start, tags), None


def skip_whitespace(buf: str, pos: int) -> int:
    n = len(buf)
    while pos < n and buf[pos] in WHITESPACE:
        pos += 1
    return pos


def skip_layout(state: Any, buf: str, pos: int) -> int:
    """Right after a call, whitespace is layout: skip it; ``state.after_call`` clears at the first other
    character (so a chunk of only whitespace keeps skipping)."""
    pos = skip_whitespace(buf, pos)
    if pos < len(buf):
        state.after_call = False
    return pos


def is_partial_tag(fragment: str, tags: tuple[str, ...]) -> bool:
    """True when ``fragment`` (the rest of the text) could still grow into one of ``tags``."""
    return any(len(fragment) < len(t) and t.startswith(fragment) for t in tags)
