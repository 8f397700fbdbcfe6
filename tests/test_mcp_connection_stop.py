"""Stopping an MCP server's connection ends its supervisor, also when the stop's cancel is lost on the way.

asyncio merges a cancel that lands while an anyio cancel scope's own is pending into that one, and the scope then
swallows it as its own (the SDK's task groups, after an error restart, left the supervisor counting one): the
supervisor went on pinging and ``stop()`` waited for it for ever, hanging Kazma's shutdown.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from mcp import ClientSession

from kazma.config.models import MCPServerConfig
from kazma.engine.tools.mcp_tools import MCPConnection

DEAF = Path(__file__).resolve().parent / "mcp_servers" / "deaf.py"
# Far beyond what a stop takes (its server leaves within seconds): only a stop that does not return reaches it.
HANG_BOUND_S = 30


class LosesOneCancel(MCPConnection):
    """The real connection, whose first ping loses the cancel that reaches it, as the SDK's cancel scope does."""

    def __init__(self, config: MCPServerConfig) -> None:
        super().__init__("deaf", config, ping_interval=0.01)
        self.pinging = asyncio.Event()
        self.lost = asyncio.Event()

    async def _ping(self, session: ClientSession) -> None:
        if self.lost.is_set():
            await super()._ping(session)
            return
        self.pinging.set()
        try:
            await super()._ping(session)
        except asyncio.CancelledError:
            asyncio.current_task().uncancel()  # type: ignore[union-attr]  # the swallowed cancel, uncounted
            self.lost.set()


async def test_stop_ends_the_supervisor_when_its_cancel_is_lost() -> None:
    config = MCPServerConfig(command=sys.executable, args=[str(DEAF)], sandbox="none", call_timeout_seconds=600)
    connection = LosesOneCancel(config)
    connection.start()
    supervisor = connection._task
    assert supervisor is not None
    stopping: asyncio.Task[None] | None = None
    try:
        assert await connection.wait_ready(60), connection.problem
        await connection.pinging.wait()  # a ping in flight, unanswered: the cancel lands in it
        # Waited for without cancelling it (wait_for would cancel stop(), and with it the supervisor once more).
        stopping = asyncio.create_task(connection.stop())
        stopped, _ = await asyncio.wait({stopping}, timeout=HANG_BOUND_S)
        assert stopped, "stop() did not return: the supervisor went on after its cancel was lost"
        assert connection.lost.is_set()
        assert supervisor.done()
        assert connection.session is None
    finally:
        supervisor.cancel()
        if stopping is not None:
            stopping.cancel()
