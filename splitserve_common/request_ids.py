"""Client request ids: which ones may travel in HTTP headers, which are refused, and what goes in their place.

A client names its request in the ``X-Request-Id`` header or in the body's ``request_id`` (vLLM's rule:
the header wins). Servers echo and log the id, and the gateway forwards it to engines in their
``X-Request-Id``, so an id that reaches a header must be plain text no header parser can misread: a CR or
LF would start a header of the client's choosing, a character outside latin-1 cannot be written at all.

- A header id is used only when it is ``header_safe``; otherwise it is ignored (a fresh id is used), as the
  access log and the echo already do.
- A body id may be any printable text up to ``MAX_CLIENT_ID_CHARS`` (vLLM echoes it in the response's
  ``id``); longer ids and control characters are a 400 (``body_id_violation``).
- An engine hop carries the id only when it is header-safe; any other id is replaced by a digest of it
  (``engine_header_id``), so the engine sees a stable stand-in and never the client's bytes.
"""

from __future__ import annotations

import hashlib
import re

MAX_HEADER_ID_CHARS = 256
MAX_CLIENT_ID_CHARS = 256
_HEADER_SAFE = re.compile(rf"[A-Za-z0-9._:/+=@-]{{1,{MAX_HEADER_ID_CHARS}}}")
# C0 and C1 controls, DEL, and the Unicode line and paragraph separators: none belongs in an id or a log line.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def header_safe(text: str) -> bool:
    """Whether ``text`` may be written into an HTTP header (and a log line) as it is."""
    return _HEADER_SAFE.fullmatch(text) is not None


def body_id_violation(text: str) -> str | None:
    """Why a body ``request_id`` is refused (the 400's message), or None when it is acceptable."""
    if not text:
        return "request_id must not be empty"
    if len(text) > MAX_CLIENT_ID_CHARS:
        return f"request_id is longer than {MAX_CLIENT_ID_CHARS} characters ({len(text)})"
    if _CONTROL.search(text):
        return "request_id must not contain control characters (CR, LF, tab, ...)"
    return None


def engine_header_id(request_id: str) -> str:
    """The id an engine's X-Request-Id carries for ``request_id``: itself when header-safe, else a digest."""
    if header_safe(request_id):
        return request_id
    return "id-" + hashlib.blake2b(request_id.encode(), digest_size=16).hexdigest()
