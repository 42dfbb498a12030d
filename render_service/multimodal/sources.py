"""Where an image part's bytes come from, for the three APIs' shapes: OpenAI chat ``image_url``, Responses
``input_image`` and Anthropic Messages ``image`` blocks (base64 or url sources). A data: URL is decoded after
its length is checked; an http(s) URL is fetched only for a domain the operator allows, only from a public
address, without redirects, within a byte and a time budget."""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import socket
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgspec

from render_service.multimodal.bounds import ImageBounds, ImageError, check_encoded_size


class ImageRef(msgspec.Struct, frozen=True):
    """One image part: inline bytes (``data``) or a URL still to fetch, and where it sat in the request."""

    where: str
    data: bytes | None = None
    url: str | None = None


class FetchPolicy(msgspec.Struct, frozen=True):
    allowed_domains: tuple[str, ...] = ()  # exact hosts or their subdomains; empty: no URL is fetched
    timeout_s: float = 10.0


def image_ref(part: Mapping[str, Any], where: str, bounds: ImageBounds) -> ImageRef | None:
    """The image a content part carries, or None when the part is not an image part."""
    kind = part.get("type")
    if kind == "image_url" or kind == "input_image":
        value = part.get("image_url")
        if isinstance(value, Mapping):
            value = value.get("url")
        if not isinstance(value, str) or not value:
            if kind == "input_image" and part.get("file_id") is not None:
                raise ImageError(f"{where}: input_image by file_id is not supported; send image_url")
            raise ImageError(f"{where}: {kind} needs a URL string (image_url)")
        return url_ref(value, where, bounds)
    if kind == "image":  # Anthropic Messages
        source = part.get("source")
        if not isinstance(source, Mapping):
            raise ImageError(f"{where}: an image block needs a source object")
        if source.get("type") == "base64" and isinstance(source.get("data"), str):
            return ImageRef(where, data=_b64(source["data"], where, bounds))
        if source.get("type") == "url" and isinstance(source.get("url"), str):
            return url_ref(source["url"], where, bounds)
        raise ImageError(f"{where}: an image source must be {{type: base64, data}} or {{type: url, url}}")
    return None


def url_ref(url: str, where: str, bounds: ImageBounds) -> ImageRef:
    if url.startswith("data:"):
        header, comma, payload = url.partition(",")
        if not comma or not header.endswith(";base64"):
            raise ImageError(f"{where}: a data URL must be data:<type>;base64,<data>")
        return ImageRef(where, data=_b64(payload, where, bounds))
    scheme = urlsplit(url).scheme.lower()
    if scheme not in ("http", "https"):
        raise ImageError(f"{where}: image URLs must be data:, http: or https: (got {scheme or 'none'!r})")
    return ImageRef(where, url=url)


def _b64(text: str, where: str, bounds: ImageBounds) -> bytes:
    check_encoded_size(len(text) * 3 // 4, bounds, where)  # before decoding a byte
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{where}: the image data is not valid base64") from None


def _domain_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    host = host.lower().rstrip(".")
    return any(host == d or host.endswith("." + d) for d in (a.lower().rstrip(".") for a in allowed))


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not (ip.is_loopback or ip.is_private or ip.is_link_local or ip.is_multicast or ip.is_reserved
                or ip.is_unspecified or not ip.is_global)


async def fetch(ref: ImageRef, policy: FetchPolicy, bounds: ImageBounds) -> bytes:
    """The bytes behind an http(s) image URL, or a 400 saying why not."""
    assert ref.url is not None
    where, parts = ref.where, urlsplit(ref.url)
    host = parts.hostname or ""
    if not policy.allowed_domains or not _domain_allowed(host, policy.allowed_domains):
        raise ImageError(f"{where}: fetching images from {host!r} is not allowed (--allowed-media-domains)")
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, parts.port or (443 if parts.scheme == "https"
                                                                                    else 80), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise ImageError(f"{where}: the image host {host!r} does not resolve") from None
    if not infos or not all(_public(str(info[4][0])) for info in infos):
        raise ImageError(f"{where}: the image host {host!r} resolves to a loopback, private or link-local address")
    try:
        async with httpx.AsyncClient(timeout=policy.timeout_s, follow_redirects=False, trust_env=False) as client:
            async with asyncio.timeout(policy.timeout_s), client.stream("GET", ref.url) as response:
                if response.status_code != 200:
                    raise ImageError(f"{where}: fetching the image answered HTTP {response.status_code}")
                declared = response.headers.get("content-length")
                if declared and declared.isdigit():
                    check_encoded_size(int(declared), bounds, where)
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    check_encoded_size(len(body), bounds, where)
                return bytes(body)
    except (httpx.HTTPError, TimeoutError, OSError) as exc:
        raise ImageError(f"{where}: fetching the image failed: {type(exc).__name__}") from None
