"""``stream_state``: our compact serialized pipeline state.

Wire form (a short ASCII string, opaque to clients)::

    ss1.<base64url(msgpack(envelope))>[.<base64url(HMAC-SHA256(secret, "ss1." + payload))>]

The envelope holds the format version, a binding (a hash of the request id, choice index and the parser
configuration, so a state can only continue the stream it came from) and the pipeline state: a few ints,
short strings and the bytes of an unfinished character. No token history: its size does not grow with the
output. Every state is signed and unsigned or tampered states are refused: with the configured secret
(``--stream-state-secret`` / ``SPLITSERVE_STREAM_STATE_SECRET``), any replica with the same secret can
continue any stream; without one, with ``PROCESS_SECRET``, drawn when this module is first imported, so the
pre-forked workers of one server share it but other servers do not (the server warns at startup).
Everything read is validated (size, structure, bounds) before use: bad state is a 400.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
from typing import Any

import msgspec

PREFIX = "ss1"
# The pipeline state's layout. Bumped whenever a parser's state changes shape, so a stream that crosses a
# deploy is refused with a clear 400 instead of being misread (2: issue 16's argument guard and qwen3_coder on
# the XML engine).
VERSION = 2
# Decoded-size cap: a healthy state is ~100 bytes; parser hold-back buffers may add a few KiB.
MAX_STATE_CHARS = 64 * 1024
SECRET_ENV = "SPLITSERVE_STREAM_STATE_SECRET"
# Signs states when no secret is configured. Drawn at import, in the parent before --workers forks.
PROCESS_SECRET = secrets.token_bytes(32)


class StreamStateError(ValueError):
    """The client sent a stream_state we must refuse (answered with HTTP 400)."""


class Envelope(msgspec.Struct, array_like=True):
    version: int
    binding: bytes
    state: Any


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Envelope)


def secret_from_env(explicit: str | bytes | None = None) -> bytes | None:
    value = explicit if explicit is not None else os.environ.get(SECRET_ENV)
    if not value:
        return None
    return value.encode() if isinstance(value, str) else value


def binding_for(*parts: Any) -> bytes:
    """8-byte hash of what a state belongs to (request id, choice index, parser configuration)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\x00")
    return h.digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _sign(secret: bytes, signed_part: str) -> str:
    return _b64(hmac.digest(secret, signed_part.encode("ascii"), "sha256"))  # OpenSSL's one-shot HMAC


def encode_state(state: msgspec.Struct, binding: bytes, secret: bytes | None) -> str:
    payload = _b64(_encoder.encode(Envelope(VERSION, binding, state)))
    token = f"{PREFIX}.{payload}"
    if secret:
        token = f"{token}.{_sign(secret, token)}"
    return token


def decode_state(token: Any, binding: bytes, secret: bytes | None) -> Any:
    """The plain-data pipeline state inside ``token``; StreamStateError for anything we must refuse."""
    if not isinstance(token, str):
        raise StreamStateError("stream_state is not a state this server wrote (expected a string token)")
    if len(token) > MAX_STATE_CHARS:
        raise StreamStateError(f"stream_state is too large ({len(token)} > {MAX_STATE_CHARS} characters)")
    parts = token.split(".")
    if parts[0] != PREFIX:
        raise StreamStateError("stream_state has an unknown format or version")
    if len(parts) not in (2, 3):
        raise StreamStateError("stream_state is malformed")
    if secret:
        if len(parts) != 3:
            raise StreamStateError("stream_state is not signed but this server requires signed state")
        expected = _sign(secret, f"{parts[0]}.{parts[1]}")
        if not hmac.compare_digest(expected, parts[2]):
            raise StreamStateError("stream_state signature does not match (tampered, or signed with another secret)")
    try:
        env = _decoder.decode(_unb64(parts[1]))
    except (binascii.Error, ValueError, msgspec.DecodeError) as exc:
        raise StreamStateError(f"stream_state is corrupt or truncated: {exc}") from None
    if env.version != VERSION:
        raise StreamStateError(f"stream_state version {env.version} is not supported (this server reads {VERSION})")
    if not hmac.compare_digest(env.binding, binding):
        raise StreamStateError(
            "stream_state belongs to another request, choice or parser configuration than this one"
        )
    return env.state
