"""Kazma as an MCP server: ``request_approval`` for any MCP client (coding agents included).

Two doors, one tool. ``/mcp`` on the web server speaks streamable HTTP
(stateless, JSON responses) and opens requests in this process through the
approvals API's own code, with the same API tokens and roles. ``kazma mcp
serve`` speaks stdio to a local client and forwards to a running Kazma's
approvals API over HTTP (``KAZMA_API_TOKEN``), so it holds no store and no
platform of its own.

The SDK is Starlette/ASGI; the web server is aiohttp. :func:`register_http`
bridges one aiohttp request to the SDK's session manager as one ASGI call,
after the bearer token was checked here. This module imports the SDK (about a
second): it is imported only where one of these doors is opened.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web
from mcp.server.mcpserver import Context, MCPServer

if TYPE_CHECKING:
    from kazma.bot.console.api import ApprovalsApi

log = structlog.get_logger("kazma.mcp_server")

Ask = Callable[[str, dict[str, Any], str, float | None, Any], Awaitable[dict[str, Any]]]
INSTRUCTIONS = (
    "Call request_approval before any action a person must approve. It shows the exact call (tool name and "
    "arguments) on an approval card on every platform Kazma serves and returns once a person decided or the "
    "deadline passed. Run the action only when outcome is 'approved', with exactly the arguments you sent "
    "(their SHA-256 is returned as hash)."
)


def build_server(ask: Ask) -> MCPServer[Any]:
    """The MCP server with its one tool; ``ask`` opens the request and waits for its outcome."""
    server: MCPServer[Any] = MCPServer("kazma", instructions=INSTRUCTIONS, log_level="WARNING")

    async def request_approval(
        tool: str,
        arguments: dict[str, Any],
        ctx: Context[Any],
        reason: str = "",
        deadline_seconds: float | None = None,
    ) -> dict[str, Any]:
        """Ask a person to approve one call; returns outcome, decided_by, decided_at, hash and request_id."""
        return await ask(tool, arguments, reason, deadline_seconds, ctx)

    server.add_tool(request_approval)
    return server


def answer(found: dict[str, Any]) -> dict[str, Any]:
    return {
        "outcome": found["status"],
        "decided_by": found.get("decided_by"),
        "decided_at": found.get("decided_at"),
        "hash": found["hash"],
        "request_id": found["id"],
        "link": found.get("link"),
    }


def _body(tool: str, arguments: dict[str, Any], reason: str, deadline: float | None) -> dict[str, Any]:
    body: dict[str, Any] = {"tool": tool, "arguments": arguments}
    if reason:
        body["reason"] = reason
    if deadline is not None:
        body["deadline_seconds"] = deadline
    return body


# --------------------------------------------------------------------------- /mcp on the web server


def register_http(application: web.Application, api: ApprovalsApi) -> None:
    """Serve ``/mcp`` (streamable HTTP) from ``application``, its requests opened through ``api``."""
    from kazma.bot.console.api import caller_of, describe

    async def ask(
        tool: str, arguments: dict[str, Any], reason: str, deadline: float | None, ctx: Any
    ) -> dict[str, Any]:
        http_request = ctx.request_context.request
        headers = {k: v for k, v in http_request.headers.items()} if http_request is not None else {}
        caller = caller_of(api.config, _HeadersOnly(headers))  # type: ignore[arg-type]
        try:
            opened, _ = await api.open_for(caller, _body(tool, arguments, reason, deadline), None)
        except web.HTTPException as exc:
            raise ValueError(f"refused: {exc.text}") from None
        return answer(describe(api.service, await api.outcome_of(opened.id)))

    state: dict[str, Any] = {}

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

    async def cleanup(_: web.Application) -> None:
        if "stop" in state:
            state["stop"].set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(state["task"], 5)

    async def handle(request: web.Request) -> web.StreamResponse:
        caller_of(api.config, request)  # 401 before anything reaches the SDK
        return await _asgi(state["manager"].handle_request, request)

    application.on_startup.append(start)
    application.on_cleanup.append(cleanup)
    application.router.add_route("*", "/mcp", handle)


class _HeadersOnly:
    """The part of a request :func:`caller_of` reads, for a request that reached us through the SDK."""

    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = {k.title(): v for k, v in headers.items()}
        self.path = "/mcp"
        self.remote = None


async def _asgi(app: Callable[..., Awaitable[None]], request: web.Request) -> web.StreamResponse:
    body = await request.read()
    scope = {
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


# --------------------------------------------------------------------------- kazma mcp serve (stdio)


def serve_stdio(base_url: str, token: str) -> None:
    """Serve MCP on stdin/stdout, forwarding each ``request_approval`` to Kazma's approvals API."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"}

    async def ask(
        tool: str, arguments: dict[str, Any], reason: str, deadline: float | None, ctx: Any
    ) -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=90, trust_env=False) as client:
            opened = await client.post("/api/v1/approvals", json=_body(tool, arguments, reason, deadline))
            if opened.status_code >= 400:
                raise ValueError(f"Kazma refused the request (HTTP {opened.status_code}): {opened.text[:500]}")
            found: dict[str, Any] = opened.json()
            while found["status"] == "pending":
                polled = await client.get(f"/api/v1/approvals/{found['id']}", params={"wait": "30"})
                if polled.status_code >= 400:
                    raise ValueError(f"Kazma answered HTTP {polled.status_code}: {polled.text[:500]}")
                found = polled.json()
            return answer(found)

    build_server(ask).run("stdio")
