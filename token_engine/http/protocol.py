"""Wire structs of the tokens-only engine API (vLLM's /inference/v1/generate), msgspec at the boundary.

Decoding ignores unknown keys, so a GenerateRequest exactly as the render tier (ours or vLLM's) emits it
is accepted unchanged; `sampling_params` keys a tokens-only engine has no use for (output_kind,
skip_clone, detokenize, skip_special_tokens...) are ignored the same way.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType
from starlette.responses import Response

# The engine names each generation this prefix + the caller's id (vLLM's tokens-only server does the same).
REQUEST_ID_PREFIX = "generate-tokens-"


# Kept apart from the render tier's protocol on purpose: each tier deploys alone (engine decodes any tier's).
class StreamOptions(msgspec.Struct):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class SamplingParams(msgspec.Struct):
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = None  # None: the caller did not set it (defaults to max_model_len - prompt_len)
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # read by output_mode "text" and "derender" (vLLM's defaults); a tokens answer never has text
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: dict | None = None
    skip_reading_prefix_cache: bool | None = None
    # RL logprob controls, as vLLM's SamplingParams (token_engine/rl/logprob_controls.py)
    logprob_token_ids: list[int] | None = None
    prompt_logprob_token_ids: list[list[int]] | None = None
    prompt_logprob_start: int | None = None
    trace_decode_token_ids: list[int] | None = None
    # vLLM 0.32's render put a chat request's kv_transfer_params here (0.33's goes to the top level): read as such.
    extra_args: dict[str, Any] | None = None


class GenerateRequest(msgspec.Struct):
    token_ids: list[int]
    sampling_params: SamplingParams
    request_id: str | None = None
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    features: Any = None
    content_parts: Any = None
    output_mode: str | None | UnsetType = UNSET  # "tokens" (default), "text" or "derender" (vLLM 0.33+)
    # render's chat context for output_mode "derender" (vLLM's ParseContext); ignored by the other modes
    parse_context: dict[str, Any] | None = None
    return_token_ids: bool | None = None
    return_token_logprobs: bool | None = None
    # Our extension: "token_id_strings" answers in the older ChatCompletionLogProbs shape ("token_id:N").
    logprobs_format: str | None = None
    # The render tier's hint (vLLM): false = the prompt leaves the model thinking, so structured outputs wait
    # until the model closes its reasoning (</think>) before they constrain anything.
    reasoning_ended: bool | None = None


class AbortRequest(msgspec.Struct):
    request_ids: str | list[str]  # vLLM 0.34: one id or a list

    def ids(self) -> list[str]:
        return [self.request_ids] if isinstance(self.request_ids, str) else self.request_ids


# ---- logprobs, newer shape (GenerateLogProbs: integer token ids) ------------------------------------
class TopLogprob(msgspec.Struct):
    token_id: int
    logprob: float
    rank: int | None


class TokenLogprobEntry(msgspec.Struct):
    token_id: int
    logprob: float
    rank: int | None
    top_logprobs: list[TopLogprob]


class GenerateLogProbs(msgspec.Struct):
    content: list[TokenLogprobEntry] | None
    sampled: list[float] | None = None


# ---- logprobs, older shape (OpenAI chat logprobs with "token_id:N" placeholders) --------------------
class LegacyTopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class LegacyTokenLogprobEntry(msgspec.Struct):
    token: str
    logprob: float
    top_logprobs: list[LegacyTopLogprob]
    bytes: list[int] | None = None


class ChatCompletionLogProbs(msgspec.Struct):
    content: list[LegacyTokenLogprobEntry] | None


class PromptLogprob(msgspec.Struct):
    logprob: float
    rank: int | None
    decoded_token: str | None = None


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class UsageInfo(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class WeightVersion(msgspec.Struct):
    """vLLM's per-choice label of the weights that produced output tokens [start, end): "default" until a
    trainer sets a version (finish_weight_update), one range per version that sampled tokens of the choice."""

    version: str
    start: int
    end: int


def weight_versions(num_tokens: int, spans: list[tuple[str, int, int]] | None = None) -> list[WeightVersion]:
    if spans is not None:
        return [WeightVersion(v, start, end) for v, start, end in spans]
    return [WeightVersion("default", 0, num_tokens)] if num_tokens else []


class GenerateResponseChoice(msgspec.Struct):
    index: int
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None  # a stop string in output_mode "text"
    logprobs: GenerateLogProbs | ChatCompletionLogProbs | None = None
    routed_experts: str | None = None
    weight_versions: list[WeightVersion] = msgspec.field(default_factory=list)
    text: str | UnsetType = UNSET  # output_mode "text": the output, less a matched stop string


class GenerateResponse(msgspec.Struct):
    request_id: str
    model: str | None
    created: int
    choices: list[GenerateResponseChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    output_mode: str = "tokens"
    prompt_token_ids: list[int] | UnsetType = UNSET


class GenerateDerenderChoice(msgspec.Struct):
    """output_mode "derender": the parsed assistant message (vLLM's ChatMessage) instead of text."""

    index: int
    token_ids: list[int] | None  # null while a parser hides the reasoning (include_reasoning false)
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: ChatCompletionLogProbs | None = None
    routed_experts: str | None = None
    weight_versions: list[WeightVersion] = msgspec.field(default_factory=list)
    message: dict[str, Any] = msgspec.field(default_factory=dict)


class GenerateDerenderResponse(msgspec.Struct):
    request_id: str
    model: str | None
    created: int
    choices: list[GenerateDerenderChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    output_mode: str = "derender"
    prompt_token_ids: list[int] | UnsetType = UNSET


class GenerateStreamChoice(msgspec.Struct):
    index: int
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: GenerateLogProbs | ChatCompletionLogProbs | None = None
    routed_experts: str | None = None
    weight_versions: list[WeightVersion] | UnsetType = UNSET  # the choice's last event only, as vLLM
    text: str | UnsetType = UNSET  # output_mode "text": the text since this choice's previous event


class GenerateStreamResponse(msgspec.Struct):
    request_id: str
    choices: list[GenerateStreamChoice]
    usage: UsageInfo | None = None
    output_mode: str = "tokens"
    prompt_token_ids: list[int] | UnsetType = UNSET


class GenerateDerenderStreamChoice(msgspec.Struct):
    index: int
    token_ids: list[int] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: ChatCompletionLogProbs | None = None
    routed_experts: str | None = None
    weight_versions: list[WeightVersion] | UnsetType = UNSET
    delta: dict[str, Any] = msgspec.field(default_factory=dict)  # vLLM's DeltaMessage, set fields only


class GenerateDerenderStreamResponse(msgspec.Struct):
    request_id: str
    choices: list[GenerateDerenderStreamChoice]
    usage: UsageInfo | None = None
    output_mode: str = "derender"
    prompt_token_ids: list[int] | UnsetType = UNSET
    kv_transfer_params: dict[str, Any] | UnsetType = UNSET  # as GenerateStreamEndResponse: the last event only


class GenerateStreamEndResponse(GenerateStreamResponse):
    """The event that ends a request whose KV the connector holds for a peer (bidirectional P/D: decode's
    end-of-turn params for the conversation's next prefill). vLLM's stream has no such key; only this event
    carries it, so every other event keeps vLLM's bytes."""

    kv_transfer_params: dict[str, Any] | None = None


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


def error_body(message: str, status: int = 400, param: str | None = None, type_: str | None = None) -> bytes:
    if type_ is None:
        # 502: a peer engine failed us (a KV handoff), not this engine: typed as the gateway types it
        type_ = {400: "BadRequestError", 404: "NotFoundError", 413: "RequestTooLargeError", 429: "RateLimitError",
                 502: "BadGatewayError", 503: "ServiceUnavailableError"}.get(
            status, "InternalServerError" if status >= 500 else "BadRequestError")
    return msgspec.json.encode(ErrorResponse(ErrorInfo(message, type_, param, status)))


def error_response(message: str, status: int = 400, param: str | None = None) -> Response:
    """vLLM's error envelope as an HTTP answer."""
    return Response(error_body(message, status, param), status_code=status, media_type="application/json")
