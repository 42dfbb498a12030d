"""What a stored response may carry besides its conversation: the request's ``metadata``, ``user`` and
``reasoning`` are echoed in the response and kept with it, so each is bounded before any engine work (a 400
naming the field). ``metadata`` follows OpenAI's published limits; the others are ours."""

from __future__ import annotations

from render_service.apis.responses_protocol import ResponsesRequest
from render_service.http.errors import ApiError, bad_request

MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_USER_CHARS = 512
MAX_REASONING_KEYS = 8
MAX_REASONING_TEXT_CHARS = 512


def check_stored_fields(req: ResponsesRequest) -> None:
    """Raise the 400 for an over-size ``metadata``, ``user`` or ``reasoning``."""
    metadata = req.metadata or {}
    if len(metadata) > MAX_METADATA_KEYS:
        raise bad_request(f"metadata may have at most {MAX_METADATA_KEYS} keys ({len(metadata)} given)", "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise bad_request(f"metadata keys are at most {MAX_METADATA_KEY_CHARS} characters", "metadata")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise bad_request(f"metadata values are at most {MAX_METADATA_VALUE_CHARS} characters", "metadata")
    if req.user is not None and len(req.user) > MAX_USER_CHARS:
        raise bad_request(f"user is at most {MAX_USER_CHARS} characters", "user")
    reasoning = req.reasoning or {}
    if len(reasoning) > MAX_REASONING_KEYS:
        raise bad_request(f"reasoning may have at most {MAX_REASONING_KEYS} keys", "reasoning")
    for key, value in reasoning.items():
        if len(key) > MAX_REASONING_TEXT_CHARS or not (
                value is None or isinstance(value, bool) or isinstance(value, (int, float))
                or (isinstance(value, str) and len(value) <= MAX_REASONING_TEXT_CHARS)):
            raise bad_request(f"reasoning's values are short strings, numbers, booleans or null (at most "
                              f"{MAX_REASONING_TEXT_CHARS} characters)", "reasoning")


def check_storable(body_bytes: int, limit: int) -> None:
    """A request whose body alone is over what one tenant may store cannot be stored: refused before any work."""
    if body_bytes > limit:
        raise ApiError(f"this request ({body_bytes} bytes) is larger than a stored response may be ({limit} bytes); "
                       "send it with store: false", 400, "store")
