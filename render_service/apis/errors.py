"""Each API's own error body: OpenAI's for Responses, Anthropic's for Messages.

Handlers raise ``ApiError`` as everywhere in the render tier; only the body differs per API.
"""

from __future__ import annotations

import msgspec

from render_service.http.errors import ApiError

_encode = msgspec.json.Encoder().encode

# Anthropic's error types by HTTP status (their API reference, "Errors").
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


class OpenAIErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorBody(msgspec.Struct):
    error: OpenAIErrorInfo


class AnthropicErrorInfo(msgspec.Struct):
    type: str
    message: str


class AnthropicErrorBody(msgspec.Struct, tag_field="type", tag="error"):
    error: AnthropicErrorInfo


def openai_error_body(error: ApiError) -> bytes:
    """OpenAI's envelope: ``type`` is invalid_request_error for a 4xx, ``code`` a string or null."""
    kind = "invalid_request_error" if 400 <= error.status < 500 else "server_error"
    code = getattr(error, "code", None)
    return _encode(OpenAIErrorBody(OpenAIErrorInfo(error.message, kind, error.param, code)))


def anthropic_error_body(error: ApiError) -> bytes:
    kind = ANTHROPIC_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    message = f"{error.param}: {error.message}" if error.param and error.param not in error.message else error.message
    return _encode(AnthropicErrorBody(AnthropicErrorInfo(kind, message)))


def coded(error: ApiError, code: str) -> ApiError:
    """An ApiError with OpenAI's string ``code`` (e.g. previous_response_not_found)."""
    error.code = code  # type: ignore[attr-defined]
    return error
