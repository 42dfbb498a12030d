"""output_mode "derender": each choice's output as a parsed assistant message (batch) or message deltas
(stream), as vLLM 0.34's generate server gives them.

Text, stop strings and logprobs are text mode's (text_output.TextChoices). With parser flags, an
OutputParsers implementation (splitserve_common.output_parsers, found through its entry point) parses:
one parser per choice for the whole stream, kept here in memory. Without parser flags the message is the
plain text, as vLLM's server without a parser answers.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from splitserve_common.output_parsers import (
    ChoiceParser,
    ParseContext,
    ParseContextError,
    ParserFlags,
    StopSpec,
    find_output_parsers,
)
from splitserve_common.output_parsers import OutputParsers as OutputParsersImpl
from token_engine.http.request_error import RequestError

NO_IMPLEMENTATION = ("output_mode='derender' on an engine with parser flags ({flags}) needs an output parser "
                     "implementation, and none is installed (entry point group splitserve.output_parsers: "
                     "install the render tier's package beside the engine), or use output_mode 'text'.")


def plain_message(text: str) -> dict[str, Any]:
    """vLLM's ChatMessage for a server without a parser: the text as content (annotations and an empty
    tool_calls left out, as its serializer does)."""
    return {"role": "assistant", "content": text, "refusal": None, "audio": None, "function_call": None,
            "reasoning": None}


class OutputParsers:
    """The engine's parsers: its flags, and the implementation built on first use (a tokens-only engine, or one
    that never derenders, pays nothing)."""

    def __init__(self, tokenizer_dir: str, flags: ParserFlags):
        self.tokenizer_dir = tokenizer_dir
        self.flags = flags
        self._lock = threading.Lock()
        self._impl: OutputParsersImpl | None = None
        self._broken: str | None = None

    def describe_flags(self) -> str:
        parts = [f"--reasoning-parser {self.flags.reasoning_parser}" if self.flags.reasoning_parser else "",
                 f"--tool-call-parser {self.flags.tool_call_parser}" if self.flags.tool_call_parser else ""]
        return " ".join(p for p in parts if p)

    def get(self) -> OutputParsersImpl:
        """The implementation (blocking: call off the event loop), or RequestError."""
        with self._lock:
            if self._impl is None and self._broken is None:
                factory = find_output_parsers()
                if factory is None:
                    self._broken = NO_IMPLEMENTATION.format(flags=self.describe_flags())
                else:
                    try:
                        self._impl = factory(self.tokenizer_dir, self.flags)
                    except Exception as exc:  # noqa: BLE001 - a parser that cannot load is a clear answer, not a 500
                        self._broken = (f"output_mode='derender': the output parsers could not be loaded for "
                                        f"{self.describe_flags()} ({type(exc).__name__}: {exc})")
            if self._broken is not None:
                raise RequestError(self._broken, "output_mode")
            assert self._impl is not None
            return self._impl


def check_parse_context(raw: dict[str, Any] | None, mode: str) -> ParseContext | None:
    """vLLM's _check_parse_context_fields: unknown fields fail only where they are read (derender)."""
    if raw is None or mode != "derender":
        return None
    unknown = sorted(set(raw) - set(ParseContext.__struct_fields__))
    if unknown:
        raise RequestError(f"Unknown parse_context fields {unknown}; the render server is newer than this "
                           f"generate server", "parse_context")
    from splitserve_common.output_parsers import parse_context_from

    try:
        return parse_context_from(raw)
    except ParseContextError as exc:
        raise RequestError(str(exc), "parse_context") from None


class DerenderChoices:
    """Per choice: a parser for the whole stream (stream) or the message at the end (batch)."""

    def __init__(self, parsers: OutputParsersImpl | None, context: ParseContext | None,
                 prompt_token_ids: Sequence[int], request_id: str, n: int, stream: bool,
                 stop: StopSpec | None = None):
        """``stop``: the request's stop strings; the parsers cut the text at them as the text stage stops the
        sequence there (one rule, vLLM's)."""
        self.parsers = parsers
        self.context = context
        self.stop = stop
        self.prompt_token_ids = prompt_token_ids
        self.request_id = request_id
        self.role_sent = [False] * n
        self.choice_parsers: list[ChoiceParser] | None = None
        self.stream = stream
        if parsers is not None:
            try:  # built before generating, so a bad parse_context fails fast (vLLM); batch reads the messages whole
                self.choice_parsers = [parsers.stream(context, prompt_token_ids, request_id, i, stop)
                                       for i in range(n if stream else 1)]
            except ParseContextError as exc:
                raise RequestError(str(exc), "parse_context") from None
        # a parser that hides reasoning (include_reasoning false) hides logprobs and token ids with it, as vLLM
        self.hides_metadata = bool(self.choice_parsers and self.choice_parsers[0].hides_metadata)

    def step(self, index: int, token_ids: list[int], text: str, finish_reason: str | None
             ) -> tuple[dict[str, Any], str | None]:
        """(this event's DeltaMessage, finish reason): role on a choice's first event."""
        if self.choice_parsers is None:
            delta: dict[str, Any] = {"content": text}
        else:
            step = self.choice_parsers[index].step(token_ids, finish_reason)
            delta, finish_reason = dict(step.delta or {}), step.finish_reason
        if not self.role_sent[index]:
            delta = {"role": "assistant", **delta}
            self.role_sent[index] = True
        return delta, finish_reason

    def message(self, index: int, token_ids: list[int], text: str, finish_reason: str | None
                ) -> tuple[dict[str, Any], str | None]:
        """A whole choice's ChatMessage and finish reason (vLLM's derender_text_choices)."""
        if self.parsers is None:
            return plain_message(text), finish_reason or "stop"
        try:
            message, reason, _ = self.parsers.message(self.context, self.prompt_token_ids, self.request_id, index,
                                                      token_ids, finish_reason, self.stop)
        except ParseContextError as exc:
            raise RequestError(str(exc), "parse_context") from None
        return message, reason
