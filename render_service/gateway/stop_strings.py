"""Stop strings, matched by the gateway on a choice's content text as it streams.

A tokens-only engine cannot see text, so the gateway matches: every content delta goes through
``StopMatcher.feed``, which releases the text that can no longer be the start of a stop string and
holds back the rest. The matching itself is derender's stop-string stage
(``render_service.parsers.stop_strings``: vLLM's rule, the stop string that completes first wins, ties to
the earlier in the list); this adapter gives it the gateway's (released text, match) shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from render_service.parsers.stop_strings import StopState, StopStrings


@dataclass
class StopMatch:
    text: str  # what to release before finishing
    stop: str  # the stop string that matched (vLLM's stop_reason)


class StopMatcher:
    def __init__(self, stops: list[str], include_stop_str_in_output: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.stage = StopStrings(tuple(self.stops), include_stop_str_in_output)
        self.state = StopState()

    def feed(self, text: str) -> tuple[str, StopMatch | None]:
        """(text to release now, the match if a stop string completed)."""
        released = self.stage.feed(self.state, text)
        if self.state.matched is not None:
            return "", StopMatch(released, self.state.matched)
        return released, None

    def flush(self) -> str:
        """End of output: the held tail was not a stop string after all."""
        return self.stage.finish(self.state)


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else [s for s in stop if s]
