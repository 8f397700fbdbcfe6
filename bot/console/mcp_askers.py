"""Who waits on an ``/mcp`` call, and how Kazma tells that they went away.

``/mcp`` is stateless streamable HTTP: each call is one HTTP request, and its
asker waits on that request's connection. The asker is gone when the
connection closes (aiohttp cancels no handler when its client goes away; it
only drops the transport, so it is looked at every :data:`CONNECTION_CHECK`
seconds), when this web server stops, or when the client cancels the call.

A cancel is a separate POST (``notifications/cancelled`` naming the JSON-RPC id
of the call, on the MCP versions where the frame, not a disconnect, is the
signal), which a stateless server cannot route to the call it names. It is
matched here by the token, the client's address and that id, and acted on only
when exactly one open call matches: a mismatch could only withdraw a call (which
fails safe: nothing runs), never approve one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import structlog
from aiohttp import web

from kazma.approvals.withdrawal import Gone
from kazma.config.waits import until_set

log = structlog.get_logger("kazma.mcp_server")

CONNECTION_CHECK = 0.25  # seconds between looks at an open call's connection
CallKey = tuple[str, str, str]  # token name, client address, JSON-RPC id (as JSON)


class ConnectionAsker:
    """The asker of one /mcp call: gone when its HTTP connection closes, its call is cancelled, or this web
    server stops."""

    def __init__(self, request: web.Request, stopping: asyncio.Event, stopped: Gone) -> None:
        self.request = request
        self.stopping = stopping
        self.stopped = stopped  # what a stop of this process means for the asker (a replica's or Kazma's)
        self._cancelled = asyncio.Event()

    def cancel(self) -> None:
        """The client cancelled this call (``notifications/cancelled``)."""
        self._cancelled.set()

    def why(self) -> Gone | None:
        """Why the asker is gone now, or None while it is there."""
        if self.stopping.is_set():
            return self.stopped
        if self._cancelled.is_set():
            return Gone.CANCELLED
        transport = self.request.transport
        if transport is None or transport.is_closing():
            return Gone.DISCONNECTED
        return None

    async def gone(self) -> Gone:
        """Return once the asker is gone, with why."""
        while (why := self.why()) is None:
            await until_set(self._cancelled, CONNECTION_CHECK)
        return why


def jsonrpc(body: bytes) -> dict[str, Any] | None:
    """The one JSON-RPC message ``body`` holds, or None (not JSON, a batch, not an object)."""
    try:
        message = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested past the parser's stack
        return None
    return message if isinstance(message, dict) else None


class OpenCalls:
    """The tool calls open on this process's /mcp, by who made them, for cancellations to find."""

    def __init__(self) -> None:
        self._open: dict[CallKey, list[ConnectionAsker]] = {}

    @staticmethod
    def key(token: str, request: web.Request, call_id: Any) -> CallKey:
        return (token, request.remote or "", json.dumps(call_id, sort_keys=True))

    @contextlib.contextmanager
    def holding(
        self, token: str, request: web.Request, message: dict[str, Any] | None, asker: ConnectionAsker
    ) -> Iterator[None]:
        """While the call in ``message`` (a ``tools/call``) is open, a cancellation naming it finds ``asker``."""
        if message is None or message.get("method") != "tools/call" or "id" not in message:
            yield
            return
        key = self.key(token, request, message["id"])
        self._open.setdefault(key, []).append(asker)
        try:
            yield
        finally:
            held = self._open.get(key, [])
            with contextlib.suppress(ValueError):
                held.remove(asker)
            if not held:
                self._open.pop(key, None)

    def cancelled(self, token: str, request: web.Request, message: dict[str, Any] | None) -> None:
        """``message`` is a ``notifications/cancelled``: the one open call it names is cancelled."""
        if message is None or message.get("method") != "notifications/cancelled":
            return
        params = message.get("params")
        if not isinstance(params, dict) or "requestId" not in params:
            return
        held = self._open.get(self.key(token, request, params["requestId"]), [])
        if len(held) != 1:
            log.info("mcp.cancel_unmatched", token=token, calls=len(held))
            return
        held[0].cancel()
