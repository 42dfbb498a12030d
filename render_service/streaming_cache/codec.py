"""``stream_state``: our compact serialized pipeline state.

Wire form (a short ASCII string, opaque to clients)::

    ss1.<base64url(msgpack(envelope))>.<hex(BLAKE2b-128 keyed with the secret, of msgpack(envelope))>

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
# deploy is refused with a clear 400 instead of being misread (2: the tool parsers' argument guard and qwen3_coder on
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


_MAC_BASES: dict[bytes, Any] = {}  # secret -> a keyed BLAKE2b ready to copy (the key block done once)


def _tag(secret: bytes, payload: bytes) -> str:
    """The state's MAC: keyed BLAKE2b (RFC 7693's MAC mode) of the encoded envelope, 128 bits in hex. On every
    chunk it is signed and checked, so it is kept to a copy, an update and a digest."""
    base = _MAC_BASES.get(secret)
    if base is None:
        if len(_MAC_BASES) >= 16:  # secrets are one or two per process; tests make more
            _MAC_BASES.clear()
        key = hashlib.blake2b(secret, digest_size=32).digest()  # BLAKE2b keys are at most 64 bytes
        base = _MAC_BASES[secret] = hashlib.blake2b(key=key, digest_size=16, person=b"splitserve-state")
    mac = base.copy()
    mac.update(payload)
    tag: str = mac.hexdigest()
    return tag


# Tokens this process signed and has not read back yet. A stream's next chunk brings back the token of its last
# answer; when its payload is byte for byte the one we signed under that tag with the same secret, it is authentic
# without a second MAC or base64 decode (with a slow BLAKE2b build those were a tenth of a chunk's CPU). Anything
# else (another replica's token, a retried chunk, a tampered payload) takes the full check. Bounded (~12 MiB at
# most): a live stream holds one entry, large states are not kept, abandoned entries age out oldest first.
_ISSUED: dict[str, tuple[bytes, str, bytes]] = {}  # tag -> (secret, payload, raw)
MAX_ISSUED = 4096
MAX_ISSUED_PAYLOAD = 2048


def encode_state(state: msgspec.Struct, binding: bytes, secret: bytes | None) -> str:
    raw = _encoder.encode(Envelope(VERSION, binding, state))
    payload = _b64(raw)
    if not secret:
        return f"{PREFIX}.{payload}"
    tag = _tag(secret, raw)
    if len(payload) > MAX_ISSUED_PAYLOAD:
        return f"{PREFIX}.{payload}.{tag}"
    if len(_ISSUED) >= MAX_ISSUED:
        _ISSUED.pop(next(iter(_ISSUED)), None)
    _ISSUED[tag] = (secret, payload, raw)
    return f"{PREFIX}.{payload}.{tag}"


def _issued_raw(parts: list[str], secret: bytes) -> bytes | None:
    """The raw envelope of a token this process signed with ``secret`` (forgotten once read back), else None."""
    entry = _ISSUED.pop(parts[2], None)
    if entry is not None and entry[1] == parts[1] and hmac.compare_digest(entry[0], secret):
        return entry[2]
    return None


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
    if secret and len(parts) != 3:
        raise StreamStateError("stream_state is not signed but this server requires signed state")
    raw = _issued_raw(parts, secret) if secret else None
    if raw is None:
        try:
            raw = _unb64(parts[1])
        except (binascii.Error, ValueError) as exc:
            raise StreamStateError(f"stream_state is corrupt or truncated: {exc}") from None
        if secret and not hmac.compare_digest(_tag(secret, raw), parts[2]):
            raise StreamStateError("stream_state signature does not match (tampered, or signed with another secret)")
    try:
        env = _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise StreamStateError(f"stream_state is corrupt or truncated: {exc}") from None
    if env.version != VERSION:
        raise StreamStateError(f"stream_state version {env.version} is not supported (this server reads {VERSION})")
    if not hmac.compare_digest(env.binding, binding):
        raise StreamStateError(
            "stream_state belongs to another request, choice or parser configuration than this one"
        )
    return env.state
