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

Both doors' askers wait synchronously, so a request is withdrawn on every card
when its asker goes away (:mod:`kazma.approvals.withdrawal`): on ``/mcp``
when the HTTP connection closes, the call is cancelled or this process stops
(a crash or a killed replica: the next start, or a surviving replica, withdraws
it); ``kazma mcp serve`` withdraws what it forwarded when its client closes
stdin or cancels the call, or when it is interrupted (SIGINT, SIGTERM), and
Kazma withdraws it when ``kazma mcp serve`` stops asking (killed outright).
The SDK runs tools under anyio's cancellation, so the withdrawal after a
cancellation runs in an anyio shield.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
import structlog
from aiohttp import web
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from kazma.approvals.model import Waits
from kazma.approvals.withdrawal import Gone
from kazma.bot.mcp_askers import ConnectionAsker, OpenCalls, jsonrpc
from kazma.config.metrics import count_failure
from kazma.config.store.errors import store_errors

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


ASKER_KEY = "kazma.asker"  # the ASGI scope's entry carrying the aiohttp side of the call to the tool


def register_http(application: web.Application, api: ApprovalsApi) -> None:
    """Serve ``/mcp`` (streamable HTTP) from ``application``, its requests opened through ``api``."""
    from kazma.bot.console.api import caller_of, describe

    async def withdraw(request_id: str, why: Gone) -> None:
        try:
            await api.service.withdraw(request_id, why)
        except store_errors() as exc:  # the next start (or a surviving replica) withdraws it instead
            count_failure("approval_withdraw")
            log.warning("mcp.withdraw_failed", request_id=request_id, why=why.value, error=str(exc))

    async def ask(
        tool: str, arguments: dict[str, Any], reason: str, deadline: float | None, ctx: Any
    ) -> dict[str, Any]:
        http_request = ctx.request_context.request
        headers = {k: v for k, v in http_request.headers.items()} if http_request is not None else {}
        caller = caller_of(api.config, _HeadersOnly(headers))  # type: ignore[arg-type]
        asker = http_request.scope.get(ASKER_KEY) if http_request is not None else None
        try:
            opened, _ = await api.open_for(
                caller, _body(tool, arguments, reason, deadline), None, waits=Waits.CONNECTION
            )
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
    stopped = Gone.REPLICA_STOPPED if api.app.replication is not None else Gone.STOPPED

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


# --------------------------------------------------------------------------- kazma mcp serve (stdio)

# How long a poll may fail in a row (Kazma restarting, a replica failing over) before the call gives up: less
# than POLL_GRACE, after which Kazma withdraws a request nobody asks about.
POLL_RETRY_SECONDS = 45.0
WITHDRAW_TIMEOUT = 5.0  # an interrupted asker waits this long for Kazma to confirm the withdrawal


def serve_stdio(base_url: str, token: str) -> None:
    """Serve MCP on stdin/stdout, forwarding each ``request_approval`` to Kazma's approvals API."""
    # The SDK points fd 0 at /dev/null while it serves and reads the client from a private copy: a copy of our
    # own tells whether the client hung up.
    try:
        wire = os.dup(0)
    except OSError:
        wire = -1  # no stdin to watch: a cancelled call is reported as cancelled, never as a hang-up
    asyncio.run(_serve_stdio(base_url, token, wire))


async def _serve_stdio(base_url: str, token: str, wire: int) -> None:
    """Serve until the client hangs up, or until this process is interrupted (SIGINT, SIGTERM)."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"}
    interrupted = asyncio.Event()
    asking: set[asyncio.Task[Any]] = set()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, interrupted.set)

    async def ask(
        tool: str, arguments: dict[str, Any], reason: str, deadline: float | None, ctx: Any
    ) -> dict[str, Any]:
        current = asyncio.current_task()
        assert current is not None
        asking.add(current)
        try:
            async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=90, trust_env=False) as client:
                # Kazma-Wait: this process waits and keeps asking; Kazma withdraws the request if it stops.
                opened = await client.post(
                    "/api/v1/approvals", json=_body(tool, arguments, reason, deadline), headers={"Kazma-Wait": "sync"}
                )
                if opened.status_code >= 400:
                    raise ToolError(f"Kazma refused the request (HTTP {opened.status_code}): {opened.text[:500]}")
                found: dict[str, Any] = opened.json()
                try:
                    return answer(await _poll(client, found))
                except asyncio.CancelledError:
                    # The client cancelled the call or hung up, or this process was told to stop.
                    if interrupted.is_set():
                        why = Gone.INTERRUPTED
                    else:
                        why = Gone.DISCONNECTED if _hung_up(wire) else Gone.CANCELLED
                    with anyio.move_on_after(WITHDRAW_TIMEOUT, shield=True):
                        await _withdraw_remote(client, found["id"], why)
                    raise
        finally:
            asking.discard(current)

    serving = asyncio.create_task(build_server(ask).run_stdio_async())
    stop = asyncio.create_task(interrupted.wait())
    await asyncio.wait((serving, stop), return_when=asyncio.FIRST_COMPLETED)
    if serving.done():  # the client hung up: every open call was cancelled and withdrew its request
        stop.cancel()
        serving.result()
        return
    serving.cancel()
    if asking:
        await asyncio.wait(set(asking), timeout=WITHDRAW_TIMEOUT + 1)
    # The SDK reads stdin in a worker thread that stays blocked while the client keeps stdin open, and neither
    # the loop nor the interpreter can end while it does. What was asked is withdrawn: leave now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


async def _poll(client: Any, found: dict[str, Any]) -> dict[str, Any]:
    """Ask for the answer until there is one; a Kazma that does not answer for a while (a restart) is asked
    again, for up to ``POLL_RETRY_SECONDS`` in a row."""
    import httpx

    failing_since: float | None = None
    loop = asyncio.get_running_loop()
    while found["status"] == "pending":
        try:
            polled = await client.get(f"/api/v1/approvals/{found['id']}", params={"wait": "30"})
        except httpx.TransportError as exc:
            problem = str(exc) or type(exc).__name__
        else:
            if polled.status_code < 400:
                found = polled.json()
                failing_since = None
                continue
            if polled.status_code not in (502, 503, 504):
                raise ToolError(f"Kazma answered HTTP {polled.status_code}: {polled.text[:500]}")
            problem = f"HTTP {polled.status_code}"
        now = loop.time()
        failing_since = now if failing_since is None else failing_since
        if now - failing_since > POLL_RETRY_SECONDS:
            raise ToolError(f"Kazma stopped answering ({problem}); the request is withdrawn when it is back")
        await asyncio.sleep(1.0)
    return found


async def _withdraw_remote(client: Any, request_id: str, why: Gone) -> None:
    """Tell Kazma the asker is gone (``DELETE …?why=``); best effort: if it cannot be told, it withdraws the
    request itself once nobody asks about it."""
    word = {Gone.INTERRUPTED: "interrupted", Gone.DISCONNECTED: "disconnected"}.get(why, "cancelled")
    try:
        await client.delete(f"/api/v1/approvals/{request_id}", params={"why": word}, timeout=WITHDRAW_TIMEOUT)
    except Exception as exc:
        log.warning("mcp.withdraw_failed", request_id=request_id, why=why.value, error=str(exc))


def _hung_up(wire: int) -> bool:
    """Whether the MCP client closed our stdin (``wire``, a copy of it), as opposed to cancelling one call."""
    try:
        poller = select.poll()
        poller.register(wire, select.POLLIN)
        return any(event & (select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, event in poller.poll(0))
    except (OSError, ValueError):
        return False
