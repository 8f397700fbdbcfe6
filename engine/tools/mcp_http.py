"""The HTTP side of the bound on an MCP server's answers: a JSON body is read up to ``max_message_bytes`` only.

The SDK's streamable-HTTP client bounds each server-sent event itself (it is
given the same limit) but reads a plain JSON answer whole. This transport
wraps the real one and ends such a body once it passes the limit, with an
``httpx2.StreamError`` the SDK turns into an error for that one request.
Compressed answers are refused: a few megabytes of gzip can unpack to
gigabytes after the count, so Kazma asks for ``identity`` and accepts nothing
else.

Either cut reaches the session as the SDK's own error for that request (a
parse error, or "SSE stream failed"); :func:`answer_cut` tells them from a
server's real errors, so a call whose answer was cut is said to have run with
its outcome unknown, as on stdio, and not to have failed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx2

__all__ = ["AnswerTooLarge", "answer_cut", "bounded_http_transport"]

_CUT_SAID = "Kazma cut it off unread"
# what httpx2's event reader says of an event over its max_event_size (pinned by the HTTP test of the bound)
_EVENT_OVER = "Server-sent event exceeded the "


class AnswerTooLarge(httpx2.StreamError):
    """The server's answer passed the bound (or came compressed); nothing more of it is read."""


class _Capped(httpx2.AsyncByteStream):
    def __init__(self, inner: httpx2.AsyncByteStream, limit: int) -> None:
        self._inner = inner
        self._limit = limit

    async def __aiter__(self) -> AsyncIterator[bytes]:
        seen = 0
        async for chunk in self._inner:
            seen += len(chunk)
            if seen > self._limit:
                raise AnswerTooLarge(
                    f"the server's answer was longer than {self._limit} bytes (max_message_bytes); {_CUT_SAID}"
                )
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


class _Bounded(httpx2.AsyncBaseTransport):
    def __init__(self, inner: httpx2.AsyncBaseTransport, limit: int) -> None:
        self._inner = inner
        self._limit = limit

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        request.headers["Accept-Encoding"] = "identity"
        response = await self._inner.handle_async_request(request)
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            await response.aclose()
            raise AnswerTooLarge(f"the server answered with content-encoding {encoding!r}; Kazma reads only identity")
        if not response.headers.get("content-type", "").lower().startswith("text/event-stream"):
            stream = response.stream
            assert isinstance(stream, httpx2.AsyncByteStream)
            response.stream = _Capped(stream, self._limit)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


def answer_cut(exc: BaseException) -> bool:
    """Whether ``exc`` is the SDK's error for a request whose answer was cut at the bound: a JSON body this
    transport cut, or one server-sent event the SDK's reader cut. Both are errors the SDK makes itself, with
    codes a server may use too, so they are told apart by what they say."""
    from mcp import MCPError
    from mcp_types import CONNECTION_CLOSED, PARSE_ERROR

    if not isinstance(exc, MCPError):
        return False
    if exc.code == PARSE_ERROR:
        return _CUT_SAID in exc.message
    return exc.code == CONNECTION_CLOSED and exc.message.startswith("SSE stream failed: " + _EVENT_OVER)


def bounded_http_transport(limit: int) -> httpx2.AsyncBaseTransport:
    """A transport for an ``httpx2.AsyncClient`` that reads at most ``limit`` bytes of any JSON answer."""
    return _Bounded(httpx2.AsyncHTTPTransport(trust_env=False), limit)
