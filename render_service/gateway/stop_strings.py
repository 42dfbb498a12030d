"""Stop strings, matched on a choice's content text as it streams.

A tokens-only engine cannot see text, so the gateway matches: every content delta goes through
``StopMatcher.feed``, which releases the text that can no longer be the start of a stop string and
holds back the rest (the longest tail that is a prefix of a stop string, so at most the longest stop
string less one character). A match cuts the text
before the stop string (or after it, with ``include_stop_str_in_output``) and reports which string
matched. Work per delta is O(delta + stop strings' length): the held tail is all that is rescanned.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopMatch:
    text: str  # what to release before finishing
    stop: str  # the stop string that matched (vLLM's stop_reason)


class StopMatcher:
    def __init__(self, stops: list[str], include_stop_str_in_output: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include = include_stop_str_in_output
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.held = ""

    def feed(self, text: str) -> tuple[str, StopMatch | None]:
        """(text to release now, the match if a stop string completed)."""
        if not text:
            return "", None
        window = self.held + text
        # The stop string that completes first wins (as if tokens came one at a time), so the answer
        # does not depend on how the text was chunked.
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            at = window.find(stop)
            if at >= 0 and (best is None or (at + len(stop), at) < best[:2]):
                best = (at + len(stop), at, stop)
        if best is not None:
            _, at, stop = best
            self.held = ""
            return "", StopMatch(window[: at + len(stop)] if self.include else window[:at], stop)
        # Hold back only a tail that could still grow into a stop string.
        keep = 0
        for k in range(min(self.hold, len(window)), 0, -1):
            tail = window[-k:]
            if any(stop.startswith(tail) for stop in self.stops):
                keep = k
                break
        cut = len(window) - keep
        self.held = window[cut:]
        return window[:cut], None

    def flush(self) -> str:
        """End of output: the held tail was not a stop string after all."""
        out, self.held = self.held, ""
        return out


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else [s for s in stop if s]
