"""Output parsers: the seam between the engine's ``output_mode: "derender"`` and a parser implementation.

The engine parses its own output when a client asks for derender (vLLM 0.33+), but the reasoning and tool
parsers live in the render tier, and neither tier imports the other. So the engine knows only this typed
protocol, and finds an implementation at run time through the ``splitserve.output_parsers`` entry point
group (the render tier declares its adapter there, in pyproject.toml). An engine installed without the
render tier has none: it still answers derender with content-only messages when it has no parser flags,
as vLLM does, and refuses it with a 400 when parser flags ask for what it cannot do.

The shapes are vLLM's: a step gives a DeltaMessage as a dict (no ``role``: the caller adds it to a choice's
first event), a whole choice a ChatMessage as a dict, and each the finish reason the parser reports
(``tool_calls`` once a call was parsed).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any, Protocol

import msgspec

ENTRY_POINT_GROUP = "splitserve.output_parsers"
log = logging.getLogger("splitserve.output_parsers")


class ParserFlags(msgspec.Struct, frozen=True):
    """The engine's vLLM parser flags (--reasoning-parser, --tool-call-parser, --enable-auto-tool-choice)."""

    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False

    @property
    def has_parsers(self) -> bool:
        return self.reasoning_parser is not None or self.tool_call_parser is not None


class ParseContext(msgspec.Struct):
    """vLLM's ParseContext: the chat request context render emits for a generate server to parse with."""

    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = "none"
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True
    return_tokens_as_token_ids: bool | None = None
    chat_template_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    history_tool_call_cnt: int = 0


PARSE_CONTEXT_FIELDS = frozenset(ParseContext.__struct_fields__)


class ParseContextError(ValueError):
    """A parse_context the parsers cannot use (a 400 naming parse_context)."""


def parse_context_from(raw: dict[str, Any]) -> ParseContext:
    """The known fields of a request's parse_context, typed (unknown ones are the caller's to refuse)."""
    try:
        context = msgspec.convert({k: v for k, v in raw.items() if k in PARSE_CONTEXT_FIELDS}, ParseContext)
    except msgspec.ValidationError as exc:
        raise ParseContextError(f"Invalid parse_context: {exc}") from None
    if context.history_tool_call_cnt < 0:
        raise ParseContextError("parse_context.history_tool_call_cnt must be at least 0")
    return context


class StopSpec(msgspec.Struct, frozen=True):
    """A request's stop strings, for the parsers to cut the text at as vLLM's derender does (the engine stops the
    sequence at the same place by the same rule: the stop string completed first, past ``min_tokens``)."""

    stop: tuple[str, ...]
    include_stop_str_in_output: bool = False
    min_tokens: int = 0


class ChoiceStep(msgspec.Struct):
    delta: dict[str, Any] | None  # DeltaMessage fields that are set; None: nothing new to say
    finish_reason: str | None  # the parser's finish reason, once the choice ended


class ChoiceParser(Protocol):
    """One choice's parser for a whole stream: fed each step's new token ids, in order."""

    hides_metadata: bool  # reasoning hidden (include_reasoning false): logprobs and token ids must not leak it

    def step(self, token_ids: Sequence[int], finish_reason: str | None) -> ChoiceStep: ...


class OutputParsers(Protocol):
    """Built once per engine (model directory + parser flags); raises ParseContextError for a bad context."""

    def stream(self, context: ParseContext | None, prompt_token_ids: Sequence[int], request_id: str,
               index: int, stop: StopSpec | None = None) -> ChoiceParser: ...

    def message(self, context: ParseContext | None, prompt_token_ids: Sequence[int], request_id: str, index: int,
                token_ids: Sequence[int], finish_reason: str | None, stop: StopSpec | None = None
                ) -> tuple[dict[str, Any], str | None, bool]:
        """A whole choice: (ChatMessage, finish reason, hides_metadata); ``stop`` applies when the engine finished
        with ``stop`` (vLLM's batch rule)."""
        ...


# What an entry point names: called with the tokenizer's model directory and the flags.
OutputParsersFactory = Callable[[str, ParserFlags], OutputParsers]


def find_output_parsers() -> OutputParsersFactory | None:
    """The installed implementation (the first entry point of the group, by name), or None."""
    found = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)
    if not found:
        return None
    if len(found) > 1:
        log.info("output parsers: %d implementations installed, using %r", len(found), found[0].name)
    factory: OutputParsersFactory = found[0].load()
    return factory
