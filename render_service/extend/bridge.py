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

Where the template's message loop runs under a loop session (loop_resume.py), the full render alone finds the
bridge (``loop_bridge``): the render resumes from the previous turn's record, and its output says at which block
each message's iteration starts. The bridge is the close of the sampled turn and every block from the next
message's iteration on. The close is what the template writes after a probe's content in a three-message render
(the sampled turn's neighbours, the probe between them), and the sampled turn's own iteration must end with it.
The full text is never joined unless the answer's check or masks need it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from render_service.extend.protocol import DifferingSpan
from render_service.templates.chat_template import ChatTemplate, PlainMessages, template_form
from render_service.templates.loop_resume import LoopOutput

# A plain assistant message's content, unlikely in real text and with no whitespace a template would trim.
PROBE = "\u27e6splitserve-extend-probe\u27e7"


class ExtendImpossible(Exception):
    """The template makes extending this conversation impossible; the message says why."""


@dataclass
class Bridge:
    """What follows the sampled ids: ``text`` (template families) or ``ids`` (Harmony), of which the first
    ``closing_chars`` characters (``closing_ids`` ids) close the sampled turn. The full render's text (template
    families, for the check) is ``full``, or the blocks of ``output``; ``window`` is its end from
    ``window_floor`` characters before the sampled turn's iteration on (the whole text for the probe)."""

    text: str | None = None
    closing_chars: int = 0
    ids: list[int] | None = None
    closing_ids: int = 0
    full: str | None = None
    method: str = "probe"
    output: LoopOutput | None = None
    full_chars: int = 0
    window: str = ""
    window_floor: int = 0

    def __post_init__(self) -> None:
        if self.full is not None and not self.window:
            self.full_chars, self.window = len(self.full), self.full

    def full_text(self) -> str:
        if self.full is None:
            assert self.output is not None
            self.full = self.output.text()
        return self.full


_CHUNK = 4096
_LINEAR = 16  # below this many elements a differing span is walked one by one


def common_prefix(a: Sequence[Any], b: Sequence[Any], linear: int = _LINEAR) -> int:
    """The length of the longest common head of two strings or lists: compared a chunk at a time (C speed); the
    chunk that differs is halved until ``linear`` elements are left, which are walked one by one. O(length), and
    a Python loop over at most ``linear`` elements (a list of blocks that differ only near its end would
    otherwise be walked element by element in Python from the chunk's start)."""
    n = min(len(a), len(b))
    at = 0
    while at < n:
        stop = min(n, at + _CHUNK)
        if a[at:stop] != b[at:stop]:
            while stop - at > linear:  # a[at:stop] and b[at:stop] differ
                middle = (at + stop) // 2
                if a[at:middle] == b[at:middle]:
                    at = middle
                else:
                    stop = middle
            while a[at] == b[at]:
                at += 1
            return at
        at = stop
    return n


def common_suffix(a: Sequence[Any], b: Sequence[Any], linear: int = _LINEAR) -> int:
    """The length of the longest common tail of two strings or lists (as ``common_prefix``, from the end)."""
    la, lb = len(a), len(b)
    n = min(la, lb)
    done = 0
    while done < n:
        size = min(n - done, _CHUNK)
        if a[la - done - size:la - done] != b[lb - done - size:lb - done]:
            end = done + size  # the tails of lengths done and end: the first equal, the second not
            while end - done > linear:
                middle = (done + end) // 2
                if a[la - middle:la - done] == b[lb - middle:lb - done]:
                    done = middle
                else:
                    end = middle
            while a[la - done - 1] == b[lb - done - 1]:
                done += 1
            return done
        done += size
    return n


def probe_message(content_format: str) -> dict[str, Any]:
    content: Any = PROBE if content_format == "string" else [{"type": "text", "text": PROBE}]
    return {"role": "assistant", "content": content}


def with_message(messages: list[dict[str, Any]], i: int, message: dict[str, Any]) -> list[dict[str, Any]]:
    """``messages`` with message ``i`` replaced (a probe): ``with_messages`` for one."""
    return with_messages(messages, {i: message})


def with_messages(messages: list[dict[str, Any]], replaced: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the messages at ``replaced``'s indices replaced (probes), in their list type; the
    template forms they carry are carried along, so the render makes only the new messages'."""
    items = like_messages(messages, list(messages))
    for i, message in replaced.items():
        items[i] = message
    forms = getattr(messages, "template_forms", None)
    if forms is not None and len(forms) == len(messages) and type(items) is PlainMessages:
        new_forms = list(forms)
        for i, message in replaced.items():
            new_forms[i] = template_form(message)
        items.template_forms = new_forms
    return items


def like_messages(messages: list[dict[str, Any]], items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``items`` in the list type of ``messages``: a list the render knows holds plain copies stays marked as one
    (the probe is a plain dict too), so the render does not copy every message again."""
    return PlainMessages(items) if type(messages) is PlainMessages else items


def template_bridge(render: Callable[..., str], messages: list[dict[str, Any]], arguments: dict[str, Any],
                    k: int, content_format: str, end_markers: Sequence[str] = ()) -> Bridge:
    """The bridge after message ``k`` (``render(messages, **arguments)`` is the template's text render): by the
    probe where the template takes one, else by the prefix (``prefix_bridge``)."""
    full = render(messages, **arguments)
    probed = with_message(messages, k, probe_message(content_format))
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
    closing = closing_chars(render, messages, arguments, k, content_format, text)
    return Bridge(text=text, closing_chars=closing, full=full, method="probe")


def closing_chars(render: Callable[..., str], messages: list[dict[str, Any]], arguments: dict[str, Any], k: int,
                  content_format: str, text: str) -> int:
    """How much of the bridge ``text`` closes the sampled turn: what the template writes after the probe when the
    assistant turn ends a conversation, as far as it agrees with the bridge (nothing for templates whose next
    message is the turn's end, as GLM's). Measured on the sampled turn's predecessor and the probe alone: it only
    counts ids and attributes them, cheaply."""
    if k + 1 >= len(messages):
        return len(text)
    last = dict(arguments, add_generation_prompt=False)
    try:
        alone = render(like_messages(messages, [*messages[max(0, k - 1):k], probe_message(content_format)]), **last)
    except Exception:
        return 0
    if PROBE not in alone:  # (the probe may sit elsewhere when it is the last message)
        return 0
    return common_prefix(alone[alone.rfind(PROBE) + len(PROBE):], text)


def loop_bridge(template: ChatTemplate, messages: list[dict[str, Any]], arguments: dict[str, Any], k: int,
                content_format: str, context_chars: int) -> Bridge | None:
    """The bridge from the full render's own iterations (the module's docstring), or None where the render ran no
    loop session, the sampled turn is not followed by a message in the loop, or its iteration does not end with
    the close a probe gets. That close is the bridge's closing part: what the sampled turn's own iteration writes
    after its content. ``context_chars``: how much of the text before the sampled turn's iteration the window
    keeps (what the tokenizer's cut reads)."""
    output = template.render_output(messages, **arguments)
    if output is None or output.starts is None:
        return None
    starts, blocks = output.starts, output.blocks
    turn = k - output.offset
    if turn < 0 or turn + 1 >= len(starts):
        return None
    close = _close_between(template, messages, arguments, k, content_format)
    if close is None:
        return None
    own = "".join(blocks[starts[turn]:starts[turn + 1]])
    if not own.endswith(close):
        return None
    text = close + output.text_from(starts[turn + 1])
    first, floor = starts[turn], 0
    while first > 0 and floor < context_chars:
        first -= 1
        floor += len(blocks[first])
    window = output.text_from(first)
    return Bridge(text=text, closing_chars=len(close), method="loop", output=output, full_chars=output.chars,
                  window=window, window_floor=floor)


def _close_between(template: ChatTemplate, messages: list[dict[str, Any]], arguments: dict[str, Any], k: int,
                   content_format: str) -> str | None:
    """What the template writes after a probe assistant turn's content, between the sampled turn's neighbours:
    the end of the probe's iteration after the probe (None where the template refuses these three messages or
    the probe's iteration is not found)."""
    around = [*messages[max(0, k - 1):k], probe_message(content_format), messages[k + 1]]
    try:
        output = template.render_output(like_messages(messages, around), resume=False,
                                        **dict(arguments, add_generation_prompt=False))
    except Exception:
        return None
    if output is None or output.starts is None:
        return None
    at = min(k, 1) - output.offset
    if at < 0 or at + 1 >= len(output.starts):
        return None
    own = "".join(output.blocks[output.starts[at]:output.starts[at + 1]])
    probe = own.rfind(PROBE)
    return own[probe + len(PROBE):] if probe >= 0 else None


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
