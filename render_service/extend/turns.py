"""Which message each token of a rendered prompt came from, and whether the model generated it (loss masks).

Boundaries come from the template itself: message ``i`` starts where the render of the messages before it stops
agreeing with the whole render, and an assistant message's own text starts after the header the template writes
as its generation prompt. A template with ``{% generation %}`` blocks marks assistant tokens itself (vLLM's
``return_assistant_tokens_mask``, ``templates.assistant_token_mask``); others are marked from those boundaries.
Tokens after the last message (the generation prompt) belong to index ``len(messages)``.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from render_service.extend.bridge import PROBE, common_prefix, common_suffix, with_message, with_messages
from render_service.templates.chat_template import assistant_token_mask
from render_service.templates.loop_resume import LoopOutput


class BlockText:
    """A render's text as the blocks its template yielded (``LoopOutput``), read only where asked: two renders of
    one conversation resumed from the same record share most blocks, so where they part is found a block at a
    time (compared in C, by identity first) and only the text after it is joined."""

    def __init__(self, output: LoopOutput) -> None:
        self.blocks = output.blocks
        self.length = output.chars
        self._ends: list[int] | None = None

    def __len__(self) -> int:
        return self.length

    def ends(self) -> list[int]:
        """Where each block ends, in characters."""
        if self._ends is None:
            self._ends = list(itertools.accumulate(map(len, self.blocks)))
        return self._ends

    def start_of(self, block: int) -> int:
        return self.ends()[block - 1] if block > 0 else 0

    def text_from(self, block: int) -> str:
        return "".join(self.blocks[block:])

    def text(self) -> str:
        return "".join(self.blocks)

    def find(self, marker: str, start: int, stop: int) -> int:
        """``text.find(marker, start, stop)``, joining only the blocks from ``start`` to ``stop``."""
        ends = self.ends()
        first = bisect.bisect_right(ends, start)
        last = min(len(self.blocks), bisect.bisect_left(ends, stop) + 1)
        base = self.start_of(first)
        at = "".join(self.blocks[first:last]).find(marker, start - base, stop - base)
        return at + base if at >= 0 else -1


Text = str | BlockText


def prefix_and_suffix(full: Text, alt: Text) -> tuple[int, int]:
    """The common head of two renders, and their common tail within what follows that head in both."""
    if isinstance(full, BlockText) and isinstance(alt, BlockText):
        same = common_prefix(full.blocks, alt.blocks)
        start = full.start_of(same)
        rest_full, rest_alt = full.text_from(same), alt.text_from(same)
    else:
        whole_full = full.text() if isinstance(full, BlockText) else full
        whole_alt = alt.text() if isinstance(alt, BlockText) else alt
        start = common_prefix(whole_full, whole_alt)
        rest_full, rest_alt = whole_full[start:], whole_alt[start:]
    head = common_prefix(rest_full, rest_alt)
    tail = min(common_suffix(rest_full, rest_alt), len(rest_full) - head, len(rest_alt) - head)
    return start + head, tail


def probe_of(message: dict[str, Any]) -> dict[str, Any]:
    """A message of the same role (and name, tool call id) whose only content is ``bridge.PROBE``."""
    probe = {key: value for key, value in message.items() if key in ("role", "name", "tool_call_id")}
    probe["content"] = PROBE if isinstance(message.get("content"), (str, type(None))) \
        else [{"type": "text", "text": PROBE}]
    return probe


def strided_probes(render_output: Callable[..., LoopOutput | None], messages: list[dict[str, Any]],
                   arguments: dict[str, Any], full: LoopOutput, first: int = 0) -> dict[int, tuple[int, int]]:
    """Many messages' probes from a few renders: every ``reach + 1``-th message probed at once, so that no
    probed message is within reach of another's iteration (nor its ``previtem``). Where such a render's head,
    outside names and every unprobed iteration's text equal the full render's, and each probed iteration starts
    from the full render's namespaces, a probed iteration read nothing that differs from the full render but its
    own message: where its text differs is that message's own text, as one probe alone would find it. Answers
    (common head, common tail with ``full``) per message found so (``text_turns``'s ``known``); the others are
    left to one probe each (those before ``first``, those a constant index reads, the last message, whose
    iteration's blocks also hold the template's tail, and every message of a render that fails a check)."""
    starts, states = full.starts, full.states
    if starts is None or states is None or full.names is None:
        return {}
    stride = full.reach + 1
    low = max(first, full.max_index + 1, full.offset)
    ends = list(itertools.accumulate(map(len, full.blocks)))
    known: dict[int, tuple[int, int]] = {}
    for residue in range(stride):
        group = [i for i in range(low, len(messages) - 1) if i % stride == residue]
        # A head that writes the first message (a system prompt) fails the check with it: tried again without it
        for tried in (group, group[1:]):
            found = _probes_together(render_output, messages, arguments, full, ends, tried)
            if found is not None:
                known.update(found)
                break
    return known


def _probes_together(render_output: Callable[..., LoopOutput | None], messages: list[dict[str, Any]],
                     arguments: dict[str, Any], full: LoopOutput, ends: list[int], group: list[int]
                     ) -> dict[int, tuple[int, int]] | None:
    """``strided_probes`` for one render probing every message of ``group``; None where a check fails."""
    if len(group) < 2:  # (one probe alone costs the same render)
        return None
    probed = with_messages(messages, {i: probe_of(messages[i]) for i in group})
    try:
        alt = render_output(probed, **arguments)
    except Exception:
        return None
    starts = full.starts
    assert starts is not None
    if alt is None or alt.starts is None or alt.names != full.names or alt.marks != full.marks \
            or alt.offset != full.offset \
            or len(alt.starts) != len(starts) or alt.blocks[:alt.starts[0]] != full.blocks[:starts[0]]:
        return None
    found = _iterations_apart(full, alt, ends, {i - full.offset for i in group})
    return None if found is None else {at + full.offset: bounds for at, bounds in found.items()}


def _iterations_apart(full: LoopOutput, alt: LoopOutput, ends: list[int], probed: set[int]
                      ) -> dict[int, tuple[int, int]] | None:
    """(common head, common tail) of each probed iteration (by loop index), or None where an unprobed iteration's
    text differs or a probed one starts from other namespaces than the full render's."""
    assert full.starts is not None and alt.starts is not None and full.states is not None
    full_states, alt_states = full.states, alt.states
    count = len(full.starts)
    found: dict[int, tuple[int, int]] = {}
    for at in range(count):
        full_text = "".join(full.blocks[full.starts[at]:full.starts[at + 1] if at + 1 < count else None])
        alt_text = "".join(alt.blocks[alt.starts[at]:alt.starts[at + 1] if at + 1 < count else None])
        if at not in probed:
            if full_text != alt_text:
                return None
            continue
        if alt_states is None or alt_states[at] != full_states[at] or PROBE not in alt_text:
            return None
        start = ends[full.starts[at] - 1] if full.starts[at] > 0 else 0
        head = common_prefix(full_text, alt_text)
        tail = min(common_suffix(full_text, alt_text), len(full_text) - head, len(alt_text) - head)
        found[at] = (start + head, full.chars - start - len(full_text) + tail)
    return found


def _holds_probe(text: Text) -> bool:
    if isinstance(text, BlockText):
        return any(PROBE in block for block in reversed(text.blocks))
    return PROBE in text


@dataclass
class TextTurns:
    """Character boundaries of a render: ``starts[i]`` where message i starts, ``own[i]`` where an assistant
    message's own text starts (after its header; None for other roles) and ``own_ends[i]`` where it ends, ``end``
    where the generation prompt starts; ``spans``: the template's ``{% generation %}`` spans, when it has them."""

    starts: list[int]
    own: list[int | None]
    end: int
    own_ends: list[int]
    spans: list[tuple[int, int]] | None = None

    def attribute(self, offsets: np.ndarray, base: int = 0) -> tuple[list[int], list[int]]:
        """(message index, assistant flag) per token, given each token's character offsets (plus ``base``): an
        ``(n, 2)`` array of (start, end), attributed by where each token starts, all tokens at once (a 200k-token
        prompt's a token at a time cost ~0.1 s)."""
        at = offsets[:, 0] + base
        # the message whose text a token starts in: the last message start at or before it
        indices = np.maximum(np.searchsorted(np.asarray(self.starts, dtype=np.int64), at, side="right") - 1, 0)
        own = np.array([-1 if o is None else o for o in self.own], dtype=np.int64)[indices]  # (-1: not an assistant's)
        own_ends = np.asarray(self.own_ends, dtype=np.int64)
        flags = (own >= 0) & (own <= at) & (at < own_ends[indices])
        past = at >= self.end  # the generation prompt: after every message
        indices[past] = len(self.starts)
        flags[past] = False
        if self.spans is not None:
            return indices.tolist(), assistant_token_mask((offsets + base).tolist(), self.spans)
        return indices.tolist(), flags.astype(np.int64).tolist()


def text_turns(render: Callable[..., Text], messages: list[dict[str, Any]], arguments: dict[str, Any],
               full: Text, spans: list[tuple[int, int]] | None = None, end_markers: Sequence[str] = (),
               first: int = 0, known: Mapping[int, tuple[int, int]] | None = None) -> TextTurns:
    """The boundaries of ``full`` (the render of ``messages`` with ``arguments``), one render per message: message
    i replaced by a probe of its role (``bridge.PROBE`` as its only content) agrees with ``full`` up to where
    message i's own text starts and again from where it ends. Between two messages' own texts, the close up to
    the first end-of-turn marker (``end_markers``: the bundle's EOS tokens, which the model samples) belongs to
    the earlier message (and is in an assistant's mask), the rest (the next header) to the later one.

    ``first``: only messages from that index on are probed (the caller attributes only text after the end of
    message ``first - 1``); the boundaries of the others are left at 0. ``render`` may answer a ``BlockText``
    (and ``full`` be one): the probes are then compared a block at a time, and nothing before the first probed
    message is walked. ``known``: (common head, common tail) with the full render of the probes already found
    (``strided_probes``), by message index."""
    count = len(messages)
    first = min(first, count)
    begins: list[int | None] = [None] * first
    ends: list[int] = [0] * first
    at = 0
    for i in range(first, count):
        if known is not None and i in known:
            head, tail = known[i]
        else:
            try:
                alt: Text | None = render(with_message(messages, i, probe_of(messages[i])), **arguments)
            except Exception:  # a template that refuses the probe here: the previous boundary stands
                alt = None
            if alt is None or not _holds_probe(alt):
                begins.append(None)
                ends.append(at)
                continue
            head, tail = prefix_and_suffix(full, alt)
        begin = max(at, head)
        at = max(begin, len(full) - tail)
        begins.append(begin)
        ends.append(at)
    if arguments.get("add_generation_prompt"):
        try:
            closed = render(messages, **dict(arguments, add_generation_prompt=False))
            end = max(at, prefix_and_suffix(full, closed)[0])
        except Exception:
            end = at
    else:
        end = len(full)
    # where the next message's own text begins, for each message probed (the generation prompt after the last)
    next_begin = [end] * count
    for i in range(count - 2, max(first, 1) - 2, -1):
        following = begins[i + 1]
        next_begin[i] = following if following is not None else next_begin[i + 1]
    # (a message not probed keeps 0: nothing before the first probed one is attributed)
    own_ends = [0] * first + [close_end(full, ends[i], next_begin[i], end_markers) for i in range(first, count)]
    starts = [0, *own_ends[:count - 1]] if count else [0]
    own: list[int | None] = [None] * first
    own += [b if m.get("role") == "assistant" else None for b, m in zip(begins[first:], messages[first:],
                                                                         strict=True)]
    return TextTurns(starts, own, end, own_ends, spans or None)


def close_end(full: Text, start: int, stop: int, end_markers: Sequence[str]) -> int:
    """Where a message's close ends: after the first end-of-turn marker between its text and the next one's."""
    found = [at + len(marker) for marker in end_markers if marker
             for at in [full.find(marker, start, stop)] if at >= 0]
    return min(found) if found else start
