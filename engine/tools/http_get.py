"""The ``http_get`` tool: GET from the public internet, every hop resolved once and checked by the address policy."""

from __future__ import annotations

import asyncio
import ssl
import zlib
from collections.abc import Iterable, Sequence

import httpx
from pydantic import Field

from kazma.config.limits import MIB
from kazma.config.models import DangerLevel
from kazma.config.version import kazma_version
from kazma.engine.tools.netguard import (
    AddressPolicy,
    AddressRefused,
    IPAddress,
    IPNetwork,
    Resolver,
    is_ip_literal,
    resolve_checked,
    system_resolver,
)
from kazma.engine.tools.registry import Tool, ToolArgs, ToolResult
from kazma.engine.tools.workspace import ToolContext


class HttpGetArgs(ToolArgs):
    url: str = Field(description="An http:// or https:// URL to fetch with GET.")


_REDIRECT_CODES = frozenset({301, 302, 303, 307, 308})
_ZLIB_ENCODINGS = frozenset({"gzip", "x-gzip", "deflate"})


class _FetchFailed(Exception):
    """A fetch that stopped for a reason the message explains to the model."""


class _Unreachable(_FetchFailed):
    """No checked address of a host accepted a connection."""


class HttpGetTool(Tool[HttpGetArgs]):
    """GET a URL from the public internet, following redirects itself so that every hop is checked.

    For each hop the host is resolved once (``resolver``), every answer must
    pass the address policy (:mod:`kazma.engine.tools.netguard`), and the connection
    goes to one of those checked addresses while the ``Host`` header and TLS
    (SNI and certificate check) still use the name. Proxy variables from the
    environment are ignored: a proxy would resolve and connect on its own.
    ``allow_private`` and ``also_allow`` widen the policy, never the path.
    """

    name = "http_get"
    description = (
        "Fetch a URL with HTTP GET and return the status, the content type and the body as text "
        "(bodies over the size limit are cut)."
    )
    default_level = DangerLevel.READ
    Args = HttpGetArgs

    def __init__(
        self,
        *,
        timeout_s: float = 20.0,
        max_bytes: int = MIB,
        max_redirects: int = 5,
        allow_private: bool = False,
        also_allow: Iterable[IPNetwork | str] = (),
        resolver: Resolver = system_resolver,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.max_redirects = max_redirects
        # A "read" tool runs without approval, so by default it must not become a way
        # into the bus's own network: loopback, private, link-local (cloud metadata) …
        self.policy = AddressPolicy.of(allow_private=allow_private, also_allow=also_allow)
        self.resolver = resolver
        self.ssl_context = ssl_context

    async def run(self, args: HttpGetArgs, ctx: ToolContext) -> ToolResult:
        try:
            url = httpx.URL(args.url)
        except httpx.InvalidURL as exc:
            return ToolResult(ok=False, output="", error=f"invalid URL {args.url!r}: {exc}")
        if not _fetchable(url):
            return ToolResult(
                ok=False, output="", error=f"only http:// and https:// URLs are fetched, not {args.url!r}"
            )
        try:
            # httpx's timeout bounds each read; this bounds the whole fetch, so a
            # server trickling bytes cannot hold the call open.
            async with asyncio.timeout(self.timeout_s):
                return await self._fetch(url)
        except (TimeoutError, httpx.TimeoutException):
            return ToolResult(ok=False, output="", error=f"timed out after {self.timeout_s:g} s fetching {url}")
        except (AddressRefused, _FetchFailed) as exc:
            return ToolResult(ok=False, output="", error=str(exc))
        except httpx.HTTPError as exc:
            return ToolResult(ok=False, output="", error=f"fetching {url} failed: {type(exc).__name__}: {exc}")

    async def _fetch(self, url: httpx.URL) -> ToolResult:
        current = url
        for _ in range(self.max_redirects + 1):
            # raw_host is the ASCII (IDNA) form, the same name TLS is given below.
            host = current.raw_host.decode("ascii")
            addresses = await resolve_checked(host, resolver=self.resolver, policy=self.policy)
            # A client per hop: a pooled connection is never reused for a
            # different name than the one its certificate was checked for.
            async with self._client() as client:
                response = await self._connect(client, current, addresses)
                try:
                    target = _redirect_target(current, response)
                    if target is None:
                        return await self._result(url, current, response)
                finally:
                    await response.aclose()
            current = target
        return ToolResult(ok=False, output="", error=f"more than {self.max_redirects} redirects fetching {url}")

    def _client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            timeout=self.timeout_s,
            follow_redirects=False,  # followed in _fetch, each hop resolved and checked
            trust_env=False,  # no HTTP(S)_PROXY / ALL_PROXY, no .netrc
            verify=self.ssl_context if self.ssl_context is not None else True,
            # Only what _result decodes itself, bounded (httpx would undo any stack of encodings whole: 661 bytes of
            # "gzip, gzip" became 300 MiB in memory before the body's cap was looked at).
            headers={"User-Agent": f"kazma/{kazma_version()}", "Accept-Encoding": "gzip, deflate"},
        )

    async def _connect(
        self, client: httpx.AsyncClient, url: httpx.URL, addresses: Sequence[IPAddress]
    ) -> httpx.Response:
        """Send the GET to the first checked address that accepts a connection."""
        failures: list[str] = []
        for address in addresses:
            request = _pinned_request(client, url, address)
            try:
                return await client.send(request, stream=True)
            except httpx.ConnectError as exc:
                failures.append(f"{address}: {exc or type(exc).__name__}")
            except UnicodeError as exc:
                # httpx reads every redirect's Location (for response.next_request) even when it follows none,
                # decoding its host: a malformed "xn--" label raises idna's error out of send() unwrapped.
                raise _FetchFailed(
                    f"refused to follow a redirect from {url}: its Location names no valid host ({exc})"
                ) from exc
        raise _Unreachable(f"could not connect to {url.raw_host.decode('ascii')}: " + "; ".join(failures))

    async def _result(self, url: httpx.URL, final: httpx.URL, response: httpx.Response) -> ToolResult:
        encodings = [e.strip().lower() for e in response.headers.get("content-encoding", "").split(",")]
        encodings = [e for e in encodings if e not in ("", "identity")]
        if len(encodings) > 1 or (encodings and encodings[0] not in _ZLIB_ENCODINGS):
            return ToolResult(
                ok=False,
                output="",
                error=f"{url} answered with content-encoding {', '.join(encodings)!r}; Kazma decodes at most one "
                "layer of gzip or deflate",
            )
        # Never more than the cap decoded. "deflate" is zlib-wrapped by the standard, raw deflate by some servers:
        # told apart by the first two bytes, as httpx does (decoder made once they are in).
        decoder = zlib.decompressobj(16 + zlib.MAX_WBITS) if encodings and encodings[0] != "deflate" else None
        raw_or_zlib = bool(encodings) and encodings[0] == "deflate"
        head = b""
        body = bytearray()
        truncated = False
        try:
            async for chunk in response.aiter_raw():
                if raw_or_zlib and decoder is None:
                    head += chunk
                    if len(head) < 2:
                        continue
                    decoder = zlib.decompressobj(zlib.MAX_WBITS if _zlib_header(head) else -zlib.MAX_WBITS)
                    chunk, head = head, b""
                if decoder is not None:
                    # At most what is left of the cap (+1: to know it was passed); the rest stays undecoded.
                    chunk = decoder.decompress(decoder.unconsumed_tail + chunk, self.max_bytes + 1 - len(body))
                body += chunk
                if len(body) > self.max_bytes:
                    del body[self.max_bytes :]
                    truncated = True
                    break
            else:
                if raw_or_zlib and decoder is None and head:  # a body of one byte
                    decoder = zlib.decompressobj(-zlib.MAX_WBITS)
                    body += decoder.decompress(head, self.max_bytes + 1)
                if decoder is not None:
                    body += decoder.flush()  # what zlib still holds of input it took (the cap was not reached)
                    if len(body) > self.max_bytes:
                        del body[self.max_bytes :]
                        truncated = True
        except zlib.error as exc:
            return ToolResult(ok=False, output="", error=f"{url}: the {encodings[0]} body could not be decoded ({exc})")
        try:
            text = bytes(body).decode(response.encoding or "utf-8", errors="replace")
        except LookupError:  # a charset Python does not know
            text = bytes(body).decode("utf-8", errors="replace")
        status = f"{response.http_version} {response.status_code} {response.reason_phrase}".rstrip()
        lines = [status, f"content-type: {response.headers.get('content-type', '(none)')}"]
        if final != url:
            lines.append(f"url: {final}")
        output = "\n".join(lines) + "\n\n" + text
        if truncated:
            output += f"\n[… body cut at {self.max_bytes} bytes …]"
        ok = response.is_success
        error = None if ok else f"HTTP {response.status_code} {response.reason_phrase}".rstrip()
        return ToolResult(ok=ok, output=output, error=error, truncated=truncated)


def _zlib_header(head: bytes) -> bool:
    """Whether ``head`` starts a zlib stream (RFC 1950: deflate method, header check a multiple of 31)."""
    return head[0] & 0x0F == 8 and (head[0] << 8 | head[1]) % 31 == 0


def _fetchable(url: httpx.URL) -> bool:
    # raw_host, not host: httpx decodes an "xn--" label for ``host`` and raises on a malformed one ("http://xn--/",
    # from a model or any server's redirect), which ended the call as a crash with a traceback in the log.
    return url.scheme in ("http", "https") and bool(url.raw_host)


def _pinned_request(client: httpx.AsyncClient, url: httpx.URL, address: IPAddress) -> httpx.Request:
    """A GET for ``url`` that connects to ``address`` but still speaks to the name.

    The URL's host becomes the checked address, so nothing resolves the name
    again. ``Host`` is set to what httpx would have sent for the name
    (``url.netloc``), and the ``sni_hostname`` request extension makes httpcore
    pass the name as ``server_hostname`` to TLS, which both sends it as SNI and
    checks the certificate against it (httpcore 1.0.9, ``_async/connection.py``:
    ``"server_hostname": sni_hostname or self._origin.host``).
    """
    if is_ip_literal(url.raw_host.decode("ascii")):
        return client.build_request("GET", url)  # checked as it is; there is no name to resolve or keep
    return client.build_request(
        "GET",
        url.copy_with(host=str(address)),
        headers={"Host": url.netloc.decode("ascii")},
        extensions={"sni_hostname": url.raw_host.decode("ascii")},
    )


def _redirect_target(current: httpx.URL, response: httpx.Response) -> httpx.URL | None:
    """Where a redirect response points (resolved against ``current``), or None when it is no redirect."""
    if response.status_code not in _REDIRECT_CODES or "Location" not in response.headers:
        return None
    location = response.headers["Location"]
    try:
        target = current.join(location)
    except httpx.InvalidURL as exc:
        raise _FetchFailed(f"refused to follow a redirect from {current} to {location!r}: {exc}") from exc
    if not _fetchable(target):
        raise _FetchFailed(
            f"refused to follow a redirect from {current} to {location!r}: only http:// and https:// URLs are fetched"
        )
    return target
