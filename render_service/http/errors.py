"""Client-facing errors and vLLM's error envelope.

Every failure a client can cause is an ``ApiError`` carrying its HTTP status; the server turns it
into ``{"error": {"message", "type", "param", "code"}}`` where ``code`` is the status as an integer
(vLLM's shape, not OpenAI's string codes).
"""

from __future__ import annotations

import re

import msgspec

from render_service.wire.protocol import ErrorInfo, ErrorResponse

ERROR_TYPES = {
    400: "BadRequestError",
    401: "UnauthorizedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    415: "UnsupportedMediaTypeError",
    429: "TooManyRequestsError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


class ApiError(Exception):
    """An error answered to the client with ``status`` (4xx unless it is a bug of ours)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type or ERROR_TYPES.get(status, "BadRequestError")
        self.headers = headers  # e.g. Retry-After on a 429


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(message, 400, param)


def not_found(message: str, param: str | None = None) -> ApiError:
    return ApiError(message, 404, param)


def model_not_found(model: str) -> ApiError:
    return ApiError(f"The model `{model}` does not exist.", 404, "model")


_encoder = msgspec.json.Encoder()


def error_body(error: ApiError) -> bytes:
    info = ErrorInfo(message=error.message, type=error.type, param=error.param, code=error.status)
    return _encoder.encode(ErrorResponse(error=info))


# msgspec ends a validation message with the path: " - at `$.a.b[0]`", "[...]" for a dict's value, or
# " - at `key` in `$.a`" for a dict's key.
_PATH = re.compile(r" - at (?:`key` in )?`\$((?:\.[A-Za-z_][A-Za-z_0-9]*|\[\d+\]|\[\.\.\.\])*)`$")


def from_decode_error(exc: msgspec.DecodeError) -> ApiError:
    """A 400 for a body msgspec rejected; ``param`` names the offending field when known."""
    text = str(exc)
    if not isinstance(exc, msgspec.ValidationError):
        return bad_request(f"Invalid JSON body: {text}")
    match = _PATH.search(text)
    param = None
    if match and match.group(1):
        param = match.group(1).lstrip(".")
    return bad_request(f"Invalid request: {text}", param)
