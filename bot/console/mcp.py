"""``/mcp``: Kazma's MCP tool (:mod:`~kazma.bot.console.mcp_tool`) on the web server, for any MCP client.

It speaks streamable HTTP (stateless, JSON responses) and opens requests in
this process through the approvals API's own code, with the same API tokens and
roles. The SDK is Starlette/ASGI; the web server is aiohttp. :func:`register_http`
bridges one aiohttp request to the SDK's session manager as one ASGI call,
after the bearer token was checked here. This module imports the SDK (about a
second): the web server imports it only when it starts.

The asker waits synchronously, so a request is withdrawn on every card when its
asker goes away (:mod:`kazma.approvals.withdrawal`): when the HTTP connection
closes, the call is cancelled or this process stops (a crash or a killed
replica: the next start, or a surviving replica, withdraws it). The SDK runs
tools under anyio's cancellation, so the withdrawal after a cancellation runs in
an anyio shield.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import structlog
from aiohttp import web
from mcp.server.mcpserver.exceptions import ToolError

from kazma.approvals.model import Waits
from kazma.approvals.withdrawal import Gone
from kazma.bot.console.api import ApprovalsApi, caller_of, describe
from kazma.bot.console.mcp_askers import ConnectionAsker, OpenCalls, jsonrpc
from kazma.bot.console.mcp_tool import Asked, answer, build_server
from kazma.config.metrics import count_failure
from kazma.config.store.errors import store_errors

log = structlog.get_logger("kazma.mcp_server")

ASKER_KEY = "kazma.asker"  # the ASGI scope's entry carrying the aiohttp side of the call to the tool


def register_http(application: web.Application, api: ApprovalsApi) -> None:
    """Serve ``/mcp`` (streamable HTTP) from ``application``, its requests opened through ``api``."""

    async def withdraw(request_id: str, why: Gone) -> None:
        try:
            await api.service.withdraw(request_id, why)
        except store_errors() as exc:  # the next start (or a surviving replica) withdraws it instead
            count_failure("approval_withdraw")
            log.warning("mcp.withdraw_failed", request_id=request_id, why=why.value, error=str(exc))

    async def ask(asked: Asked) -> dict[str, Any]:
        http_request = asked.context.request_context.request
        headers = {k: v for k, v in http_request.headers.items()} if http_request is not None else {}
        caller = caller_of(api.config, _HeadersOnly(headers))  # type: ignore[arg-type]
        asker = http_request.scope.get(ASKER_KEY) if http_request is not None else None
        try:
            opened, _ = await api.open_for(caller, asked.body(), None, waits=Waits.CONNECTION)
        except web.HTTPException as exc:
            raise ToolError(f"refused: {exc.text}") from None
        outcome = asyncio.ensure_future(api.outcome_of(opened.id))
        never: asyncio.Future[Gone] = asyncio.get_running_loop().create_future()  # no connection to watch
        gone = asyncio.ensure_future(asker.gone()) if isinstance(asker, ConnectionAsker) else never
        try:
            await asyncio.wait((outcome, gone), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # Cancelled: the SDK ended the call (the client cancelled it, the connection or the server went).
            why = (asker.why() if isinstance(asker, ConnectionAsker) else None) or Gone.CANCELLED
            with anyio.CancelScope(shield=True):
                await withdraw(opened.id, why)
            raise
        finally:
            for task in (outcome, gone):
                task.cancel()
        if not outcome.cancelled() and outcome.done():
            return answer(describe(api.service, outcome.result()))
        why = gone.result()
        log.warning("mcp.asker_gone", request_id=opened.id, why=why.value, token=caller.name)
        await withdraw(opened.id, why)
        raise ToolError(f"the request was withdrawn: {why.value}; nothing was decided")

    state: dict[str, Any] = {}
    stopping = asyncio.Event()
    stopped = Gone.REPLICA_STOPPED if api.services.replicated else Gone.STOPPED

    async def start(_: web.Application) -> None:
        server = build_server(ask)
        server.streamable_http_app(streamable_http_path="/mcp", stateless_http=True, json_response=True)
        manager = server.session_manager
        ready, stop = asyncio.Event(), asyncio.Event()

        async def run() -> None:
            async with manager.run():
                ready.set()
                await stop.wait()

        state.update(manager=manager, stop=stop, task=asyncio.create_task(run(), name="kazma-mcp-http"))
        await ready.wait()

    async def shutdown(_: web.Application) -> None:
        stopping.set()  # before the server waits for open calls: each withdraws its request and answers

    async def cleanup(_: web.Application) -> None:
        if "stop" in state:
            state["stop"].set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(state["task"], 5)

    calls = OpenCalls()

    async def handle(request: web.Request) -> web.StreamResponse:
        caller = caller_of(api.config, request)  # 401 before anything reaches the SDK
        message = jsonrpc(await request.read()) if request.method == "POST" else None
        calls.cancelled(caller.name, request, message)
        asker = ConnectionAsker(request, stopping, stopped)
        with calls.holding(caller.name, request, message, asker):
            return await _asgi(state["manager"].handle_request, request, {ASKER_KEY: asker})

    application.on_startup.append(start)
    application.on_shutdown.append(shutdown)
    application.on_cleanup.append(cleanup)
    application.router.add_route("*", "/mcp", handle)


class _HeadersOnly:
    """The part of a request :func:`caller_of` reads, for a request that reached us through the SDK."""

    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = {k.title(): v for k, v in headers.items()}
        self.path = "/mcp"
        self.remote = None


async def _asgi(app: Callable[..., Awaitable[None]], request: web.Request, extra: dict[str, Any]) -> web.StreamResponse:
    body = await request.read()
    scope = {
        **extra,
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": request.scheme,
        "path": request.path,
        "raw_path": request.raw_path.encode("latin-1"),
        "query_string": request.query_string.encode("latin-1"),
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers.items()],
        "client": (request.remote or "", 0),
        "server": ("127.0.0.1", 0),
    }
    delivered = False
    done = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    response: web.StreamResponse | None = None

    async def send(message: dict[str, Any]) -> None:
        nonlocal response
        if message["type"] == "http.response.start":
            response = web.StreamResponse(status=int(message["status"]))
            for key, value in message.get("headers", []):
                name = key.decode("latin-1")
                if name.lower() != "content-length":
                    response.headers.add(name, value.decode("latin-1"))
            await response.prepare(request)
        elif message["type"] == "http.response.body" and response is not None:
            await response.write(message.get("body", b""))

    try:
        await app(scope, receive, send)
    finally:
        done.set()
    if response is None:
        return web.Response(status=500, text="the MCP endpoint gave no answer")
    await response.write_eof()
    return response
