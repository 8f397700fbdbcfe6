"""The one tool Kazma offers as an MCP server, ``request_approval``, shared by both of its doors.

``/mcp`` on the web server (:mod:`kazma.bot.console.mcp`) answers it in this
process; ``kazma mcp serve`` (:mod:`kazma.bot.cli.mcp_stdio`) forwards it to a
running Kazma's approvals API. Each door supplies only how to ask: the tool's
name, arguments, instructions and answer are defined once, here. This module
imports the SDK (about a second): it is imported only where a door is opened.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from mcp.server.mcpserver import Context, MCPServer

INSTRUCTIONS = (
    "Call request_approval before any action a person must approve. It shows the exact call (tool name and "
    "arguments) on an approval card on every platform Kazma serves and returns once a person decided or the "
    "deadline passed. Run the action only when outcome is 'approved', with exactly the arguments you sent "
    "(their SHA-256 is returned as hash)."
)


@dataclass(frozen=True)
class Asked:
    """One ``request_approval`` call, as a door receives it."""

    tool: str
    arguments: dict[str, Any]
    reason: str
    deadline: float | None
    context: Any  # the SDK's request context (the /mcp door reads the HTTP request from it)

    def body(self) -> dict[str, Any]:
        """The approvals API's request body for this call."""
        body: dict[str, Any] = {"tool": self.tool, "arguments": self.arguments}
        if self.reason:
            body["reason"] = self.reason
        if self.deadline is not None:
            body["deadline_seconds"] = self.deadline
        return body


Ask = Callable[[Asked], Awaitable[dict[str, Any]]]


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
        """Ask a person to approve one call; returns outcome, decided_by, decided_person, decided_at, hash and
        request_id."""
        return await ask(Asked(tool, arguments, reason, deadline_seconds, ctx))

    server.add_tool(request_approval)
    return server


def answer(found: dict[str, Any]) -> dict[str, Any]:
    """The tool's answer, from the approvals API's description of the request."""
    return {
        "outcome": found["status"],
        "decided_by": found.get("decided_by"),
        "decided_person": found.get("decided_person"),
        "decided_at": found.get("decided_at"),
        "hash": found["hash"],
        "request_id": found["id"],
        "link": found.get("link"),
    }
