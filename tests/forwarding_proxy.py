"""A small HTTP reverse proxy for tests: what nginx does in front of Kazma, on 127.0.0.1.

Each request is forwarded to ``upstream`` with ``X-Forwarded-For`` extended by the proxy's own peer (nginx's
``$proxy_add_x_forwarded_for``), and the answer is passed back unchanged — status, every ``Set-Cookie``,
redirects not followed. Clients that connect from different loopback addresses (127.0.0.2, 127.0.0.3, …) are
different clients to the proxy, and all of them are the proxy's address (127.0.0.1) to Kazma.
"""

from __future__ import annotations

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

_HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
    "content-length", "host",
}  # fmt: skip
_NOT_BACK = {*_HOP_BY_HOP, "content-encoding"}  # the client session decoded the body already


class ForwardingProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.base = ""
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(auto_decompress=True, cookie_jar=aiohttp.DummyCookieJar())
        application = web.Application(client_max_size=64 * 1024 * 1024)
        application.router.add_route("*", "/{tail:.*}", self._forward)
        runner = web.AppRunner(application, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self._runner = runner
        host, port = runner.addresses[0][:2]
        self.base = f"http://{host}:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> ForwardingProxy:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP)
        prior = ", ".join(headers.popall("X-Forwarded-For", []))
        peer = request.remote or "unknown"
        headers["X-Forwarded-For"] = f"{prior}, {peer}" if prior else peer
        headers["X-Forwarded-Proto"] = "http"
        async with self._session.request(
            request.method,
            self.upstream + str(request.rel_url),
            headers=headers,
            data=await request.read(),
            allow_redirects=False,
        ) as answer:
            body = await answer.read()
            back = CIMultiDict((k, v) for k, v in answer.headers.items() if k.lower() not in _NOT_BACK)
            return web.Response(status=answer.status, body=body, headers=back)
