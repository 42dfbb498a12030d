"""The render tier's parsers as ``splitserve_common.output_parsers.OutputParsers``: what an engine runs for
``output_mode: "derender"`` when this package is installed beside it.

A thin adapter: a ``parse_context`` becomes the message-less chat request that ``/v1/chat/completions/derender``
reads (vLLM's ``ParseContext.to_chat_request``), and each choice gets the same pipeline that endpoint builds
(``pipeline_config``, ``Pipeline``; batch is ``derender_all``), kept in memory for the whole stream: no
stream_state round trip. The engine finds ``output_parsers`` through the ``splitserve.output_parsers`` entry
point (pyproject.toml) and never imports this module by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from render_service.derender.batch import pipeline_config
from render_service.derender.choice_shapes import chat_message, delta_message
from render_service.http.errors import ApiError
from render_service.parsers.pipeline import ChoiceDelta, Pipeline, derender_all, merge_deltas
from render_service.render.render_config import RenderConfig, load_render_config
from render_service.wire.protocol import ChatCompletionRequest
from splitserve_common.output_parsers import ChoiceStep, ParseContext, ParseContextError, ParserFlags, StopSpec


def output_parsers(model_dir: str, flags: ParserFlags) -> RenderOutputParsers:
    """The entry point: the model directory's tokenizer and templates, with the engine's parser flags."""
    config = load_render_config(model_dir, reasoning_parser=flags.reasoning_parser,
                                tool_call_parser=flags.tool_call_parser,
                                enable_auto_tool_choice=flags.enable_auto_tool_choice)
    return RenderOutputParsers(config)


def _without_none(value: Any) -> Any:
    """vLLM's DeltaMessage as the generate stream dumps it (exclude_none, at every depth)."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value


class RenderChoiceParser:
    """One choice's pipeline and state for a whole stream."""

    def __init__(self, config: RenderConfig, chat_request: ChatCompletionRequest | None,
                 prompt_token_ids: Sequence[int], request_id: str, index: int, stop: StopSpec | None = None):
        self.config = config
        self.pcfg = pipeline_config(config, chat_request, request_id=request_id, choice_index=index)
        if stop is not None and stop.stop:  # the pipeline cuts the text before parsing, as vLLM's derender
            self.pcfg = msgspec.structs.replace(self.pcfg, stops=stop.stop,
                                                include_stop_str_in_output=stop.include_stop_str_in_output,
                                                min_tokens=max(0, stop.min_tokens))
        self.pipeline = Pipeline(config.tokenizer, self.pcfg)
        self.state = self.pipeline.initial_state(list(prompt_token_ids))
        self.hides_metadata = not self.pcfg.include_reasoning

    def step(self, token_ids: Sequence[int], finish_reason: str | None) -> ChoiceStep:
        delta = self.pipeline.feed(self.state, list(token_ids)) if token_ids else ChoiceDelta()
        if finish_reason is not None:
            delta = merge_deltas(delta, self.pipeline.finish(self.state))
        finish = self.pipeline.finish_reason(self.state, finish_reason) if finish_reason is not None else None
        if delta.is_empty():
            return ChoiceStep(None, finish)
        return ChoiceStep(_without_none(msgspec.to_builtins(delta_message(delta, self.config.reasoning_field))), finish)


class RenderOutputParsers:
    def __init__(self, config: RenderConfig):
        self.config = config

    def chat_request(self, context: ParseContext | None) -> ChatCompletionRequest | None:
        """vLLM's ParseContext.to_chat_request: the message-less request the parsers read (None: plain text)."""
        if context is None or not self.config.has_parsers:
            return None
        choice = context.tool_choice
        if isinstance(choice, dict):
            function = choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            if not any(isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("name") == name
                       for t in context.tools or ()):
                raise ParseContextError("The tool specified in `tool_choice` does not match any of the specified "
                                        "`tools`")
        return ChatCompletionRequest(messages=[], tools=context.tools, tool_choice=choice,
                                     parallel_tool_calls=context.parallel_tool_calls,
                                     include_reasoning=context.include_reasoning,
                                     chat_template_kwargs=context.chat_template_kwargs,
                                     return_tokens_as_token_ids=context.return_tokens_as_token_ids)

    def stream(self, context: ParseContext | None, prompt_token_ids: Sequence[int], request_id: str,
               index: int, stop: StopSpec | None = None) -> RenderChoiceParser:
        try:
            return RenderChoiceParser(self.config, self.chat_request(context), prompt_token_ids, request_id, index,
                                      stop)
        except ApiError as exc:  # a tool_choice or chat_template_kwargs the pipeline seam refuses
            raise ParseContextError(exc.message) from None

    def message(self, context: ParseContext | None, prompt_token_ids: Sequence[int], request_id: str, index: int,
                token_ids: Sequence[int], finish_reason: str | None, stop: StopSpec | None = None
                ) -> tuple[dict[str, Any], str | None, bool]:
        # vLLM's batch rule: stop strings cut only an output the engine finished with "stop"
        parser = self.stream(context, prompt_token_ids, request_id, index, stop if finish_reason == "stop" else None)
        fields, state = derender_all(parser.pipeline, list(token_ids), list(prompt_token_ids),
                                     engine_finish=finish_reason)
        message = chat_message(fields, parser.pcfg, self.config.reasoning_field)
        finish = parser.pipeline.finish_reason(state, finish_reason)
        return msgspec.to_builtins(message), finish, parser.hides_metadata
