"""Which names the console answers to: a request whose ``Host`` is not one of ours is refused (421).

A page at ``http://evil.example:8765`` whose name its owner re-points at 127.0.0.1 (DNS rebinding) is, to
the browser, the same origin as everything it then fetches: the console sees ``Host: evil.example:8765`` and
``Origin: http://evil.example:8765``, equal, and without this check would serve that page ``/metrics``,
``/healthz``, the sign-in ceremonies and every form's same-origin test. Cookies are not the defence (the
page has none of ours, but the anonymous routes need none). So the console answers only to:

- the host of ``web.public_url`` (the passkeys' relying party, the name every card links to);
- ``web.host`` when it is a name, and each name in ``web.allowed_hosts`` (a service name in a compose
  network a scraper uses, a second name at the proxy);
- ``localhost``, which browsers resolve to this machine themselves, never through DNS;
- any IP address: a page can only be rebound to us through a name, and a page served from an address is
  served by whoever holds that address (``kazma demo`` and the tests reach the console at 127.0.0.1:port).

Ports are not compared: a proxy may send ``Host`` with or without the public port, and a rebinding page
must use the console's own port anyway. A request with no ``Host`` at all (HTTP/1.0) comes from no browser.

The door (:mod:`~kazma.bot.console.doors`) checks it on every route but the approvals API and ``/mcp``: those
need an API token in ``Authorization``, which a rebound page cannot send (the cross-origin header needs a
preflight the door never answers), and their clients may reach Kazma by an internal name.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable

import structlog
from aiohttp import web
from yarl import URL

log = structlog.get_logger("kazma.web")

LOOPBACK_NAMES = frozenset({"localhost"})
_MAX_LOGGED = 200  # a Host header is the client's words: logged bounded
# Paths whose next segment is a secret: an enrolment link's token (it enrols a passkey as its person) and kazma
# demo's one-time sign-in. A refusal logged with the whole path put a still usable link in the log.
_SECRET_SEGMENT = re.compile(r"^(/enrol/|/login/local/)[^/]+")


def logged_path(path: str) -> str:
    """``path`` as a log may keep it: a secret segment replaced by ``…``, the whole bounded."""
    return _SECRET_SEGMENT.sub(r"\1…", path)[:_MAX_LOGGED]


def host_name(value: str) -> str | None:
    """The name (or address) a ``Host`` header or a configured host gives, lower case, without the port or a
    final dot; None when it is no host at all."""
    try:
        found = URL.build(scheme="http", authority=value.strip()).host
    except (ValueError, TypeError):
        return None
    if not found:
        return None
    return found.lower().rstrip(".") or None


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class Hosts:
    """The names the console answers to, and the middleware that refuses the rest."""

    def __init__(self, public_url: str, *, bind: str = "", allowed: Iterable[str] = ()) -> None:
        self.public = (URL(public_url).host or "").lower().rstrip(".")
        names = {self.public, *LOOPBACK_NAMES}
        for value in (bind, *allowed):
            name = host_name(value) if value else None
            if name is not None and not _is_address(name):
                names.add(name)
        names.discard("")
        self.names = frozenset(names)

    def ours(self, host: str | None) -> bool:
        """Whether a request with this ``Host`` header (None: it sent none) is for this console."""
        if host is None:
            return True
        name = host_name(host)
        return name is not None and (name in self.names or _is_address(name))

    def check(self, request: web.Request) -> None:
        """Raise 421 unless the request's ``Host`` is one of ours."""
        host = request.headers.get("Host")
        if self.ours(host):
            return
        said = (host or "")[:_MAX_LOGGED]
        log.warning("web.host_refused", host=said, path=logged_path(request.path), expected=sorted(self.names))
        raise web.HTTPMisdirectedRequest(
            text=(
                f"This Kazma console does not answer to the name {said!r}. It is served as {self.public} "
                "(web.public_url), localhost or an IP address; open it at one of those, or list the name in "
                "web.allowed_hosts.\n"
            ),
            content_type="text/plain",
        )
