"""python-telegram-bot's HTTP transport on aiohttp (PTB's ``BaseRequest`` extension point).

PTB's own transport is httpx: each Bot API call cost ~0.6 ms of this process's CPU in httpx, httpcore, h11 and
anyio before the bytes left (httpcore also imports ``sniffio`` on every response, and fails when it is absent),
against ~0.05 ms through aiohttp, which Kazma already runs for Slack, Discord and its web server. A card's edit
and the reply racing it are two such calls between a press and its cards settled. PTB still builds every call
and reads every answer; only the bytes go through aiohttp: the same form (URL-encoded, or multipart with files),
the same errors (``TimedOut``, ``NetworkError``) as PTB's httpx transport raises.
"""

from __future__ import annotations

import json
import logging
import ssl
import urllib.request
from typing import Any

import aiohttp
import yarl
from telegram.error import NetworkError, TimedOut
from telegram.request import BaseRequest, RequestData

_TIMEOUT_DEFAULT = BaseRequest.DEFAULT_NONE
# A line per call at debug level, as httpx wrote under PTB's own transport (the token in its URL is cut out by
# kazma.bot.logging on the way out, as it was from httpx's).
_http_log = logging.getLogger("kazma.adapters.telegram.http")


class AiohttpRequest(BaseRequest):
    """One aiohttp session (made at ``initialize``) for PTB's calls, at most ``connection_pool_size`` connections.

    Timeouts as PTB's own transport takes them: ``connect`` for a connection, ``pool`` for a free one (aiohttp
    counts both in its ``connect``), ``read`` for each read of the answer; a write has no bound of its own in
    aiohttp, so the call as a whole is bounded by the sum of the phases' bounds (a stalled write ends there).
    A proxy from the environment (``HTTPS_PROXY``, ``NO_PROXY``) for ``api_url``'s host, as httpx reads it, looked
    up once at ``initialize``: aiohttp's ``trust_env`` looks it up, and reads ``~/.netrc``, in a thread on every call.
    """

    def __init__(
        self,
        *,
        connection_pool_size: int,
        connect_timeout: float | None,
        read_timeout: float | None,
        write_timeout: float | None,
        pool_timeout: float | None,
        tls: ssl.SSLContext,
        api_url: str,
        media_write_timeout: float | None = 20.0,
    ) -> None:
        self._size = connection_pool_size
        self._connect = connect_timeout
        self._read = read_timeout
        self._write = write_timeout
        self._pool = pool_timeout
        self._media_write = media_write_timeout
        self._tls = tls
        self._api_url = yarl.URL(api_url)
        self._session: aiohttp.ClientSession | None = None
        self._headers = {"User-Agent": self.USER_AGENT}

    @property
    def read_timeout(self) -> float | None:
        return self._read

    async def initialize(self) -> None:
        if self._session is None or self._session.closed:
            proxy = _env_proxy(self._api_url)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._size, ssl=self._tls),
                proxy=proxy,
                proxy_auth=None if proxy is None else aiohttp.BasicAuth.from_url(proxy),
            )

    async def shutdown(self) -> None:
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()

    async def do_request(
        self,
        url: str,
        method: str,
        request_data: RequestData | None = None,
        read_timeout: Any = _TIMEOUT_DEFAULT,
        write_timeout: Any = _TIMEOUT_DEFAULT,
        connect_timeout: Any = _TIMEOUT_DEFAULT,
        pool_timeout: Any = _TIMEOUT_DEFAULT,
    ) -> tuple[int, bytes]:
        session = self._session
        if session is None or session.closed:
            raise RuntimeError("This AiohttpRequest is not initialized!")
        files = request_data.multipart_data if request_data else None
        fields = request_data.json_parameters if request_data else None
        read = self._read if read_timeout is _TIMEOUT_DEFAULT else read_timeout
        write = (self._media_write if files else self._write) if write_timeout is _TIMEOUT_DEFAULT else write_timeout
        connect = self._connect if connect_timeout is _TIMEOUT_DEFAULT else connect_timeout
        pool = self._pool if pool_timeout is _TIMEOUT_DEFAULT else pool_timeout
        phases = (connect, pool, write, read)
        timeout = aiohttp.ClientTimeout(
            total=None if None in phases else sum(phases),  # type: ignore[arg-type]
            connect=None if connect is None or pool is None else connect + pool,
            sock_connect=connect,
            sock_read=read,
        )
        body: aiohttp.FormData | dict[str, str] | None = fields
        if files:
            form = aiohttp.FormData(quote_fields=False)
            for name, value in (fields or {}).items():
                form.add_field(name, value)
            for name, (filename, content, mimetype) in files.items():
                form.add_field(name, content, filename=filename, content_type=mimetype)
            body = form
        try:
            # No redirects followed, as under PTB's httpx transport: the Bot API answers, it does not send us on.
            async with session.request(
                method, url, data=body, headers=self._headers, timeout=timeout, allow_redirects=False
            ) as answer:
                payload = await answer.read()
                if _http_log.isEnabledFor(logging.DEBUG):
                    _http_log.debug('HTTP Request: %s %s "%s %s"', method, url, answer.status, answer.reason)
                if answer.status >= 500:
                    # PTB words a 5xx by its body's description alone ("Bad Gateway"), or repeats a proxy's whole
                    # HTML page: the status, said here, is what tells a reader Telegram answered and failed.
                    status = f"{answer.status} {answer.reason or ''}".rstrip()
                    raise NetworkError(f"Telegram answered {status}{described(payload, answer.reason)}")
                return answer.status, payload
        # aiohttp's timeouts are TimeoutError too; PTB's bare "Timed out" said neither which nor how long
        except aiohttp.ConnectionTimeoutError as exc:
            raise TimedOut(f"no connection to {yarl.URL(url).host} within {_seconds(connect, pool)}") from exc
        except aiohttp.SocketTimeoutError as exc:
            raise TimedOut(f"no answer from Telegram within {_seconds(read)}") from exc
        except TimeoutError as exc:
            raise TimedOut(f"no answer from Telegram within {_seconds(*phases)} (the call's whole bound)") from exc
        except aiohttp.ClientError as exc:
            raise NetworkError(f"aiohttp.{type(exc).__name__}: {exc}") from exc


def _seconds(*bounds: float | None) -> str:
    """A timeout made of ``bounds`` (summed), as a reader is told it."""
    return "no bound" if None in bounds else f"{sum(b for b in bounds if b is not None):g} s"


def described(payload: bytes, reason: str | None = None) -> str:
    """What a failed answer's JSON says it was (the Bot API's ``description``), when it says more than ``reason``."""
    try:
        body = json.loads(payload)
    except ValueError:
        return ""
    description = body.get("description") if isinstance(body, dict) else None
    return f": {description}" if isinstance(description, str) and description not in ("", reason) else ""


def _env_proxy(url: yarl.URL) -> yarl.URL | None:
    """The proxy the environment names for ``url`` (``NO_PROXY`` honoured), or None."""
    if url.host is None or urllib.request.proxy_bypass(url.host):
        return None
    proxies = urllib.request.getproxies()
    found = proxies.get(url.scheme) or proxies.get("all")
    if not found:
        return None
    proxy = yarl.URL(found if "://" in found else f"http://{found}")
    if proxy.scheme not in ("http", "https"):  # httpx needed an extra for SOCKS too: say so, never go around it
        raise RuntimeError(f"the proxy for {url.host} is {proxy.scheme}://, and only an HTTP proxy is supported")
    return proxy
