"""``/mcp`` on the web server, with the MCP SDK loaded only when someone can use it.

The SDK costs about a second to import and start and a quarter of an idle
Kazma's memory. Nobody can call ``/mcp`` without an API token (``api.tokens``),
so with none configured the route answers 401 as it always did and the SDK is
never imported. With tokens, :class:`MCPDoor` imports and starts it in the
background as the web server starts (the import in a thread, so the event loop
keeps answering presses meanwhile), and a call that arrives first waits for it.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

import structlog
from aiohttp import web

from kazma.bot.console.api import ApprovalsApi, ambiguity, caller_of
from kazma.config.metrics import count_failure

if TYPE_CHECKING:
    from kazma.bot.console.mcp import MCPEndpoint

log = structlog.get_logger("kazma.mcp_server")

_INVALID_REQUEST = -32600  # JSON-RPC 2.0's code for a message that is not a valid request
# request_approval's parameters that are not text (kazma.bot.console.mcp_tool): the SDK reads a text sent for one
# of them as JSON, so a name given twice in that text is as ambiguous as one in the body.
READ_FROM_TEXT = ("arguments", "deadline_seconds")


def _endpoint_class() -> type[MCPEndpoint]:
    from kazma.bot.console.mcp import MCPEndpoint

    return MCPEndpoint


class MCPDoor:
    """The ``/mcp`` route and the SDK endpoint behind it, made at most once per web server start."""

    def __init__(self, api: ApprovalsApi) -> None:
        self.api = api
        self.stopping = asyncio.Event()  # set as the web server shuts down: open calls withdraw and answer
        self._starting: asyncio.Task[MCPEndpoint] | None = None

    @property
    def configured(self) -> bool:
        """Somebody can call ``/mcp``: an API token exists."""
        return bool(self.api.config.api.tokens)

    @property
    def started(self) -> bool:
        """The SDK's session manager runs (its start finished and did not fail, and it has not ended since)."""
        task = self._starting
        return (
            task is not None
            and task.done()
            and not task.cancelled()
            and task.exception() is None
            and task.result().running
        )

    def health(self) -> str | None:
        """``/healthz``'s line for ``/mcp``, or None when nobody can call it (no API token: the SDK never loads).

        Said, never a 503: approvals are still decided, and the next ``/mcp`` call starts an endpoint that is not
        running again. Before, a monitor saw "ok" while every MCP client's call waited on a start that kept failing.
        """
        if not self.configured:
            return None
        task = self._starting
        if task is None or not task.done():
            return "mcp: starting"
        if task.cancelled():
            return "mcp: not running (its start was cancelled): the next /mcp call starts it"
        error = task.exception()
        if error is not None:
            said = " ".join((str(error) or type(error).__name__).split())[:200]
            return f"mcp: not running (its start failed: {said}): the next /mcp call tries again"
        endpoint = task.result()
        if endpoint.running:
            return "mcp: serving"
        ended = " ".join((endpoint.ended_by or "stopped").split())[:200]
        return f"mcp: not running (its session manager ended: {ended}): the next /mcp call starts it again"

    def register(self, application: web.Application) -> None:
        application.on_startup.append(self._on_startup)
        application.on_shutdown.append(self._on_shutdown)
        application.on_cleanup.append(self._on_cleanup)
        application.router.add_route("*", "/mcp", self.handle)

    def _endpoint(self) -> asyncio.Task[MCPEndpoint]:
        """The endpoint's start, begun now unless it is under way or done (one that failed, or whose session
        manager has ended since, is started again: the SDK's manager runs once per instance)."""
        task = self._starting
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = self._starting = asyncio.create_task(self._start(), name="kazma-mcp-start")
        elif task.done() and not task.result().running:
            ended = task.result()
            task = self._starting = asyncio.create_task(self._start(ended), name="kazma-mcp-start")
        return task

    async def _start(self, ended: MCPEndpoint | None = None) -> MCPEndpoint:
        if ended is not None:
            await ended.stop()  # its manager's task is over: nothing waits
            log.warning("mcp.endpoint_restarting")
        try:
            endpoint_class = await asyncio.to_thread(_endpoint_class)
            endpoint = endpoint_class(self.api, self.stopping)
            await endpoint.start()
        except Exception as exc:
            count_failure("mcp_endpoint")
            log.warning("mcp.endpoint_start_failed", error=str(exc) or type(exc).__name__)
            raise
        log.info("mcp.endpoint_started")
        return endpoint

    async def _on_startup(self, _: web.Application) -> None:
        self.stopping.clear()
        if self.configured:  # in the background: the web server (and Kazma) is ready without waiting for it
            self._endpoint()

    async def _on_shutdown(self, _: web.Application) -> None:
        self.stopping.set()  # before the server waits for open calls: each withdraws its request and answers

    async def _on_cleanup(self, _: web.Application) -> None:
        task, self._starting = self._starting, None
        if task is None:
            return
        if not task.done():
            task.cancel()
        try:
            endpoint = await task
        except (Exception, asyncio.CancelledError):
            return  # never started: nothing runs
        await endpoint.stop()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        caller = caller_of(self.api.config, request)  # 401 before anything reaches (or loads) the SDK
        if request.method == "GET":
            # Stateless, answering in JSON, /mcp has no stream of its own to offer; the SDK held such a GET open
            # for good (a client gone was found only by its next ping, ~15 s later, logged as an error). Refused
            # as the MCP specification allows, before the SDK is loaded.
            raise web.HTTPMethodNotAllowed(
                request.method,
                ["POST"],
                text=json.dumps({"error": "/mcp offers no event stream: send JSON-RPC messages with POST"}),
                content_type="application/json",
            )
        problem = ambiguity(await request.read(), read_from_text=READ_FROM_TEXT)
        if problem is not None:
            # The SDK's parser keeps the last of a name given twice, where the client's own may have acted on the
            # first: the card would show another call than the one the client meant. Refused as /api/v1 refuses
            # it, in JSON-RPC's words, before the SDK (the body is read whole here as the bridge reads it anyway).
            log.warning("mcp.body_ambiguous", token=caller.name, problem=problem[:200])
            refused = {"jsonrpc": "2.0", "id": None, "error": {"code": _INVALID_REQUEST, "message": problem}}
            raise web.HTTPBadRequest(text=json.dumps(refused), content_type="application/json")
        try:
            endpoint = await asyncio.shield(self._endpoint())
        except Exception:
            raise web.HTTPServiceUnavailable(text="the MCP endpoint could not start; see Kazma's log") from None
        return await endpoint.handle(request, caller)
