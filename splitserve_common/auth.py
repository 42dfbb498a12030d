"""Who may call a server: API keys presented as ``Authorization: Bearer KEY``, and the startup warning for a
server that listens beyond loopback without one.

Both tiers use it: the render tier and gateway check keys per route (their own endpoint wrapper), the engine
through ``ApiKeyGuard`` around its whole app. Keys are compared as SHA-256 digests with ``hmac.compare_digest``
against every configured key (several keys let an operator rotate one without downtime), so neither the
position of the first wrong byte nor a key's length shows in the response time.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
from collections.abc import Iterable
from typing import Any

# Reachable without a key, as vLLM's own list: probes, load reports, the version, Prometheus scrapes and
# the API description. Everything else (unknown paths included) needs the key: a new route is guarded by default.
PUBLIC_PATHS = frozenset({"/health", "/ping", "/load", "/version", "/metrics", "/openapi.json"})
API_KEY_ENV = "VLLM_API_KEY"
# Set in the ASGI scope by ApiKeyGuard once a request presented one of the keys: what it says about itself
# (the gateway's tenant header) may then be believed.
AUTHENTICATED_SCOPE_KEY = "splitserve.authenticated"


def add_api_key_argument(parser: Any, open_paths: str) -> None:
    """``--api-key KEY [KEY ...]`` as vLLM's (read with ``api_keys_from``)."""
    parser.add_argument("--api-key", action="extend", nargs="+", default=None, metavar="KEY",
                        help=f"require 'Authorization: Bearer KEY' on every endpoint but {open_paths} "
                             f"(several keys: any one; default: ${API_KEY_ENV})")


def api_keys_from(flag_values: list[str] | None, env: str = API_KEY_ENV) -> list[str]:
    """The keys of a server: its --api-key values, else the environment variable (vLLM's VLLM_API_KEY)."""
    if flag_values:
        return list(flag_values)
    value = os.environ.get(env)
    return [value] if value else []


def bearer_token(authorization: str | bytes | None) -> str | None:
    """The credentials of an ``Authorization: Bearer <token>`` header; the scheme is case-insensitive
    (RFC 7235 section 2.1). None for a missing header or another scheme."""
    if not authorization:
        return None
    if isinstance(authorization, bytes):
        authorization = authorization.decode("latin-1")
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


class ApiKeys:
    """The keys a server accepts; empty means no authentication."""

    def __init__(self, keys: str | Iterable[str] | None) -> None:
        if isinstance(keys, str):
            keys = [keys]
        self._digests = [_digest(k) for k in (keys or ()) if k]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def accepts(self, authorization: str | bytes | None) -> bool:
        """True when no key is configured, or the header carries one of the keys."""
        if not self._digests:
            return True
        token = bearer_token(authorization)
        given = _digest(token if token is not None else "")
        matched = False
        for digest in self._digests:  # every key compared: the time does not say which one matched
            matched |= hmac.compare_digest(given, digest)
        return matched and token is not None


    def client_of(self, authorization: str | bytes | None) -> str:
        """Who a request comes from, for what the server keeps per client: the digest of its key where keys are
        configured (a request that reaches a handler carries one of them), else "" (one client: nothing tells
        clients apart)."""
        if not self._digests:
            return ""
        token = bearer_token(authorization)
        return _digest(token).hex() if token is not None else ""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class ApiKeyGuard:
    """Pure ASGI middleware: requests to any path outside ``public_paths`` without a configured key get 401
    with ``unauthorized_body`` (the server's own error envelope) and ``WWW-Authenticate: Bearer``."""

    def __init__(self, app: Any, keys: ApiKeys, unauthorized_body: bytes,
                 public_paths: frozenset[str] = PUBLIC_PATHS) -> None:
        self.app = app
        self.keys = keys
        self.public_paths = public_paths
        self.body = unauthorized_body

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.keys and scope.get("path") not in self.public_paths:
            authorization = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
            if not self.keys.accepts(authorization):
                await send({"type": "http.response.start", "status": 401, "headers": [
                    (b"content-type", b"application/json"), (b"www-authenticate", b'Bearer realm="splitserve"'),
                    (b"content-length", str(len(self.body)).encode())]})
                await send({"type": "http.response.body", "body": self.body, "more_body": False})
                return
            scope[AUTHENTICATED_SCOPE_KEY] = True
        await self.app(scope, receive, send)


def is_loopback(host: str) -> bool:
    """True when binding ``host`` keeps the server reachable from this machine only."""
    host = host.strip().strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "", a host name: may be any interface
        return False


def warn_if_open(server: str, host: str, keys: ApiKeys, logger: logging.Logger, hint: str = "--api-key") -> bool:
    """One WARNING line when ``server`` listens beyond loopback and takes no key; True when it warned."""
    if keys or is_loopback(host):
        return False
    logger.warning("SECURITY: %s listens on %s without an API key: anyone who can reach the port may call it. "
                   "Set %s (or bind --host 127.0.0.1) unless a network policy keeps other callers out.",
                   server, host or "all interfaces", hint)
    return True
