"""Which producer peers a decode engine may contact: the guard against SSRF through kv_transfer_params.

`remote_host`/`remote_port` come from the caller, so without a guard decode connects wherever it is told.
Only peers on the allowlist (`--kv-allowed-peers`, `SPLITSERVE_KV_ALLOWED_PEERS`, or
kv_connector_extra_config.kv_allowed_peers) are contacted: entries are CIDRs, IP addresses or host names,
and the default is loopback only (deny by default: a P/D pair on other hosts lists its prefill network).
A host name is resolved once and the address actually connected to is the one checked, so a name cannot
point somewhere else between the check and the connect; a listed host name is trusted as the operator's.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable

DEFAULT_ALLOWED_PEERS = ("127.0.0.0/8", "::1/128")
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")


class PeerNotAllowed(Exception):
    """The named peer is not on the allowlist: decode never connects to it."""


class AllowedPeers:
    def __init__(self, entries: Iterable[str] = DEFAULT_ALLOWED_PEERS):
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        self.hostnames: set[str] = set()
        for raw in entries:
            entry = raw.strip()
            if not entry:
                continue
            try:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError as e:
                if not _HOSTNAME.fullmatch(entry) or len(entry) > 253:
                    raise ValueError(f"kv allowed peer {entry!r} is neither a CIDR, an address nor a host name") from e
                self.hostnames.add(entry.lower().rstrip("."))
        if not self.networks and not self.hostnames:
            raise ValueError("the KV peer allowlist is empty")

    def address_allowed(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address.split("%", 1)[0])
        except ValueError:
            return False
        if ip.version == 6 and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip in net for net in self.networks)

    def resolve(self, host: str, port: int) -> tuple[int, tuple]:
        """(address family, socket address) to connect to for an allowed peer; PeerNotAllowed otherwise.
        Blocking (DNS): call it off the engine loop."""
        if not isinstance(host, str) or not host or len(host) > 253:
            raise PeerNotAllowed("remote_host is not an allowed KV peer")
        listed = host.lower().rstrip(".") in self.hostnames
        try:
            ipaddress.ip_address(host)
            literal = True
        except ValueError:
            literal = False
        if literal and not self.address_allowed(host):
            raise PeerNotAllowed("remote_host is not an allowed KV peer")
        if not literal and not listed and not self.networks:
            raise PeerNotAllowed("remote_host is not an allowed KV peer")
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as e:
            raise OSError(f"cannot resolve {host!r}: {e}") from e
        for family, _, _, _, sockaddr in infos:
            if listed or self.address_allowed(str(sockaddr[0])):
                return family, sockaddr
        raise PeerNotAllowed("remote_host is not an allowed KV peer")

    def __repr__(self) -> str:
        return ",".join([str(n) for n in self.networks] + sorted(self.hostnames))
