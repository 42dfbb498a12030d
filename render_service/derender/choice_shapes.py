"""Where a choice's pipeline output becomes the OpenAI wire shape: the one home for each conversion that
batch derender, streaming derender and the gateway share.

* ``completion_pipeline_config``: a completions request as a pipeline configuration (chat's is
  ``derender.pipeline_config``);
* ``delta_message``: one pipeline delta as a stream ``DeltaMessage``;
* ``chat_message``: a choice's accumulated fields as the final ``ChatMessage``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Final

from msgspec import UNSET

from render_service.parsers.pipeline import ChoiceDelta, PipelineConfig
from render_service.render.render_config import RenderConfig, reasoning_keys
from render_service.wire.protocol import (
    ChatMessage,
    CompletionRequest,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)


def completion_pipeline_config(config: RenderConfig, creq: CompletionRequest | None, *, request_id: str,
                               choice_index: int) -> PipelineConfig:
    """Completions detokenize plainly: the request's special-token switches (default on), the stop token hidden."""
    return PipelineConfig(
        request_id=request_id, choice_index=choice_index,
        skip_special_tokens=creq.skip_special_tokens if creq is not None else True,
        spaces_between_special_tokens=creq.spaces_between_special_tokens if creq is not None else True,
        hidden_token_ids=frozenset(config.bundle.eos_token_ids),
    )


def put_reasoning(message: ChatMessage | DeltaMessage, reasoning: str | None, field: str) -> None:
    """Set a ChatMessage's or DeltaMessage's reasoning under the server's ``--reasoning-field``:
    the one place batch derender, streaming derender and the gateway name the key."""
    keys = reasoning_keys(field)
    message.reasoning = reasoning if "reasoning" in keys else UNSET
    if "reasoning_content" in keys:
        message.reasoning_content = reasoning


def delta_message(delta: ChoiceDelta, reasoning_field: str) -> DeltaMessage:
    """A pipeline step's delta as an OpenAI stream delta (content, reasoning under the configured key, tool
    calls): shared by streaming derender and the gateway."""
    message = DeltaMessage(content=delta.content)
    put_reasoning(message, delta.reasoning, reasoning_field)
    if delta.tool_calls:
        message.tool_calls = [
            DeltaToolCall(index=c["index"], id=c.get("id"), type=c.get("type"),
                          function=DeltaFunctionCall(name=c["function"].get("name"),
                                                     arguments=c["function"].get("arguments")))
            for c in delta.tool_calls
        ]
    return message


def chat_message(fields: dict[str, Any], pcfg: PipelineConfig, reasoning_field: str) -> ChatMessage:
    """A choice's accumulated ``{content, reasoning, tool_calls}`` as the response's message."""
    message = ChatMessage(content=fields["content"])
    put_reasoning(message, fields["reasoning"], reasoning_field)
    if pcfg.reasoning_parser is None and pcfg.tool_parser is None and message.content is None:
        message.content = ""  # plain detokenization: vLLM answers "" for no text, never null
    if fields["tool_calls"]:
        whole = whole_arguments(pcfg.tool_parser)
        message.tool_calls = [
            ToolCall(id=c["id"], type="function",
                     function=FunctionCall(name=c["function"]["name"] or "",
                                           arguments=whole(c["function"]["arguments"])))
            for c in fields["tool_calls"]
        ]
    return message


# Tool parsers whose whole answers carry a call's arguments as the model wrote them, as their streams do: vLLM
# 0.34's parser engine gives the model's own text for these (earlier versions re-serialized them).
MODEL_TEXT_ARGUMENTS: Final = frozenset({"llama3_json", "llama4_json"})


def whole_arguments(tool_parser: str | None) -> Callable[[str], str]:
    """How a non-streamed answer gives a call's arguments for this tool parser (``final_arguments``; vLLM's
    Harmony path, ``openai``, is json.dumps with its defaults: ASCII only; the model's text for
    ``MODEL_TEXT_ARGUMENTS``)."""
    if tool_parser in MODEL_TEXT_ARGUMENTS:
        return _as_written
    ascii_only = tool_parser == "openai"
    return lambda raw: final_arguments(raw, ascii_only)


def _as_written(raw: str) -> str:
    return raw


def final_arguments(raw: str, ascii_only: bool = False) -> str:
    """A non-streamed call's arguments as vLLM's parsers give them: the model's JSON re-serialized with
    ``json.dumps`` (``{"k": v}`` spacing, key order kept, non-ASCII as is), so clients that compare or cache
    the string see vLLM's. Streams carry the model's own text (so do both, in vLLM); arguments that are not
    one JSON value (a call cut off by max_tokens) stay as written."""
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    return json.dumps(value, ensure_ascii=ascii_only)
