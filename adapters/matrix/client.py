"""The transport: mautrix's client-server API over one aiohttp session, with the homeserver's 429 kept whole.

mautrix's ``HTTPAPI`` turns an error answer into an exception and drops the body's ``retry_after_ms``; this
subclass answers a 429 with :class:`~kazma.adapters.matrix.errors.RateLimited` carrying it, so the kit's one
pacing waits exactly as long as the homeserver asked.

Every request but the sync's long poll gives up once the homeserver stays silent for the request timeout (no
byte of an answer): a homeserver that takes a connection and never answers would otherwise hold the caller for
ever — for a card read or a position save, the sync and with it every later press and message. The long poll is
silent by design; the sync bounds it itself (:func:`long_poll`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import aiohttp
from mautrix.api import HTTPAPI, Method
from mautrix.client import ClientAPI
from mautrix.errors import make_request_error
from mautrix.types import UserID
from yarl import URL

from kazma.adapters.matrix.errors import DEFAULT_WAIT, RateLimited

_LONG_POLL: ContextVar[bool] = ContextVar("kazma_matrix_long_poll", default=False)


@contextlib.contextmanager
def long_poll() -> Iterator[None]:
    """Requests made inside wait on a silent homeserver for as long as the caller's own bound (``/sync``)."""
    token = _LONG_POLL.set(True)
    try:
        yield
    finally:
        _LONG_POLL.reset(token)


def _wait_of(body: Any, header: str | None) -> float:
    """Seconds to wait: the body's ``retry_after_ms`` (the spec's), else the ``Retry-After`` header."""
    wait = body.get("retry_after_ms") if isinstance(body, dict) else None
    if isinstance(wait, int | float) and not isinstance(wait, bool):
        return max(float(wait) / 1000.0, 0.0)
    try:
        return max(float(header), 0.0) if header is not None else DEFAULT_WAIT
    except ValueError:
        return DEFAULT_WAIT


class KeptLimitsAPI(HTTPAPI):
    """mautrix's request sender, raising :class:`RateLimited` with the homeserver's wait on a 429, and
    ``TimeoutError`` when the homeserver stays silent for ``request_timeout`` (outside :func:`long_poll`)."""

    def __init__(self, *args: Any, request_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.request_timeout = request_timeout

    async def _send(
        self, method: Method, url: URL, content: Any, query_params: dict[str, str], headers: dict[str, str]
    ) -> tuple[Any, aiohttp.ClientResponse]:
        silence = None if _LONG_POLL.get() else self.request_timeout
        bound = aiohttp.ClientTimeout(total=None, sock_connect=self.request_timeout, sock_read=silence)
        try:
            async with self.session.request(
                str(method), url, data=content, params=query_params, headers=headers, timeout=bound
            ) as got:
                if 200 <= got.status < 300:
                    return await got.json(), got
                text = await got.text()
        except aiohttp.ServerTimeoutError as exc:  # said as every unanswered call is: "no answer within …"
            raise TimeoutError(str(exc)) from exc
        try:
            body: Any = json.loads(text)
        except ValueError:
            body = None
        fields = body if isinstance(body, dict) else {}
        if got.status == 429:
            raise RateLimited(
                str(fields.get("error") or "Too Many Requests"), _wait_of(body, got.headers.get("Retry-After"))
            )
        raise make_request_error(
            http_status=got.status,
            text=text,
            errcode=fields.get("errcode"),
            message=fields.get("error"),
            unstable_errcode=fields.get("org.matrix.msc3848.unstable.errcode"),
        )


def make_client(homeserver: str, token: str, *, request_timeout: float) -> ClientAPI:
    """A client for ``homeserver`` with ``token`` on a session of its own (closed by :func:`close_client`)."""
    # The session's own bound serves what does not go through the API (a file's download): silence ends it too.
    session = aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=request_timeout, sock_read=request_timeout)
    )
    api = KeptLimitsAPI(
        homeserver, token, client_session=session, default_retry_count=0, request_timeout=request_timeout
    )
    return ClientAPI(UserID(""), api=api)


async def close_client(client: ClientAPI) -> None:
    await client.api.session.close()
