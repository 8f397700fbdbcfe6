"""The MCP scenario: the approved call is a real MCP server's tool, Kazma its client over stdio.

The lead's tool is ``tracker/create_issue`` of tests/mcp_servers/tracker.py, run by ``kazma run`` in its
sandbox; every call that reaches the server appends one line to the tracker's log, kept where the checker
counts the shell scenario's marker lines (the tool's real effect, counted from outside). Everything else —
the card on Telegram and Discord, the press, the restart, the checker — is the shell scenario's.
"""

from __future__ import annotations

import json
import sys

from tests.chaos.rig import DONE, MARKER, Scenario
from tests.fakes.openai import Completion, FakeToolCall
from tests.mcp_support import TRACKER

TOOL = "tracker__create_issue"  # the model's name for tracker/create_issue (engine/tools/mcp_tools.model_name)


class McpScenario(Scenario):
    tools = '["tracker/*"]'

    def extra_config(self) -> str:
        # the server's log is the marker: inside the workspace root, where the checker looks for it
        folder = self.tmp / "ws" / "tracker"
        folder.mkdir(parents=True, exist_ok=True)
        log = folder / MARKER
        return (
            "mcp_servers:\n"
            f"  tracker: {{command: '{sys.executable}', args: ['{TRACKER}', '{log}'], writable: ['{folder}'],"
            " call_timeout_seconds: 10}\n"
        )

    def lead_script(self) -> tuple[Completion, ...]:
        call = FakeToolCall(TOOL, json.dumps({"title": "chaos", "body": "one issue"}))
        return Completion(tool_calls=(call,)), Completion(content=DONE)

    def ready(self) -> bool:
        # the server connected in every process started so far (a restart starts it again)
        if not self.log.exists():
            return False
        text = self.log.read_text(errors="replace")
        return text.count('"event": "mcp.connected"') >= text.count('"event": "app.started"')
