"""A clean stop while a tool runs: its execution row says "may have run" before the store closes. The call still
running was cancelled only after the store had closed (the turns are cancelled when the event loop ends), too
late to write its own ending, so its row read "running" until the next start (the chaos cells tools.started=hang
and tools.finished=hang, stopped with SIGTERM)."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from kazma.adapters.contract import Inbound
from kazma.adapters.web import CONSOLE
from kazma.bot.app import build_app
from kazma.config import failpoints, load_config_text
from kazma.engine.model import ScriptedProvider
from kazma.engine.types import ModelReply, ToolCall


@pytest.fixture
def disarmed() -> Iterator[None]:
    yield
    failpoints.disarm()


def _rows(db: Path) -> list[tuple[str, str | None]]:
    if not db.exists():
        return []
    conn = sqlite3.connect(db)
    try:
        return [(str(r[0]), r[1]) for r in conn.execute("SELECT tool, outcome FROM tool_executions")]
    except sqlite3.OperationalError:  # not migrated yet
        return []
    finally:
        conn.close()


async def test_a_tool_running_at_a_clean_stop_ends_interrupted_before_the_store_closes(
    tmp_path: Path, disarmed: None
) -> None:
    db = tmp_path / "state" / "kazma.db"
    (tmp_path / "notes.txt").write_text("x")
    config = f"""
store: {{path: '{db}'}}
approvals: {{approvers: ["web:alice"]}}
tools: {{workspace_root: '{tmp_path / "ws"}'}}
agents:
  lead: {{name: kazma, tools: [read_file]}}
"""
    call = ToolCall("c1", "read_file", {"path": "notes.txt"})
    provider = ScriptedProvider([ModelReply(content=None, tool_calls=(call,)), ModelReply(content="done")])
    app = await build_app(load_config_text(config, environ={}), provider=provider, adapters=[])
    failpoints.arm_for_test("tools.started=hang")  # the row is written, and the call never returns
    try:
        await app.on_inbound(
            Inbound(platform="web", chat=CONSOLE, message_id="1", author="web:alice", author_name="alice", text="read")
        )
        loop = asyncio.get_running_loop()
        end = loop.time() + 30
        while _rows(db) != [("read_file", None)]:
            assert loop.time() < end, f"the execution never started: {_rows(db)}"
            await asyncio.sleep(0.05)
    finally:
        await app.stop()
    assert _rows(db) == [("read_file", "interrupted")]
