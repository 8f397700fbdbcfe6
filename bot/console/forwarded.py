"""Who is on the other end of a request, when a reverse proxy stands between them and Kazma.

The socket's peer is the client — unless that peer is one of ``web.trusted_proxies``. Then the proxy's
``X-Forwarded-For`` (or, when it sends none, RFC 7239 ``Forwarded: for=…``) is read from the right: each
hop that is itself a trusted proxy is skipped, and the first one that is not is the client. Entries further
left were written by the client (or by proxies nobody vouches for) and are never believed, so a client
cannot choose its own address by sending the header itself. From a peer that is not a trusted proxy the
headers are ignored altogether.

The login throttle keys on the client this gives, with IPv6 clients grouped by their /64 (one host usually
holds a whole /64, so its addresses are one client).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address, ip_network

from aiohttp import web

Address = IPv4Address | IPv6Address
Network = IPv4Network | IPv6Network

_FORWARDED_FOR = re.compile(r'(?:^|[;,\s])for\s*=\s*("(?:[^"\\]|\\.)*"|[^;,\s]*)', re.IGNORECASE)
_MAX_HOPS = 32  # a longer chain is cut to its last hops: the right end is the one that counts
_MAX_TOKEN = 64  # an obfuscated identifier (RFC 7239 "_hidden", "unknown") kept as a key, bounded


def parse_networks(values: Iterable[str]) -> tuple[Network, ...]:
    """``10.0.0.5``, ``10.0.0.0/8``, ``::1``, ``fd00::/8`` as networks (host bits allowed); ValueError otherwise."""
    return tuple(ip_network(value.strip(), strict=False) for value in values)


def parse_address(text: str) -> Address | None:
    """An address as proxies write it: ``192.0.2.1``, ``192.0.2.1:4711``, ``2001:db8::1``,
    ``[2001:db8::1]:4711``, possibly quoted; None when it is not an address."""
    value = text.strip().strip('"').strip()
    if value.startswith("["):
        value = value[1:].partition("]")[0]
    elif value.count(":") == 1:  # IPv4 with a port (a bare IPv6 address has at least two colons)
        value = value.partition(":")[0]
    try:
        found = ip_address(value)
    except ValueError:
        return None
    if isinstance(found, IPv6Address) and found.ipv4_mapped is not None:
        return found.ipv4_mapped  # a dual-stack socket shows IPv4 peers as ::ffff:a.b.c.d
    return found


def _hops(request: web.BaseRequest) -> list[str]:
    """The forwarded-for chain, left (the far end) to right (the hop nearest Kazma)."""
    forwarded_for = request.headers.getall("X-Forwarded-For", [])
    if forwarded_for:
        hops = [hop.strip() for value in forwarded_for for hop in value.split(",")]
    else:
        hops = [m.group(1) for value in request.headers.getall("Forwarded", []) for m in _FORWARDED_FOR.finditer(value)]
    return [hop for hop in hops if hop][-_MAX_HOPS:]


@dataclass(frozen=True)
class Client:
    address: str  # the client as Kazma believes it: an IP address, or a proxy's opaque token for it
    peer: str  # the socket's peer (the nearest proxy, or the client itself)

    @property
    def throttle_key(self) -> str:
        found = parse_address(self.address)
        if isinstance(found, IPv6Address):
            return str(IPv6Network((found, 64), strict=False))
        return str(found) if found is not None else f"token:{self.address}"


class ClientAddresses:
    def __init__(self, trusted_proxies: Sequence[str] = ()) -> None:
        self.trusted = parse_networks(trusted_proxies)

    def is_trusted(self, address: Address | None) -> bool:
        return address is not None and any(address in network for network in self.trusted)

    def of(self, request: web.BaseRequest) -> Client:
        peer_text = request.remote or "unknown"
        peer = parse_address(peer_text)
        if not self.is_trusted(peer):
            return Client(str(peer) if peer is not None else peer_text, peer_text)
        hops = _hops(request)
        for hop in reversed(hops):
            address = parse_address(hop)
            if self.is_trusted(address):
                continue
            # the first hop no trusted proxy is: written by the trusted proxy nearest it, so believed
            return Client(str(address) if address is not None else hop.strip('"')[:_MAX_TOKEN], peer_text)
        if hops:  # every hop is a trusted proxy: the far end of the chain is the client
            far = parse_address(hops[0])
            return Client(str(far) if far is not None else hops[0][:_MAX_TOKEN], peer_text)
        return Client(str(peer), peer_text)  # a trusted proxy asking for itself (a health check)
