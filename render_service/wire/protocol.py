"""Wire objects of the render tier, as msgspec structs.

Shapes follow vLLM 0.32's render server (`vllm launch render`) and tokens-only engine
(`/inference/v1/generate`); see docs/compatibility.md for where we differ on purpose.

Requests are lenient: unknown keys are ignored (vLLM's OpenAIBaseModel does the same), so a client
written for any 0.30-0.33 release works unchanged. Responses list every key vLLM emits (as null
where unset) because clients index them directly. Keys that only some releases emit use ``UNSET`` so
they appear only when set.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, TypedDict

import msgspec
from msgspec import UNSET, UnsetType

from render_service.extend.protocol import ExtendInfo, PreviousTurn

# Structs repeat their shared fields on purpose: msgspec puts inherited fields first, reordering vLLM's keys.
# --------------------------------------------------------------------------------------------- errors


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: int = 400


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


# ------------------------------------------------------------------------------------ sampling params


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """vLLM's ``SamplingParams`` as it crosses the wire (render output = generate input).

    Field order is vLLM's. vLLM always serializes the first group (penalties, temperature, top_p,
    top_k, min_p, stop, stop_token_ids, max_tokens, output_kind, skip_clone, bad_words,
    skip_reading_prefix_cache) and the rest only when they differ from the default; here the first
    group defaults to None ("not set": the engine applies its own default), so whatever render sets is
    written and an engine can tell "caller said max_tokens" from "default".
    """

    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = None
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    flat_logprobs: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: int | None = None
    skip_clone: bool | None = None
    output_text_buffer_length: int = 0
    structured_outputs: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None
    bad_words: list[str] | None = None
    skip_reading_prefix_cache: bool | None = None
    thinking_token_budget: int | None = None
    repetition_detection: dict[str, Any] | None = None


# ------------------------------------------------------------------------------------ render requests


class ChatCompletionRequest(msgspec.Struct):
    """OpenAI chat request plus vLLM's extensions. Messages stay plain dicts: the template layer owns them."""

    messages: list[dict[str, Any]]
    model: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    prompt_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    use_beam_search: bool = False
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    include_reasoning: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = None
    return_block_hashes: bool = False  # ours: the engines' prefix-cache block hashes of the rendered ids
    priority: int = 0
    return_token_ids: bool | None = None
    # vLLM: logprob tokens as "token_id:N" strings; None = the server's --return-tokens-as-token-ids
    return_tokens_as_token_ids: bool | None = None
    kv_transfer_params: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    return_weight_versions: bool = False  # vLLM 0.33: each choice says which weights sampled which tokens
    user: str | None = None
    request_id: str | None = None
    conversation_id: str | None = None  # vLLM's multi-turn P/D proxy: keys KV reuse across turns (gateway)
    # Exact multi-turn tokens (render_service/extend/, docs/rl.md): extend the sampled ids of the previous turn,
    # and per-token loss masks (vLLM's return_assistant_tokens_mask; message_indices is ours).
    previous_turn: PreviousTurn | None = None
    return_assistant_tokens_mask: bool = False
    return_message_indices: bool = False
    return_prompt_ref: bool = False  # ours: keep the prompt for the next turn's previous_turn.prompt_ref


class CompletionRequest(msgspec.Struct):
    prompt: str | list[Any] | None = None
    model: str | None = None
    suffix: str | None = None
    max_tokens: int | None = 16
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    use_beam_search: bool = False
    echo: bool | None = False
    prompt_embeds: Any = None
    add_special_tokens: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = None
    return_block_hashes: bool = False  # ours: the engines' prefix-cache block hashes of the rendered ids
    priority: int = 0
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    kv_transfer_params: dict[str, Any] | None = None
    return_weight_versions: bool = False
    user: str | None = None
    request_id: str | None = None
    conversation_id: str | None = None  # vLLM's multi-turn P/D proxy: keys KV reuse across turns (gateway)


# ------------------------------------------------------------------------ generate request / response
# Kept apart from the engine's protocol on purpose: each tier deploys alone (render emits vLLM's bytes).


class GenerateRequest(msgspec.Struct, kw_only=True):
    """Render output and /inference/v1/generate input. Key order and null-valued keys match vLLM 0.33.

    0.33's shape: a request's ``kv_transfer_params`` at the top level (0.32 put a chat request's in
    ``sampling_params.extra_args``; engines of both releases copy the top-level value there) and
    ``parse_context`` (the chat context 0.33's ``output_mode: "derender"`` parses with; null for completions).
    ``render_fingerprint`` is ours (vLLM's engine ignores unknown keys): the hash of the render
    configuration, for derender to check.
    """

    request_id: str | None = None
    token_ids: Sequence[int]
    token_offsets: list[tuple[int, int]] | None = None
    features: dict[str, Any] | None = None
    content_parts: list[dict[str, Any]] | None = None
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    model: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    return_token_ids: bool | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    parse_context: dict[str, Any] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    # (a PromptIds view where the ids were kept for a prompt reference: written from their JSON)
    assistant_tokens_mask: Sequence[int] | UnsetType = UNSET
    message_indices: Sequence[int] | UnsetType = UNSET  # ours: which message each prompt token came from
    extend: ExtendInfo | UnsetType = UNSET  # ours: how a render with previous_turn was made
    prompt_ref: str | UnsetType = UNSET  # ours: names token_ids for the next turn's previous_turn.prompt_ref
    return_token_logprobs: bool | UnsetType = UNSET
    return_top_k_logprobs: bool | UnsetType = UNSET
    render_fingerprint: str | UnsetType = UNSET
    # Ours, asked for with the request's return_block_hashes: vLLM's prefix-cache hash of each full block of
    # token_ids, as its KV events carry them (64-bit ints), so a router indexes without re-hashing.
    block_hashes: list[int] | UnsetType = UNSET


class UsageInfo(msgspec.Struct):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: dict[str, Any] | None = None
    completion_tokens_details: dict[str, Any] | None = None

    @classmethod
    def counted(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


# ------------------------------------------------------------------------------- engine logprobs
# What a tokens-only engine sends as a choice's ``logprobs``, in either of vLLM's shapes, decoded into one type:
# 0.32+ ``GenerateLogProbs`` (``token_id`` integers, ``rank``; ``sampled`` with return_token_logprobs) and the
# older OpenAI chat shape whose ``token`` is the placeholder "token_id:N" (``bytes`` ignored). Which key an entry
# carries is a value question (logprobs.entry_token_id); a wrong type anywhere is the client's 400.


class GenerateTopLogprob(msgspec.Struct, gc=False):
    """One alternative of a sampled token."""

    token_id: int | None = None
    token: str | None = None
    logprob: float = -9999.0  # vLLM's default, and its clamp of -inf
    rank: int | None = None
    bytes: list[int] | None = None


class GenerateTokenLogprob(msgspec.Struct, gc=False):
    """One sampled token: its id (either shape), logprob and rank-ordered alternatives."""

    token_id: int | None = None
    token: str | None = None
    logprob: float = -9999.0
    rank: int | None = None
    bytes: list[int] | None = None
    top_logprobs: list[GenerateTopLogprob] | None = None


class GenerateLogprobs(msgspec.Struct):
    content: list[GenerateTokenLogprob] | None = None
    sampled: list[float] | None = None  # vLLM 0.32+ with return_token_logprobs; not read by derender


class PromptLogprob(msgspec.Struct, gc=False):
    """One alternative at a prompt position (vLLM's ``Logprob``); keyed by token id in ``prompt_logprobs``."""

    logprob: float = -9999.0
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt position: null (the first position, or none asked) or {token id: its logprob}.
GeneratePromptLogprobs = list[dict[int, PromptLogprob] | None]


class GenerateResponseChoice(msgspec.Struct):
    """One choice of a generate response, older (<=0.31) or newer (0.32+, ``text``/``sampling_mask``) shape."""

    index: int = 0
    token_ids: list[int] | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    logprobs: GenerateLogprobs | None = None
    routed_experts: str | None = None
    text: str | None = None
    sampling_mask: list[int] | None = None
    weight_versions: list[dict[str, Any]] | None = None


class GenerateResponse(msgspec.Struct):
    """Non-streaming /inference/v1/generate response; a missing ``output_mode`` means tokens mode."""

    request_id: str
    choices: list[GenerateResponseChoice] = []
    model: str | None = None
    created: int | None = None
    usage: UsageInfo | None = None
    prompt_logprobs: GeneratePromptLogprobs | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    output_mode: str | None = None
    prompt_token_ids: list[int] | None = None
    mm_placeholders: Any = None
    metrics: dict[str, Any] | None = None
    render_fingerprint: str | None = None


# Decoded once per streamed token in the gateway: untracked by the garbage collector (gc=False: plain decoded data
# that never refers back to itself), so the per-token allocations do not drive collections.
class GenerateStreamChoice(msgspec.Struct, gc=False):
    index: int = 0
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: GenerateLogprobs | None = None
    routed_experts: str | None = None
    text: str | None = None
    weight_versions: list[dict[str, Any]] | None = None  # on a choice's last event


class GenerateStreamResponse(msgspec.Struct, gc=False):  # gc=False: as its choices
    """One SSE ``data:`` event of a streaming generate response."""

    request_id: str | None = None
    choices: list[GenerateStreamChoice] = []
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    output_mode: str | None = None
    metrics: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None  # our engine's final event, when it holds KV for a peer


# ------------------------------------------------------------------------------------ derender requests


class DerenderChatRequest(msgspec.Struct):
    generate_response: GenerateResponse
    stream: Literal[False] | None = False
    model: str | None = None
    prompt_tokens: int | None = None
    chat_request: ChatCompletionRequest | None = None
    prompt_token_ids: list[int] | None = None
    render_fingerprint: str | None = None


class DerenderCompletionRequest(msgspec.Struct):
    generate_responses: list[GenerateResponse]
    stream: Literal[False] | None = False
    model: str | None = None
    prompt_tokens: list[int] | None = None
    completion_request: CompletionRequest | None = None
    prompt_token_ids: list[list[int] | None] | None = None
    render_fingerprint: str | None = None


class DerenderChatStreamRequest(msgspec.Struct):
    stream: Literal[True]
    generate_chunk: GenerateStreamResponse
    model: str | None = None
    stream_state: Any = None
    prompt_tokens: int | None = None
    prompt_token_ids: list[int] | None = None
    chat_request: ChatCompletionRequest | None = None
    render_fingerprint: str | None = None


class DerenderCompletionStreamRequest(msgspec.Struct):
    stream: Literal[True]
    generate_chunk: GenerateStreamResponse
    model: str | None = None
    stream_state: Any = None
    prompt_tokens: int | None = None
    prompt_token_ids: list[int] | None = None
    completion_request: CompletionRequest | None = None
    render_fingerprint: str | None = None


class DerenderStreamProbe(msgspec.Struct):
    """Just enough of a derender body to route it: vLLM discriminates batch and stream on ``stream``."""

    stream: bool | None = False


# ----------------------------------------------------------------------------------- chat responses


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCall


# ------------------------------------------------------------------------------- output logprobs
# What the render side answers, built as plain dicts on the per-token path (derender/logprobs.py); typed here so the
# responses below, their OpenAPI schema and the code that builds them agree.


class ChatLogprob(TypedDict, total=False):
    """One token of OpenAI chat logprobs; ``token_id`` is ours (absent with vLLM's "token_id:N" strings)."""

    token: str
    logprob: float
    bytes: list[int]
    token_id: int | None
    top_logprobs: list[ChatLogprob]  # the sampled token's alternatives (absent on an alternative)


class ChatLogprobs(TypedDict):
    content: list[ChatLogprob]
    refusal: None


class CompletionLogprobs(TypedDict, total=False):
    """The legacy completions shape, plus ``token_ids`` parallel to ``tokens`` (absent as for chat)."""

    text_offset: list[int]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token (nothing precedes it)
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]
    token_ids: list[int | None]


class ChatMessage(msgspec.Struct):
    role: str = "assistant"
    content: str | None = None
    refusal: str | None = None
    annotations: Any = None
    audio: Any = None
    function_call: Any = None
    # vLLM 0.32 omits the key when no tool was parsed and lists the calls when one was.
    tool_calls: list[ToolCall] | UnsetType = UNSET
    # --reasoning-field picks the key(s): ``reasoning`` (vLLM >= 0.11), ``reasoning_content`` (older), both.
    reasoning: str | None | UnsetType = None
    reasoning_content: str | None | UnsetType = UNSET


class ChatCompletionChoice(msgspec.Struct):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    routed_experts: str | None = None
    weight_versions: list[dict[str, Any]] | None = None  # vLLM 0.33; set with return_weight_versions


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    service_tier: str | None = None
    system_fingerprint: str | None = None
    prompt_logprobs: GeneratePromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: GeneratePromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    routed_experts: str | None = None
    weight_versions: list[dict[str, Any]] | None = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    service_tier: str | None = None
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None


# ---------------------------------------------------------------------------------- stream chunk types


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(msgspec.Struct):
    role: str | None = None
    content: str | None = None
    reasoning: str | None | UnsetType = None
    reasoning_content: str | None | UnsetType = UNSET
    tool_calls: list[DeltaToolCall] | UnsetType = UNSET


class ChatCompletionStreamChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    weight_versions: list[dict[str, Any]] | None = None  # vLLM 0.33: a choice's last chunk, when asked


class ChatCompletionStreamResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    metrics: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None  # vLLM 0.33: the final chunk's (decode's end of turn)


class CompletionStreamChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    weight_versions: list[dict[str, Any]] | None = None


class CompletionStreamResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    metrics: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None


class DerenderChatStreamResponse(msgspec.Struct):
    chunk: ChatCompletionStreamResponse
    stream_state: Any = None


class DerenderCompletionStreamResponse(msgspec.Struct):
    chunk: CompletionStreamResponse
    stream_state: Any = None


# ----------------------------------------------------------------------------------- other endpoints


class TokenizeRequest(msgspec.Struct):
    """vLLM's /tokenize: either ``prompt`` (completion style) or ``messages`` (chat style)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct):
    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class ModelPermission(msgspec.Struct):
    id: str
    created: int
    object: str = "model_permission"
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(msgspec.Struct):
    id: str
    created: int
    object: str = "model"
    owned_by: str = "splitserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = []


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
