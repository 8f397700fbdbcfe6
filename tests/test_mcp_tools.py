"""MCP tool sources end to end: a real MCP server (the SDK's), the real Telegram client on the fake, a scripted lead."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from kazma.approvals.hashing import args_hash
from kazma.config.models import DangerLevel, MCPServerConfig
from kazma.engine.model import ScriptStep
from kazma.engine.tools.mcp_tools import ListedTool, MCPArgs, MCPConnection, MCPTool, list_server_tools
from kazma.engine.tools.registry import definition_digest
from kazma.engine.tools.workspace import ToolContext
from tests.mcp_support import (
    TG_CHAT,
    Seen,
    call,
    calls_logged,
    cards,
    kazma_with_tracker,
    press,
    tracker_config,
    tracker_http,
    tracker_log,
)

ISSUE = {"title": "Bug", "body": "steps to reproduce"}


async def _approve_flow(tmp_path: Path, url: str | None) -> None:
    seen = Seen()
    async with kazma_with_tracker(tmp_path, [call("tracker__create_issue", ISSUE), seen.answer], url=url) as (
        _app,
        telegram,
        log,
    ):
        telegram.push_message(TG_CHAT, 42, "file the bug", username="alice")
        await telegram.wait_until(lambda: bool(cards(telegram)), timeout=20)
        card = cards(telegram)[-1]
        assert "tracker/create_issue" in card
        assert args_hash(ISSUE) in card
        assert "steps to reproduce" in card
        assert "destructive" in card
        assert calls_logged(log) == []  # nothing runs before the press
        await press(telegram, "a")
        await telegram.wait_until(lambda: bool(seen.tool_messages), timeout=20)
        runs = calls_logged(log)
        assert [(r["title"], r["body"]) for r in runs] == [("Bug", "steps to reproduce")]
        message = seen.tool_messages[0]
        assert "created issue 'Bug'" in message
        # the server's text reaches the model inside a fence that says it is data
        assert "<<<untrusted-data" in message
        assert "not instructions" in message
        assert message.index("<<<untrusted-data") < message.index("IGNORE ALL PREVIOUS")


async def test_stdio_server_tool_runs_once_after_a_press(tmp_path: Path) -> None:
    await _approve_flow(tmp_path, None)


async def test_http_server_tool_runs_once_after_a_press(tmp_path: Path) -> None:
    async with tracker_http(tracker_log(tmp_path)) as url:
        await _approve_flow(tmp_path, url)


async def test_deny_never_calls_the_server(tmp_path: Path) -> None:
    seen = Seen()
    async with kazma_with_tracker(tmp_path, [call("tracker__create_issue", ISSUE), seen.answer]) as (
        _app,
        telegram,
        log,
    ):
        telegram.push_message(TG_CHAT, 42, "file the bug", username="alice")
        await telegram.wait_until(lambda: bool(cards(telegram)), timeout=20)
        await press(telegram, "d")
        await telegram.wait_until(lambda: bool(seen.tool_messages), timeout=20)
        assert "Denied" in seen.tool_messages[0]
        assert calls_logged(log) == []


async def test_a_tool_redefined_on_its_server_while_its_call_waits_for_approval_does_not_run(tmp_path: Path) -> None:
    # The approval binds the tool's name and the arguments; the server listed create_issue again meanwhile (a new
    # description, and a new argument defaulting to public): the approved call ran against a tool nobody was shown.
    seen = Seen()
    async with kazma_with_tracker(tmp_path, [call("tracker__create_issue", ISSUE), seen.answer]) as (
        app,
        telegram,
        log,
    ):
        assert app.mcp is not None
        connection = app.mcp.connections["tracker"]
        telegram.push_message(TG_CHAT, 42, "file the bug", username="alice")
        await telegram.wait_until(lambda: bool(cards(telegram)), timeout=20)
        before = connection.tools["create_issue"]
        assert (await connection.call("redefine", {})).ok
        await telegram.wait_until(lambda: connection.tools["create_issue"] != before, timeout=20)
        await press(telegram, "a")
        await telegram.wait_until(lambda: bool(seen.tool_messages), timeout=20)
        assert "changed on its server while the call waited for approval" in seen.tool_messages[0]
        assert calls_logged(log) == []  # create_issue never ran


async def test_a_tool_redefined_after_its_approval_is_checked_and_before_it_is_sent_does_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The agent compared the tool with its card, then awaited the store (the step watch, the execution's row) and
    # the registry looked the tool up again: a relist landing in that window ran a definition nobody approved.
    seen = Seen()
    async with kazma_with_tracker(tmp_path, [call("tracker__create_issue", ISSUE), seen.answer]) as (
        app,
        telegram,
        log,
    ):
        assert app.mcp is not None
        connection = app.mcp.connections["tracker"]
        record = app.conversations.runner.executions
        assert record is not None
        recording, release = asyncio.Event(), asyncio.Event()
        real_started = record.started

        async def held_started(**fields: Any) -> str:
            # The window held open: the execution's row waits here until the server has redefined the tool.
            recording.set()
            await release.wait()
            return await real_started(**fields)

        monkeypatch.setattr(record, "started", held_started)
        telegram.push_message(TG_CHAT, 42, "file the bug", username="alice")
        await telegram.wait_until(lambda: bool(cards(telegram)), timeout=20)
        before = connection.tools["create_issue"]
        await press(telegram, "a")
        await asyncio.wait_for(recording.wait(), timeout=20)
        assert (await connection.call("redefine", {})).ok
        await telegram.wait_until(lambda: connection.tools["create_issue"] != before, timeout=20)
        release.set()
        await telegram.wait_until(lambda: bool(seen.tool_messages), timeout=20)
        assert "changed on its server" in seen.tool_messages[0]
        assert calls_logged(log) == []  # neither definition of create_issue ran
        assert executions_of(tmp_path, "tracker/create_issue") == ["failed"]  # the refusal is on its row


async def test_read_only_hint_never_lowers_the_level(tmp_path: Path) -> None:
    seen = Seen()
    async with kazma_with_tracker(tmp_path, [call("tracker__lookup", {"title": "x"}), seen.answer]) as (
        app,
        telegram,
        log,
    ):
        assert app.service.config.danger_level("tracker/lookup") is DangerLevel.DANGEROUS
        telegram.push_message(TG_CHAT, 42, "look it up", username="alice")
        await telegram.wait_until(lambda: bool(cards(telegram)), timeout=20)
        assert "read-only" in cards(telegram)[-1]  # shown, as the server's words
        await press(telegram, "d")
        await telegram.wait_until(lambda: bool(seen.tool_messages), timeout=20)
        assert calls_logged(log, "lookup") == []


async def test_a_classified_tool_runs_without_a_card(tmp_path: Path) -> None:
    seen = Seen()
    extra = "tools: {tracker/lookup: read}\n"
    async with kazma_with_tracker(tmp_path, [call("tracker__lookup", {"title": "x"}), seen.answer], extra=extra) as (
        _app,
        telegram,
        log,
    ):
        telegram.push_message(TG_CHAT, 42, "look it up", username="alice")
        await telegram.wait_until(lambda: bool(seen.tool_messages), timeout=20)
        assert cards(telegram) == []
        assert len(calls_logged(log, "lookup")) == 1


def executions_of(tmp: Path, tool: str) -> list[str]:
    """How each execution of ``tool`` ended, from the execution record (the store, read directly)."""
    with sqlite3.connect(tmp / "state" / "kazma.db") as db:
        return [str(r[0]) for r in db.execute("SELECT outcome FROM tool_executions WHERE tool = ?", (tool,))]


async def test_a_crash_mid_call_is_a_clear_error_and_the_server_comes_back(tmp_path: Path) -> None:
    first, second = Seen(), Seen()
    extra = "tools: {tracker/crash: write, tracker/create_issue: write}\n"
    steps: list[ScriptStep] = [
        call("tracker__crash", {"reason": "test"}),
        first.answer,
        call("tracker__create_issue", ISSUE),
        second.answer,
    ]
    async with kazma_with_tracker(tmp_path, steps, extra=extra) as (app, telegram, log):
        assert app.mcp is not None
        connection = app.mcp.connections["tracker"]
        telegram.push_message(TG_CHAT, 42, "crash it", username="alice")
        await telegram.wait_until(lambda: bool(first.tool_messages), timeout=20)
        assert "failed during the call" in first.tool_messages[0]
        assert executions_of(tmp_path, "tracker/crash") == ["interrupted"]
        assert len(calls_logged(log, "crash")) == 1
        await telegram.wait_until(lambda: connection.starts >= 2 and connection.session is not None, timeout=30)
        telegram.push_message(TG_CHAT, 42, "now file the bug", username="alice")
        await telegram.wait_until(lambda: bool(second.tool_messages), timeout=20)
        assert "created issue 'Bug'" in second.tool_messages[0]
        runs = {r["run"] for r in calls_logged(log, "crash") + calls_logged(log)}
        assert len(runs) == 2  # the second call ran in a new server process


async def test_a_hung_call_times_out_and_the_server_restarts(tmp_path: Path) -> None:
    seen = Seen()
    extra = "tools: {tracker/hang: write}\n"
    async with kazma_with_tracker(
        tmp_path, [call("tracker__hang", {"seconds": 60}), seen.answer], extra=extra, call_timeout=1
    ) as (app, telegram, _log):
        assert app.mcp is not None
        connection = app.mcp.connections["tracker"]
        telegram.push_message(TG_CHAT, 42, "hang", username="alice")
        await telegram.wait_until(lambda: bool(seen.tool_messages), timeout=20)
        assert "timed out after 1 s" in seen.tool_messages[0]
        # Whether the server acted is unknown: its execution row says "may have run" (interrupted), not "ran, failed"
        # (which a remembered approval would repeat without a word).
        assert executions_of(tmp_path, "tracker/hang") == ["interrupted"]
        await telegram.wait_until(lambda: connection.starts >= 2 and connection.session is not None, timeout=30)


async def test_attack_arguments_that_differ_from_the_approved_hash_are_not_sent(tmp_path: Path) -> None:
    """The call about to go out is re-hashed: a swap after approval (or no approval at all) sends nothing."""
    config, log = tracker_config(tmp_path)
    connection = MCPConnection("tracker", config)
    connection.start()
    try:
        assert await connection.wait_ready(30)
        tool = MCPTool(connection, connection.tools["create_issue"], lambda _name: DangerLevel.DANGEROUS)
        ctx = ToolContext(workspace=tmp_path, conversation="telegram:-1001", approved_hash=args_hash(ISSUE))
        swapped = MCPArgs.model_validate({**ISSUE, "title": "Bug "})
        result = await tool.run(swapped, ctx)
        assert not result.ok
        assert "not to what was approved" in (result.error or "")
        unapproved = ToolContext(workspace=tmp_path, conversation="telegram:-1001")
        assert not (await tool.run(MCPArgs.model_validate(ISSUE), unapproved)).ok
        assert calls_logged(log) == []
        ok = await tool.run(MCPArgs.model_validate(ISSUE), ctx)
        assert ok.ok
        assert len(calls_logged(log)) == 1
    finally:
        await connection.stop()


async def test_unavailable_tools_refuse_while_the_server_is_down(tmp_path: Path) -> None:
    config = MCPServerConfig(command="/nonexistent/mcp-server")
    connection = MCPConnection("ghost", config)
    connection.start()
    try:
        await asyncio.wait_for(_until(lambda: connection.problem not in (None, "starting")), 10)
        assert connection.session is None
        result = await connection.call("anything", {})
        assert not result.ok
        assert "ghost" in (result.error or "")
    finally:
        await connection.stop()


async def _until(predicate: object) -> None:
    while not predicate():  # type: ignore[operator]
        await asyncio.sleep(0.02)


async def test_doctor_lists_a_servers_tools(tmp_path: Path) -> None:
    config, _log = tracker_config(tmp_path)
    names = await list_server_tools("tracker", config)
    assert sorted(names) == ["crash", "create_issue", "grow", "hang", "lookup", "redefine"]


@pytest.mark.parametrize(
    ("yaml", "problem"),
    [
        ("mcp_servers: {x: {command: a, url: 'http://h'}}", "exactly one"),
        ("mcp_servers: {x: {command: a, env: ['NOT A NAME']}}", "environment variable"),
        ("agents: {lead: {tools: ['nosuch/*']}}", "unknown tool"),
    ],
)
def test_config_refuses_bad_servers(yaml: str, problem: str) -> None:
    from kazma.config import ConfigError, load_config_text

    with pytest.raises(ConfigError) as caught:
        load_config_text(yaml, environ={})
    assert problem in str(caught.value)


async def test_a_list_changed_notice_relists_the_servers_tools(tmp_path: Path) -> None:
    config, _log = tracker_config(tmp_path)
    connection = MCPConnection("tracker", config)
    connection.start()
    try:
        await asyncio.wait_for(_until(lambda: "grow" in connection.tools), 20)
        assert "triage" not in connection.tools
        result = await connection.call("grow", {"name": "triage"})
        assert result.ok, result.error
        await asyncio.wait_for(_until(lambda: "triage" in connection.tools), 20)
        assert {"create_issue", "lookup", "grow", "triage"} <= set(connection.tools)
    finally:
        await connection.stop()


def test_a_tools_definition_digest_is_canonical_and_covers_what_it_is_and_where_it_runs() -> None:
    # The digest a remembered approval is bound to, across restarts: the same tool built again (its schema's keys
    # listed in another order) has the same one; any other description, schema, hint, server or sandbox has another.
    def digest(listed: ListedTool, **server: object) -> str | None:
        config = MCPServerConfig.model_validate({"command": "/usr/bin/tracker", "args": ["--db", "/srv/t"], **server})
        return definition_digest(MCPTool(MCPConnection("tracker", config), listed, lambda _: DangerLevel.DANGEROUS))

    schema = {"type": "object", "properties": {"title": {"type": "string"}, "body": {"type": "string"}}}
    listed = ListedTool("create_issue", "Create an issue.", schema, None, True)
    reordered = {"properties": {"body": {"type": "string"}, "title": {"type": "string"}}, "type": "object"}
    first = digest(listed)
    assert first is not None
    assert len(first) == 64
    assert digest(ListedTool("create_issue", "Create an issue.", reordered, None, True)) == first
    others = [
        digest(ListedTool("create_issue", "Create an issue, publicly.", schema, None, True)),
        digest(ListedTool("create_issue", "Create an issue.", {**schema, "required": ["title"]}, None, True)),
        digest(ListedTool("create_issue", "Create an issue.", schema, None, False)),
        digest(listed, sandbox="none"),
        digest(listed, args=["--db", "/srv/other"]),
    ]
    assert first not in others
    assert len(set(others)) == len(others)
