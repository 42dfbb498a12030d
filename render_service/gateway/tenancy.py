"""The tenant of a gateway request (``splitserve_common/tenants.py``): whom its stored responses belong to and
whom the engines charge for it. Decided after the request's key was checked; the resolver is built once per app
from the server's keys and the gateway's ``--tenant-header``."""

from __future__ import annotations

from starlette.requests import Request

from render_service.gateway.flow import Gateway
from splitserve_common.tenants import TenantResolver


def request_tenant(request: Request, gateway: Gateway) -> str:
    """Works on Starlette's request and the server's ``RawRequest`` (its fast routes) alike: scope and headers."""
    state = request.scope["app"].state
    resolver = getattr(state, "tenants", None)
    if resolver is None:
        resolver = state.tenants = TenantResolver(state.server.api_keys, gateway.settings.tenant_header)
    client = request.scope.get("client")
    return resolver.tenant(request.headers, client[0] if client else None)


def short_id(response_id: str) -> str:
    """A stored response's id as logs may show it: enough to correlate, not enough to fetch it."""
    return response_id[:12] + "..." if len(response_id) > 12 else response_id
