"""``/mcp``: Kazma's MCP tool (:mod:`~kazma.bot.console.mcp_tool`) on the web server, for any MCP client.

It speaks streamable HTTP (stateless, JSON responses) and opens requests in
this process through the approvals API's own code, with the same API tokens and
roles. The SDK is Starlette/ASGI; the web server is aiohttp. :class:`MCPEndpoint`
bridges one aiohttp request to the SDK's session manager as one ASGI call,
after the bearer token was checked. This module imports the SDK (about a second
and a quarter of Kazma's memory): :mod:`~kazma.bot.console.mcp_door` imports it
only when ``/mcp`` is configured (an API token exists) or first called.

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
from mcp.server.transport_security import TransportSecuritySettings

from kazma.approvals.model import Waits
from kazma.approvals.withdrawal import Gone
from kazma.bot.console.api import ApiCaller, ApprovalsApi, describe
from kazma.bot.console.mcp_askers import ConnectionAsker, OpenCalls, jsonrpc
from kazma.bot.console.mcp_tool import Asked, answer, build_server
from kazma.config.metrics import count_failure
from kazma.config.store.errors import store_errors
from kazma.config.waits import bounded

log = structlog.get_logger("kazma.mcp_server")

ASKER_KEY = "kazma.asker"  # the ASGI scope's entry carrying the aiohttp side of the call to the tool
CALLER_KEY = "kazma.caller"  # ... and the API caller its token was checked as (once, by the door)


class MCPEndpoint:
    """The SDK's session manager behind ``/mcp``, its requests opened through ``api``. Made and started by
    :class:`~kazma.bot.console.mcp_door.MCPDoor` when ``/mcp`` is configured or first called; ``stopping`` is
    set as the web server shuts down, before it waits for open calls."""

    def __init__(self, api: ApprovalsApi, stopping: asyncio.Event) -> None:
        self.api = api
        self.stopping = stopping
        self.stopped = Gone.REPLICA_STOPPED if api.services.replicated else Gone.STOPPED
        self.calls = OpenCalls()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._manager: Any = None
        self._serving = False  # the manager started and has not ended since
        self.ended_by: str | None = None  # what ended the manager, for /healthz

    @property
    def running(self) -> bool:
        """The SDK's session manager serves (it started and its task has not ended)."""
        return self._serving and self._task is not None and not self._task.done()

    async def _withdraw(self, request_id: str, why: Gone) -> bool | None:
        """Whether the withdrawal ended the request (False: a decision came first and stands); None when the
        store did not answer (the next start, or a surviving replica, withdraws it instead)."""
        try:
            won, _ = await self.api.service.withdraw(request_id, why)
        except store_errors() as exc:
            count_failure("approval_withdraw")
            log.warning("mcp.withdraw_failed", request_id=request_id, why=why.value, error=str(exc))
            return None
        return won

    async def _ask(self, asked: Asked) -> dict[str, Any]:
        api = self.api
        http_request = asked.context.request_context.request
        scope = http_request.scope if http_request is not None else {}
        # The caller the door checked, not one read again from the headers: with two Authorization headers the
        # door read the first and a dict of the headers kept the last (one call, two identities).
        caller = scope.get(CALLER_KEY)
        if not isinstance(caller, ApiCaller):
            raise ToolError("refused: this call did not come through Kazma's /mcp door")
        asker = scope.get(ASKER_KEY)
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
                await self._withdraw(opened.id, why)
            raise
        finally:
            for task in (outcome, gone):
                task.cancel()
        if not outcome.cancelled() and outcome.done():
            return answer(await describe(api.service, outcome.result()))
        why = gone.result()
        log.warning("mcp.asker_gone", request_id=opened.id, why=why.value, token=caller.name)
        withdrawn = await self._withdraw(opened.id, why)
        if withdrawn is None:
            raise ToolError(
                f"the request {opened.id} could not be withdrawn ({why.value}): the approvals store did not answer. "
                "It may still be decided: ask for it again by its id before acting on it."
            )
        if not withdrawn:
            # A decision came first (made here, on a replica or from the command line, its waiter not woken yet):
            # it stands, and the asker hears it, not "nothing was decided".
            ended = await api.service.store.get(opened.id)
            if ended is not None and ended.status.final:
                return answer(await describe(api.service, ended))
        raise ToolError(f"the request was withdrawn: {why.value}; nothing was decided")

    async def start(self) -> None:
        server = build_server(self._ask)
        # The SDK's DNS-rebinding check, on by default, answers 421 to any Host but localhost: every client of
        # <public_url>/mcp behind a proxy or on another address was refused. It guards servers nobody has to sign
        # in to; here no byte reaches the SDK without an API token (the door checks it first), which a rebound
        # page cannot send, as a cross-origin Authorization header needs a preflight that the door refuses.
        open_hosts = TransportSecuritySettings(enable_dns_rebinding_protection=False)
        server.streamable_http_app(
            streamable_http_path="/mcp", stateless_http=True, json_response=True, transport_security=open_hosts
        )
        manager = server.session_manager
        ready = asyncio.Event()

        async def run() -> None:
            async with manager.run():
                ready.set()
                await self._stop.wait()

        self._manager = manager
        self._task = asyncio.create_task(run(), name="kazma-mcp-http")
        ready_or_failed = asyncio.ensure_future(ready.wait())
        try:  # a manager that fails to start ends its task: that, not a hang, is what the caller sees
            await asyncio.wait((ready_or_failed, self._task), return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready_or_failed.cancel()
        if not ready.is_set():
            await self._task  # raises what ended it
        self._serving = True
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """The manager's task ended. Looked at only during start and stop before, a manager that ended between
        (an error out of the SDK's task group) left every later /mcp call a 500 with nobody told; now it is said
        and counted here, and the door starts a new endpoint for the next call (:attr:`running`)."""
        self._serving = False
        if self._stop.is_set():
            return  # stopped: no failure
        error = None if task.cancelled() else task.exception()
        self.ended_by = f"{type(error).__name__}: {error}" if error is not None else "cancelled"
        count_failure("mcp_endpoint")
        log.error(
            "mcp.endpoint_ended",
            error=f"{type(error).__name__}: {error}" if error is not None else "cancelled",
            detail="the next /mcp call starts it again",
            exc_info=error,
        )

    async def stop(self) -> None:
        self._stop.set()
        task = self._task
        if task is not None and not task.done():
            with contextlib.suppress(Exception):
                await bounded(task, 5)

    async def handle(self, request: web.Request, caller: ApiCaller) -> web.StreamResponse:
        """One ``/mcp`` call of ``caller`` (its token already checked) through the SDK."""
        message = jsonrpc(await request.read()) if request.method == "POST" else None
        self.calls.cancelled(caller.name, request, message)
        asker = ConnectionAsker(request, self.stopping, self.stopped)
        with self.calls.holding(caller.name, request, message, asker):
            return await _asgi(self._manager.handle_request, request, {ASKER_KEY: asker, CALLER_KEY: caller})


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
        "raw_path": request.raw_path.encode("latin-1"),  # ASCII: aiohttp refuses any other byte in a request line
        "query_string": request.query_string.encode("latin-1"),
        "root_path": "",
        # The header bytes as sent (ASGI carries bytes): text re-encoded as latin-1 failed on a header holding a
        # character beyond it (a UTF-8 "€" from a client), a 500 for an authenticated caller.
        "headers": [(name.lower(), value) for name, value in request.raw_headers],
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
