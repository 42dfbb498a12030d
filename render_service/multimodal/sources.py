"""Where an image part's bytes come from, for the three APIs' shapes: OpenAI chat ``image_url``, Responses
``input_image`` and Anthropic Messages ``image`` blocks (base64 or url sources). A data: URL is decoded after
its length is checked; an http(s) URL is fetched only for a domain the operator allows, only from a public
address (checked again at connect time), without redirects, within a byte and a time budget."""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import socket
import ssl
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

import httpcore
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


def _proved_b64decode() -> Callable[[str], bytes]:
    """pybase64's SIMD decoder (about 7x the standard library's on a 1080p JPEG's 0.7 MB of base64), strict
    (``validate``), used only where it gives the standard library's bytes and refuses what it refuses on a
    sample; else the standard library's."""
    def stdlib(text: str) -> bytes:
        return base64.b64decode(text, validate=True)

    try:
        import pybase64
    except ImportError:
        return stdlib

    def fast(text: str) -> bytes:
        return pybase64.b64decode(text, validate=True)

    sample = base64.b64encode(bytes(range(256)) * 3).decode()
    good = [sample[:n] for n in (0, 4, 8, 12, 340, len(sample))] + ["YQ==", "YWI=", "YWJj"]
    bad = ["abc", "ab=c", "a b=", "YQ==\n", "YQ=", "Y===", "====", "YWJj\x00", "Y Q==", "YWJj*", "é"]
    for text in good:
        if fast(text) != stdlib(text):
            return stdlib
    for text in bad:
        for decoder in (fast, stdlib):
            try:
                decoder(text)
            except (binascii.Error, ValueError):
                continue
            return stdlib
    return fast


_b64decode = _proved_b64decode()


def _b64(text: str, where: str, bounds: ImageBounds) -> bytes:
    check_encoded_size(len(text) * 3 // 4, bounds, where)  # before decoding a byte
    try:
        return _b64decode(text)
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


async def _public_addresses(host: str, port: int, where: str) -> list[str]:
    """``host``'s addresses, or a 400 when it does not resolve or any address is not public."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise ImageError(f"{where}: the image host {host!r} does not resolve") from None
    addresses = [str(info[4][0]) for info in infos]
    if not addresses or not all(_public(address) for address in addresses):
        raise ImageError(f"{where}: the image host {host!r} resolves to a loopback, private or link-local address")
    return addresses


class _PublicOnly(httpcore.AsyncNetworkBackend):
    """Connects only to the public address it just vetted: a name that re-resolves to a private address between
    the check and the connect (DNS rebinding) is never reached."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.inner = httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        addresses = await _public_addresses(host, port, self.where)
        return await self.inner.connect_tcp(addresses[0], port, timeout, local_address, socket_options)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        raise ImageError(f"{self.where}: image URLs are fetched over TCP only")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


async def fetch(ref: ImageRef, policy: FetchPolicy, bounds: ImageBounds) -> bytes:
    """The bytes behind an http(s) image URL, or a 400 saying why not."""
    assert ref.url is not None
    where, parts = ref.where, urlsplit(ref.url)
    host = parts.hostname or ""
    if not policy.allowed_domains or not _domain_allowed(host, policy.allowed_domains):
        raise ImageError(f"{where}: fetching images from {host!r} is not allowed (--allowed-media-domains)")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ImageError(f"{where}: the image URL has an invalid port") from None
    await _public_addresses(host, port, where)  # a clear refusal before any connection is attempted
    timeouts = {"connect": policy.timeout_s, "read": policy.timeout_s, "write": policy.timeout_s,
                "pool": policy.timeout_s}
    try:
        async with httpcore.AsyncConnectionPool(ssl_context=ssl.create_default_context(), max_connections=1,
                                                network_backend=_PublicOnly(where)) as pool:
            async with asyncio.timeout(policy.timeout_s), pool.stream(
                    "GET", ref.url, extensions={"timeout": timeouts}) as response:  # no redirects are followed
                if response.status != 200:
                    raise ImageError(f"{where}: fetching the image answered HTTP {response.status}")
                declared = next((v for k, v in response.headers if k.lower() == b"content-length"), None)
                if declared and declared.isdigit():
                    check_encoded_size(int(declared), bounds, where)
                body = bytearray()
                async for chunk in response.aiter_stream():
                    body += chunk
                    check_encoded_size(len(body), bounds, where)
                return bytes(body)
    except (httpcore.TimeoutException, TimeoutError):
        raise ImageError(f"{where}: fetching the image took longer than {policy.timeout_s}s") from None
    except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol, OSError) as exc:
        raise ImageError(f"{where}: fetching the image failed: {type(exc).__name__}") from None
