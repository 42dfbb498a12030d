"""The seam between a sampled turn and what comes after it: found from the template's own output, and proved.

Given the conversation as the client now sends it (message ``k`` is the assistant turn the engine sampled, the
messages after it are new), the bridge is the text the template writes after that assistant message's content:
its close (``<|im_end|>\\n``) and every new message, then the generation prompt. It is found by rendering the
conversation twice, once as sent and once with message ``k`` replaced by a plain assistant message holding a
probe text; the bridge is what follows the probe, and it must be the common tail of both renders. That is the
proof that the new messages render the same whatever the sampled turn held (a template that renders them
differently depending on that turn makes the tails differ, and the extend is refused with that reason). The
sampled ids are never re-rendered, so Python-style booleans, odd JSON spacing, reasoning a template strips and
truncated outputs stay as sampled.

Where the completion ends with a marker the bridge starts with (``<|im_end|>``; GLM's ``<|observation|>``, which
opens the next message), the marker is the model's and is not written twice. Harmony (gpt-oss) has no template:
its renderer renders each message on its own, so the bridge is the new messages' own ids (``harmony_bridge``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from render_service.extend.protocol import DifferingSpan
from render_service.templates.chat_template import PlainMessages

# A plain assistant message's content, unlikely in real text and with no whitespace a template would trim.
PROBE = "\u27e6splitserve-extend-probe\u27e7"


class ExtendImpossible(Exception):
    """The template makes extending this conversation impossible; the message says why."""


@dataclass
class Bridge:
    """What follows the sampled ids: ``text`` (template families) or ``ids`` (Harmony), of which the first
    ``closing_chars`` characters (``closing_ids`` ids) close the sampled turn; ``full`` is the full render's text
    (template families), for the check."""

    text: str | None = None
    closing_chars: int = 0
    ids: list[int] | None = None
    closing_ids: int = 0
    full: str | None = None
    method: str = "probe"


_CHUNK = 4096


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """The length of the longest common head of two strings or lists: compared a chunk at a time (C speed),
    then element by element inside the first chunk that differs; O(length)."""
    n = min(len(a), len(b))
    at = 0
    while at < n:
        stop = min(n, at + _CHUNK)
        if a[at:stop] != b[at:stop]:
            while a[at] == b[at]:
                at += 1
            return at
        at = stop
    return n


def common_suffix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """The length of the longest common tail of two strings or lists (as ``common_prefix``, from the end)."""
    la, lb = len(a), len(b)
    n = min(la, lb)
    done = 0
    while done < n:
        size = min(n - done, _CHUNK)
        if a[la - done - size:la - done] != b[lb - done - size:lb - done]:
            while a[la - done - 1] == b[lb - done - 1]:
                done += 1
            return done
        done += size
    return n


def probe_message(content_format: str) -> dict[str, Any]:
    content: Any = PROBE if content_format == "string" else [{"type": "text", "text": PROBE}]
    return {"role": "assistant", "content": content}


def like_messages(messages: list[dict[str, Any]], items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``items`` in the list type of ``messages``: a list the render knows holds plain copies stays marked as one
    (the probe is a plain dict too), so the render does not copy every message again."""
    return PlainMessages(items) if type(messages) is PlainMessages else items


def template_bridge(render: Callable[..., str], messages: list[dict[str, Any]], arguments: dict[str, Any],
                    k: int, content_format: str, end_markers: Sequence[str] = ()) -> Bridge:
    """The bridge after message ``k`` (``render(messages, **arguments)`` is the template's text render): by the
    probe where the template takes one, else by the prefix (``prefix_bridge``)."""
    full = render(messages, **arguments)
    probed = like_messages(messages, [*messages[:k], probe_message(content_format), *messages[k + 1:]])
    try:
        alt: str | None = render(probed, **arguments)
    except Exception:  # the template refuses a plain assistant message here (MiniMax wants the tool call)
        alt = None
    at = alt.rfind(PROBE) if alt is not None else -1
    after = len(alt) - at - len(PROBE) if alt is not None and at >= 0 else -1
    # The proof: the whole text after the probe is the full render's tail (compared over that tail alone).
    if alt is None or at < 0 or not full.endswith(alt[len(alt) - after:]):
        return prefix_bridge(render, messages, arguments, k, full, end_markers)
    text = full[len(full) - after:]
    # The close: what the template writes after the probe when the assistant turn ends a conversation, as far as
    # it agrees with the bridge (nothing for templates whose next message is the turn's end, as GLM's). Measured
    # on the sampled turn's predecessor and the probe alone: it only counts ids and attributes them, cheaply.
    closing = len(text)
    if k + 1 < len(messages):
        last = dict(arguments, add_generation_prompt=False)
        try:
            alone = render(like_messages(messages, [*messages[max(0, k - 1):k], probe_message(content_format)]), **last)
        except Exception:
            alone = None
        closing = 0
        if alone is not None and PROBE in alone:  # (the probe may sit elsewhere when it is the last message)
            closing = common_prefix(alone[alone.rfind(PROBE) + len(PROBE):], text)
    return Bridge(text=text, closing_chars=closing, full=full, method="probe")


def prefix_bridge(render: Callable[..., str], messages: list[dict[str, Any]], arguments: dict[str, Any], k: int,
                  full: str, end_markers: Sequence[str]) -> Bridge:
    """The bridge of a template that takes no probe: the conversation up to the sampled turn (closed) must be the
    head of the whole render (append-only here), and the close is what the template writes after the turn's last
    end marker (``end_markers``: the bundle's end-of-turn tokens)."""
    try:
        closed = render(like_messages(messages, messages[:k + 1]), **dict(arguments, add_generation_prompt=False))
        head = render(like_messages(messages, messages[:k]), **dict(arguments, add_generation_prompt=True)) if k else ""
    except Exception as exc:
        raise ExtendImpossible(f"the template renders no conversation ending with the sampled turn ({exc})") from None
    if not full.startswith(closed):
        raise ExtendImpossible("the template renders the turns before the new messages differently once they "
                               "follow (it is not append-only for this conversation), and it takes no probe turn")
    turn = closed[common_prefix(head, closed):]  # the sampled turn as the template writes it
    ends = [(turn.rfind(marker), marker) for marker in end_markers if marker and marker in turn]
    if not ends:
        raise ExtendImpossible("the template closes the assistant turn with no end-of-turn marker it takes a probe "
                               "for")
    at, _ = max(ends)
    close = turn[at:]
    return Bridge(text=close + full[len(closed):], closing_chars=len(close), full=full, method="prefix")


def drop_sampled_marker(bridge_text: str, closing_chars: int, last_id: int | None,
                        added_tokens: dict[int, str]) -> tuple[str, int]:
    """The bridge without the marker the completion already ends with: the completion's last id is an added
    token and the bridge starts with it (after whitespace the model did not write, like GLM's newline)."""
    if last_id is None:
        return bridge_text, closing_chars
    marker = added_tokens.get(last_id)
    if not marker:
        return bridge_text, closing_chars
    stripped = bridge_text.lstrip()
    if not stripped.startswith(marker):
        return bridge_text, closing_chars
    cut = len(bridge_text) - len(stripped) + len(marker)
    return bridge_text[cut:], max(0, closing_chars - cut)


def differing_span(full: Sequence[int], extended: Sequence[int], decode: Callable[[list[int]], str]
                   ) -> DifferingSpan | None:
    """Where two id lists part (None when equal): the first differing position and the ends of the differing
    runs, with their text."""
    if len(full) == len(extended) and (full == extended if type(full) is type(extended) else
                                       list(full) == list(extended)):
        return None
    start = common_prefix(full, extended)
    tail = min(common_suffix(full, extended), len(full) - start, len(extended) - start)
    full_end, extended_end = len(full) - tail, len(extended) - tail
    return DifferingSpan(start=start, full_end=full_end, extended_end=extended_end,
                         full_text=decode(list(full[start:full_end])),
                         extended_text=decode(list(extended[start:extended_end])))
