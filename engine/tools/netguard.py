"""Which network addresses a tool may reach, and name resolution that is checked once and then used.

``http_get`` runs without approval, so it must not become a way into Kazma's
own machine or network (cloud metadata, the approvals console on 127.0.0.1,
internal services). Two rules make that hold:

* the address policy (:func:`is_public_address`) accepts only globally
  routable unicast addresses, also when a private IPv4 address hides inside
  an IPv6 form (IPv4-mapped, IPv4-compatible, 6to4, NAT64, Teredo);
* a host name is resolved once per request (:func:`resolve_checked`), every
  answer is checked, and the caller connects to one of those checked
  addresses. Letting the HTTP client resolve the name again would let a DNS
  server answer a public address to the check and 127.0.0.1 to the connect
  (DNS rebinding).

A public address can still be this very machine's (a server's address on its
own interface): a connection to it reaches every service listening on all
interfaces, the console included. :func:`host_networks` reads the addresses
the kernel holds as local (``/proc/net/fib_trie`` for IPv4 — assigned
addresses and local routes, secondary ones included — and
``/proc/net/if_inet6`` for IPv6), and the policy refuses them whatever else
would let them through.

This module holds no HTTP code: it decides about addresses only.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

import structlog

__all__ = [
    "AddressPolicy",
    "AddressRefused",
    "IPAddress",
    "IPNetwork",
    "Resolver",
    "embedded_ipv4",
    "host_networks",
    "is_ip_literal",
    "is_public_address",
    "resolve_checked",
    "system_resolver",
]

log = structlog.get_logger("kazma.engine.netguard")

IPAddress: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork: TypeAlias = ipaddress.IPv4Network | ipaddress.IPv6Network

Resolver: TypeAlias = Callable[[str], Awaitable[Sequence[str]]]
"""Resolves a host name to address strings; raises :class:`OSError` when it cannot."""


def _networks(*cidrs: str) -> tuple[IPNetwork, ...]:
    return tuple(ipaddress.ip_network(cidr) for cidr in cidrs)


# Listed explicitly, on top of ``is_global``: Python's own tables differ between
# patch releases (3.11.7 calls multicast, 64:ff9b:1::/48, fec0::/10 and
# ::127.0.0.1 "global"), and this decision must not depend on which one runs.
_V4_NOT_PUBLIC = _networks(
    "0.0.0.0/8",  # "this network", including the unspecified address
    "10.0.0.0/8",
    "100.64.0.0/10",  # carrier-grade NAT: the provider's internal network
    "127.0.0.0/8",
    "169.254.0.0/16",  # link-local, where cloud metadata services live
    "172.16.0.0/12",
    "192.0.0.0/24",  # IETF protocol assignments
    "192.0.2.0/24",
    "192.88.99.0/24",  # deprecated 6to4 relay anycast
    "192.168.0.0/16",
    "198.18.0.0/15",
    "198.51.100.0/24",
    "203.0.113.0/24",
    "224.0.0.0/4",  # multicast
    "240.0.0.0/4",  # reserved, and the broadcast address
)

_V6_NOT_PUBLIC = _networks(
    "::/96",  # unspecified, loopback and the deprecated IPv4-compatible form
    "64:ff9b:1::/48",  # local-use NAT64 (RFC 8215): a translator inside some network
    "100::/64",  # discard-only
    "2001::/23",  # IETF protocol assignments, Teredo among them
    "2001:db8::/32",
    "3fff::/20",  # documentation
    "5f00::/16",  # segment routing identifiers
    "fc00::/7",  # unique local
    "fe80::/10",  # link-local
    "fec0::/10",  # deprecated site-local
    "ff00::/8",  # multicast
)

_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")
# Where a public IPv6 address can be at all: global unicast (RFC 4291 2000::/3), or the well-known NAT64 prefix (a
# public IPv4 address behind the translator, checked by what it carries). Everything else is reserved or unassigned
# (::ffff:0:0/96, the IPv4-translated form of RFC 2765, among them: Python calls ::ffff:0:7f00:1 global).
_MAY_BE_PUBLIC_V6 = _networks("2000::/3", "64:ff9b::/96")
_NAT64 = _networks("64:ff9b::/96", "64:ff9b:1::/48")


def embedded_ipv4(address: ipaddress.IPv6Address) -> tuple[ipaddress.IPv4Address, ...]:
    """The IPv4 addresses an IPv6 address carries and may be translated to on the way (none for most).

    IPv4-mapped and IPv4-compatible addresses and NAT64 (RFC 6052, /96 layout)
    hold one in the low 32 bits, 6to4 in bits 16–47, Teredo holds its server
    and (obfuscated) client address.
    """
    found: list[ipaddress.IPv4Address] = []
    if address.ipv4_mapped is not None:
        found.append(address.ipv4_mapped)
    low32 = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address in _IPV4_COMPATIBLE or any(address in prefix for prefix in _NAT64):
        found.append(low32)
    if address.sixtofour is not None:
        found.append(address.sixtofour)
    if address.teredo is not None:
        found.extend(address.teredo)
    return tuple(found)


def _public_v4(address: ipaddress.IPv4Address) -> bool:
    return (
        address.is_global
        and not address.is_multicast
        and not address.is_unspecified
        and not any(address in network for network in _V4_NOT_PUBLIC)
    )


def is_public_address(address: IPAddress) -> bool:
    """Whether ``address`` is a globally routable unicast address, by its own bits and any IPv4 inside it."""
    if isinstance(address, ipaddress.IPv4Address):
        return _public_v4(address)
    if address.ipv4_mapped is not None:
        # ::ffff:a.b.c.d is an IPv4 address spelled for an IPv6 socket: it is exactly as public as a.b.c.d.
        return _public_v4(address.ipv4_mapped)
    if not all(_public_v4(inner) for inner in embedded_ipv4(address)):
        return False
    if not any(address in network for network in _MAY_BE_PUBLIC_V6):
        return False
    return (
        address.is_global
        and not address.is_multicast
        and not address.is_unspecified
        and not address.is_site_local
        and not any(address in network for network in _V6_NOT_PUBLIC)
    )


# --------------------------------------------------------------------------- this host's own addresses

_HOST_TTL_S = 5.0  # addresses change rarely; a routing table can be large (a router's), so it is not read per call
_host_cache: tuple[float, tuple[IPNetwork, ...]] | None = None


def _fib_local(text: str) -> list[IPNetwork]:
    """The LOCAL entries of ``/proc/net/fib_trie``: a ``|-- <address>`` line, then ``/<len> <scope> LOCAL``."""
    found: list[IPNetwork] = []
    last: str | None = None
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "|--":
            last = words[1]
        elif last is not None and len(words) >= 3 and words[0].startswith("/") and words[2] == "LOCAL":
            with contextlib.suppress(ValueError):
                found.append(ipaddress.ip_network(f"{last}{words[0]}", strict=False))
    return found


def _if_inet6(text: str) -> list[IPNetwork]:
    """Every IPv6 address of ``/proc/net/if_inet6`` (32 hex digits first on each line)."""
    found: list[IPNetwork] = []
    for line in text.splitlines():
        words = line.split()
        if words and len(words[0]) == 32:
            with contextlib.suppress(ValueError):
                found.append(ipaddress.IPv6Network((int(words[0], 16), 128)))
    return found


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


def _read_host_networks() -> tuple[IPNetwork, ...]:
    v4, v6 = _read("/proc/net/fib_trie"), _read("/proc/net/if_inet6")
    found = (_fib_local(v4) if v4 else []) + (_if_inet6(v6) if v6 else [])
    if v4 is None and v6 is None:  # not Linux: what the host's own name resolves to is the best there is
        with contextlib.suppress(OSError):
            for info in socket.getaddrinfo(socket.gethostname(), None):
                with contextlib.suppress(ValueError):
                    found.append(ipaddress.ip_network(str(info[4][0]).split("%", 1)[0]))
    # Loopback is never public and only a deliberate widening (a test's) reaches it: left to the policy.
    return tuple(dict.fromkeys(network for network in found if not network.is_loopback))


def host_networks() -> tuple[IPNetwork, ...]:
    """The addresses (and local routes) this host answers for on its own, loopback left out; read at most every
    few seconds."""
    global _host_cache
    now = time.monotonic()
    if _host_cache is None or now - _host_cache[0] > _HOST_TTL_S:
        _host_cache = (now, _read_host_networks())
    return _host_cache[1]


@dataclass(frozen=True)
class AddressPolicy:
    """Public addresses that are not this host's own, plus what an operator (or a test) lets through on purpose.

    ``allow_private`` lets everything through; ``also_allow`` lets through only
    the listed networks, never this host's own addresses (``host``: where they
    are read from).
    """

    allow_private: bool = False
    also_allow: tuple[IPNetwork, ...] = ()
    host: Callable[[], Sequence[IPNetwork]] = field(default=host_networks, compare=False)

    @classmethod
    def of(cls, *, allow_private: bool = False, also_allow: Iterable[IPNetwork | str] = ()) -> AddressPolicy:
        return cls(allow_private, tuple(ipaddress.ip_network(network) for network in also_allow))

    def is_own(self, address: IPAddress) -> bool:
        """Whether ``address``, or an IPv4 address it carries, is one this host answers for itself."""
        inner: tuple[IPAddress, ...] = embedded_ipv4(address) if isinstance(address, ipaddress.IPv6Address) else ()
        own = self.host()
        return any(candidate in network for candidate in (address, *inner) for network in own)

    def allows(self, address: IPAddress) -> bool:
        if self.allow_private:
            return True
        if self.is_own(address):
            return False
        if is_public_address(address):
            return True
        # ip_network membership is False (not an error) across IP versions.
        return any(address in network for network in self.also_allow)


class AddressRefused(Exception):
    """A host that will not be contacted: it does not resolve, or an address it names is not allowed.

    The message is meant for the model and names the host and the reason.
    """


async def system_resolver(host: str) -> list[str]:
    """The operating system's answer for ``host`` (``getaddrinfo`` on the running loop)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def _literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def is_ip_literal(host: str) -> bool:
    """Whether ``host`` is an IP address written out (as in ``http://10.0.0.1/``) rather than a name."""
    return _literal(host) is not None


def _parse_answer(host: str, raw: str) -> IPAddress:
    # A scope ("%eth0") only matters for link-local addresses, which the policy
    # refuses anyway; without it the address can be written into a URL.
    address = _literal(raw.split("%", 1)[0])
    if address is None:
        raise AddressRefused(f"could not resolve {host}: the resolver answered {raw!r}, which is not an IP address")
    return address


async def resolve_checked(host: str, *, resolver: Resolver, policy: AddressPolicy) -> tuple[IPAddress, ...]:
    """Resolve ``host`` once and return its addresses, each one allowed by ``policy``.

    An IP literal is checked as it is, without asking the resolver. Raises
    :class:`AddressRefused` when the name does not resolve, resolves to
    nothing, or when *any* of its addresses is not allowed: a name that also
    points inside the network is refused whole rather than trimmed, so the
    answer cannot depend on which address a client would have picked.
    """
    literal = _literal(host)
    if literal is not None:
        addresses: tuple[IPAddress, ...] = (literal,)
    else:
        try:
            answers = await resolver(host)
        except OSError as exc:
            log.info("netguard.unresolved", host=host, reason=str(exc))
            raise AddressRefused(f"could not resolve {host}: {exc}") from exc
        except UnicodeError as exc:
            # getaddrinfo encodes the name with the idna codec first, which refuses an empty label or one over 63
            # characters ("a..b", from a model or a redirect) before any lookup: a bad name, not a crash.
            log.info("netguard.unresolved", host=host, reason=str(exc))
            raise AddressRefused(f"could not resolve {host}: it is not a valid host name ({exc})") from exc
        addresses = tuple(dict.fromkeys(_parse_answer(host, raw) for raw in answers))
        if not addresses:
            log.info("netguard.unresolved", host=host, reason="no addresses")
            raise AddressRefused(f"could not resolve {host}: the resolver returned no addresses")
    for address in addresses:
        if not policy.allows(address):
            own = policy.is_own(address)
            log.info("netguard.refused", host=host, address=str(address), own=own)
            what = f"{host} is {address}, an address" if literal is None else f"{address} is an address"
            where = "of this machine itself" if own else "inside this machine or its network"
            raise AddressRefused(f"refused to contact {host}: {what} {where} (http_get reaches public addresses only)")
    return addresses
