"""``kazma mcp serve``: the MCP door on stdio, forwarding each ``request_approval`` to a running Kazma.

It speaks stdio to a local client and asks Kazma's approvals API over HTTP
(``KAZMA_API_TOKEN``), so it holds no store and no platform of its own; the
tool itself is the web server's (:func:`kazma.bot.console.mcp.build_server`).
What it forwarded is withdrawn when its client closes stdin or cancels the
call, or when it is interrupted (SIGINT, SIGTERM); Kazma withdraws it itself
when this process stops asking (killed outright).
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import sys
from typing import Any

import anyio
import structlog
from mcp.server.mcpserver.exceptions import ToolError

from kazma.approvals.withdrawal import Gone
from kazma.bot.console.mcp_tool import Asked, answer, build_server

log = structlog.get_logger("kazma.mcp_server")
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

    async def ask(asked: Asked) -> dict[str, Any]:
        current = asyncio.current_task()
        assert current is not None
        asking.add(current)
        try:
            async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=90, trust_env=False) as client:
                # Kazma-Wait: this process waits and keeps asking; Kazma withdraws the request if it stops.
                opened = await client.post("/api/v1/approvals", json=asked.body(), headers={"Kazma-Wait": "sync"})
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
