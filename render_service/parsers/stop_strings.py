"""Stop strings as a pipeline stage, between the detokenizer and the reasoning parser.

A tokens-only engine cannot see text, so derender applies the request's ``stop`` strings the way vLLM 0.34's
derender does (``check_stop_strings`` on the decoded text, before any parser): the text is cut before the
stop string (after it with ``include_stop_str_in_output``), and only a match that ends past the text of the
first ``min_tokens`` tokens counts. When several complete in the same text, the one that ends first wins,
ties to the earlier string in the list, as if tokens came one at a time.

Streaming holds back the tail that could still grow into a stop string (at most the longest stop string less
one character) and carries it in the stream state: work per feed is O(feed + held tail), never O(history).
Once a stop string matched, every later text is dropped.
"""

from __future__ import annotations

import msgspec

# Derender refuses stop lists past these bounds (a 400): every feed scans the held tail against each string.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096


class StopState(msgspec.Struct, omit_defaults=True):
    """Plain data, carried in stream_state."""

    held: str = ""  # released text's tail that may be the start of a stop string
    protected: int = 0  # leading chars of ``held`` from the first min_tokens tokens: a match must end past them
    matched: str | None = None  # the stop string that ended the text (vLLM's stop_reason)


class StopStrings:
    def __init__(self, stops: tuple[str, ...], include_in_output: bool) -> None:
        self.stops = stops
        self.include = include_in_output
        self.hold = max((len(s) for s in stops), default=1) - 1

    def feed(self, state: StopState, text: str, protected: bool = False) -> str:
        """The text to release now. ``protected``: this text is from the first min_tokens tokens."""
        if state.matched is not None or not text:
            return ""
        window = state.held + text
        protected_end = state.protected + (len(text) if protected else 0)
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            at = window.find(stop, max(0, protected_end - len(stop) + 1))
            if at >= 0 and (best is None or at + len(stop) < best[0]):
                best = (at + len(stop), at, stop)
        if best is not None:
            end, at, stop = best
            state.held, state.protected, state.matched = "", 0, stop
            return window[:end] if self.include else window[:at]
        keep = 0
        for k in range(min(self.hold, len(window)), 0, -1):
            tail = window[-k:]
            if any(stop.startswith(tail) for stop in self.stops):
                keep = k
                break
        cut = len(window) - keep
        state.held = window[cut:]
        state.protected = max(0, protected_end - cut)
        return window[:cut]

    def finish(self, state: StopState) -> str:
        """End of output: a held tail that never became a stop string is text after all."""
        out, state.held, state.protected = state.held, "", 0
        return out

    def check(self, state: StopState) -> bool:
        """Whether a restored state is one this stage could have written."""
        return (len(state.held) <= self.hold and 0 <= state.protected <= len(state.held)
                and (state.matched is None or (state.matched in self.stops and not state.held)))


def stop_list(stop: str | list[str] | None) -> tuple[str, ...]:
    """The request's ``stop`` as vLLM's SamplingParams normalizes it (empty strings dropped)."""
    if not stop:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(s for s in stop if s)
