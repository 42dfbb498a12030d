"""Who a request is for: the tenant, the unit every per-client budget and every stored response belongs to.

The gateway decides the tenant and vouches for it; nothing a client writes about itself is believed:

- with client API keys (``--api-key``), the tenant is a keyed digest of the key the client presented (so two
  keys are two tenants, and neither the key nor a reversible form of it leaves the gateway);
- with ``--tenant-header NAME`` as well (an authenticated proxy in front names its own clients), the value of
  that header, digested the same way, when the caller presented a valid key; callers without that header fall
  back to their key's tenant;
- without keys the server is open and the tenant is the client's address.

The gateway sends the tenant to engines in ``TENANT_HEADER`` on every hop. An engine believes the header only
from a caller that authenticated with the engine's own key (``ApiKeyGuard`` marks the request); from anyone
else, or without it, the caller is its TCP peer, as before.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

from splitserve_common.auth import AUTHENTICATED_SCOPE_KEY, ApiKeys, bearer_token

TENANT_HEADER = "x-splitserve-tenant"
# A tenant is digest text: short, header-safe, never client bytes.
_TENANT_TEXT = re.compile(r"[A-Za-z0-9._:-]{1,64}")
# Domain separation for the digest; the key's own entropy is what keeps it unguessable.
_DIGEST_KEY = b"splitserve-tenant-v1"


def _digest(kind: str, value: str) -> str:
    mac = hashlib.blake2b(value.encode("utf-8", "surrogateescape"), key=_DIGEST_KEY, digest_size=16,
                          person=kind.encode()[:16])
    return f"{kind}-{mac.hexdigest()}"


class TenantResolver:
    """The gateway's rule (module docstring): ``tenant(headers, peer)`` after the request's key was checked."""

    def __init__(self, keys: ApiKeys, tenant_header: str | None = None) -> None:
        if tenant_header and not keys:
            raise ValueError("--tenant-header needs --api-key: a tenant header is believed only from a caller "
                             "that authenticated")
        self.keys = keys
        self.tenant_header = tenant_header.lower() if tenant_header else None

    def tenant(self, headers: Mapping[str, str], peer: str | None) -> str:
        if not self.keys:
            return f"addr-{peer or 'unknown'}"
        if self.tenant_header:
            named = headers.get(self.tenant_header)
            if named:
                return _digest("hdr", named)
        return _digest("key", bearer_token(headers.get("authorization")) or "")


def engine_caller(scope: Mapping[str, Any], headers: Mapping[str, str], peer: str | None) -> str:
    """Who an engine request is charged to: the gateway's tenant when an authenticated caller names one,
    else the TCP peer's address."""
    if scope.get(AUTHENTICATED_SCOPE_KEY):
        named = headers.get(TENANT_HEADER)
        if named and _TENANT_TEXT.fullmatch(named):
            return "tenant:" + named
    return peer or "unknown"
