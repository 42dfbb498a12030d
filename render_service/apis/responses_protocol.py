"""OpenAI Responses API wire objects (request, response, output items, stream events) as msgspec structs.

Shapes follow OpenAI's API reference and the ``openai`` package's types (``openai.types.responses``). Requests are
lenient like every request of the render tier: unknown keys are ignored. Input items stay plain data here; the
request mapping (``responses.py``) checks each one and answers 400 for what it cannot take.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from render_service.extend.protocol import PreviousTurn
from render_service.wire.protocol import GenerateResponse, GenerateStreamResponse


class ResponsesRequest(msgspec.Struct, kw_only=True):
    input: str | list[Any] | None = None
    model: str | None = None
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    text: dict[str, Any] | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    background: bool | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    prompt: Any = None
    conversation: Any = None
    stream_options: dict[str, Any] | None = None
    # vLLM's extensions of ResponsesRequest
    request_id: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    # vLLM's sampling extras on /v1/responses (its ResponsesRequest carries them into the sampling params)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    priority: int = 0
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    # ours (docs/rl.md): extend the previous turn's sampled ids; per-token loss masks
    previous_turn: PreviousTurn | None = None
    return_assistant_tokens_mask: bool = False
    return_message_indices: bool = False
    return_prompt_ref: bool = False  # ours: keep the prompt for the next turn's previous_turn.prompt_ref


# ------------------------------------------------------------------------------------------- output


class OutputTextTopLogprob(msgspec.Struct, gc=False):
    """An alternative of an output token (OpenAI's ``TopLogprob``)."""

    token: str
    bytes: list[int]
    logprob: float


class OutputTextLogprob(msgspec.Struct, gc=False):
    """One output token of an ``output_text`` (OpenAI's ``Logprob``): its text, UTF-8 bytes, logprob and
    alternatives (``message.output_text.logprobs``; built by ``text_logprobs.py``)."""

    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[OutputTextTopLogprob] = []


class OutputText(msgspec.Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = []
    logprobs: list[OutputTextLogprob] = []


class ReasoningText(msgspec.Struct, tag_field="type", tag="reasoning_text"):
    text: str


class MessageItem(msgspec.Struct, tag_field="type", tag="message", kw_only=True):
    id: str
    status: str
    role: str = "assistant"
    content: list[OutputText] = []


class ReasoningItem(msgspec.Struct, tag_field="type", tag="reasoning", kw_only=True):
    id: str
    summary: list[Any] = []
    content: list[ReasoningText] = []
    encrypted_content: str | None = None
    status: str | None = None


class FunctionCallItem(msgspec.Struct, tag_field="type", tag="function_call", kw_only=True):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str | None = None


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseError(msgspec.Struct):
    code: str
    message: str


class ResponseObject(msgspec.Struct, kw_only=True):
    id: str
    object: str = "response"
    created_at: int
    status: str
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = []
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[Any] = []
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = {}
    # ours, as vLLM's responses carry extensions: the rendered prompt ids for callers that ask (RL)
    prompt_token_ids: list[int] | UnsetType = UNSET


# ------------------------------------------------------------------------------------------- events
# Each event carries ``type`` (its tag) and ``sequence_number``; field names as openai.types.responses.


class ResponseLifecycleEvent(msgspec.Struct, kw_only=True):
    """response.created / in_progress / completed / incomplete / failed."""

    type: str
    sequence_number: int
    response: ResponseObject


class OutputItemEvent(msgspec.Struct, kw_only=True):
    """response.output_item.added / done."""

    type: str
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartEvent(msgspec.Struct, kw_only=True):
    """response.content_part.added / done."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class TextDeltaEvent(msgspec.Struct, kw_only=True):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str
    logprobs: list[OutputTextLogprob] = []


class TextDoneEvent(msgspec.Struct, kw_only=True):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int = 0
    text: str
    logprobs: list[OutputTextLogprob] = []


class ReasoningDeltaEvent(msgspec.Struct, kw_only=True):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str


class ReasoningDoneEvent(msgspec.Struct, kw_only=True):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int = 0
    text: str


class ArgumentsDeltaEvent(msgspec.Struct, kw_only=True):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(msgspec.Struct, kw_only=True):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


ResponseStreamEvent = (ResponseLifecycleEvent | OutputItemEvent | ContentPartEvent | TextDeltaEvent | TextDoneEvent
                       | ReasoningDeltaEvent | ReasoningDoneEvent | ArgumentsDeltaEvent | ArgumentsDoneEvent)


# ------------------------------------------------------------------------------------------- derender


class DerenderResponsesRequest(msgspec.Struct, kw_only=True):
    """Batch: a generate response (tokens mode) and the Responses request it answers."""

    generate_response: GenerateResponse
    responses_request: ResponsesRequest | None = None
    stream: Literal[False] | None = False
    model: str | None = None
    prompt_tokens: int | None = None
    prompt_token_ids: list[int] | None = None
    response_id: str | None = None
    render_fingerprint: str | None = None


class DerenderResponsesStreamRequest(msgspec.Struct, kw_only=True):
    """One generate SSE event; ``stream_state`` echoed from the previous answer (null on the first)."""

    stream: Literal[True]
    generate_chunk: GenerateStreamResponse
    responses_request: ResponsesRequest | None = None
    stream_state: Any = None
    model: str | None = None
    prompt_tokens: int | None = None
    prompt_token_ids: list[int] | None = None
    response_id: str | None = None
    render_fingerprint: str | None = None


class DerenderResponsesStreamResponse(msgspec.Struct):
    events: list[Any]
    stream_state: str | None = None
