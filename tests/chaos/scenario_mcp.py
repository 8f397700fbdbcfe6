"""The MCP scenario: the approved call is a real MCP server's tool, Kazma its client over stdio.

The lead's tool is ``tracker/create_issue`` of tests/mcp_servers/tracker.py, run by ``kazma run`` in its
sandbox; every call that reaches the server appends one line to the tracker's log, kept where the checker
counts the shell scenario's marker lines (the tool's real effect, counted from outside). Everything else —
the card on Telegram and Discord, the press, the restart, the checker — is the approval scenario's
(:mod:`tests.chaos.rig`, :func:`tests.chaos.checker.judge`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.chaos.rig import DONE, MARKER, History, Rig, _drive_approval, fakes, history, observe, run_restarting
from tests.chaos.scenario import Cell
from tests.fakes.openai import Completion, FakeToolCall
from tests.mcp_support import TRACKER

TOOL = "tracker__create_issue"  # the model's name for tracker/create_issue (engine/tools/mcp_tools.model_name)


def _server(tmp: Path) -> str:
    # the server's log is the marker: inside the workspace root, where the checker looks for it
    folder = tmp / "ws" / "tracker"
    folder.mkdir(parents=True, exist_ok=True)
    return (
        "mcp_servers:\n"
        f"  tracker: {{command: '{sys.executable}', args: ['{TRACKER}', '{folder / MARKER}'], writable: ['{folder}'],"
        " call_timeout_seconds: 10}\n"
    )


def _connected_everywhere(rig: Rig) -> bool:
    """The server connected in every process started so far (a restart starts it again)."""
    if not rig.log.exists():
        return False
    text = rig.log.read_text(errors="replace")
    return text.count('"event": "mcp.connected"') >= text.count('"event": "app.started"')


async def run_mcp_cell(tmp: Path, cell: Cell, dsn: str | None) -> History:
    point, action, store = cell
    s = Rig(tmp, store=store, dsn=dsn, extra=_server(tmp), tools='["tracker/*"]')
    s.ready = lambda: _connected_everywhere(s)
    h = history(tmp, point, action, store, dsn)
    async with fakes(s):
        call = FakeToolCall(TOOL, json.dumps({"title": "chaos", "body": "one issue"}))
        s.model.script(Completion(tool_calls=(call,)), Completion(content=DONE))
        await run_restarting(s, h, f"{point}={action}", _drive_approval)
        observe(s, h)
    return h
