"""A built-in tool runs exactly the call its card showed: the arguments a person approved are the arguments that run.

Attacked: a ``write_file`` path shown as the model wrote it (``notes/``, ``a/../b``) but written somewhere the card
never named; a ``shell`` timeout shown as the text ``"5"`` (or ``true``) and run as a number; a default (``timeout_s``
60) that applies without being on the card or under its hash; arguments that change between approval and run.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from kazma.approvals import SafetyPolicy
from kazma.approvals.hashing import args_hash
from kazma.approvals.model import ApprovalRequest, Decision
from kazma.config.models import DangerLevel
from kazma.config.store.database import open_database
from kazma.engine.agent import AgentRunner, AgentSpec, workspace_for
from kazma.engine.history import MIGRATIONS as HISTORY
from kazma.engine.history import HistoryStore
from kazma.engine.model import ScriptedProvider, ScriptStep
from kazma.engine.tools.builtin import default_registry
from kazma.engine.tools.mcp_tools import MCPConnection, MCPTool
from kazma.engine.tools.registry import ToolRegistry, ToolResult
from kazma.engine.tools.sandbox import resolve_sandbox
from kazma.engine.tools.shell import ShellTool
from kazma.engine.tools.workspace import ToolContext
from kazma.engine.types import ModelReply, ToolCall
from tests.approvals_support import RecordingPublisher, approval_service
from tests.mcp_support import TG_ADMIN, TG_CHAT, Seen, calls_logged, kazma_with_tracker, tracker_config
from tests.mcp_support import call as mcp_call
from tests.test_e2e_plans import ALICE, CHAT, kazma
from tests.test_e2e_plans import call as e2e_call

BUILDER = AgentSpec("builder", "You build.", ("shell", "read_file", "write_file"))
CONVERSATION = "telegram:-100"


def _call(name: str, args: dict[str, Any]) -> ToolCall:
    return ToolCall(f"id-{name}", name, args, json.dumps(args))


class _SwappingRegistry(ToolRegistry):
    """Changes a call's command on its way from the approval to the tool: whatever changes the arguments there
    (a bug, a shared dict) must meet a check, not a run."""

    async def execute(self, name: str, arguments: Mapping[str, Any], ctx: ToolContext) -> ToolResult:
        return await super().execute(name, {**arguments, "command": "echo swapped"}, ctx)


@asynccontextmanager
async def _runner(
    tmp_path: Path, script: list[ScriptStep], registry: ToolRegistry | None = None
) -> AsyncIterator[AgentRunner]:
    conn = await open_database(tmp_path / "h.db", migrations=HISTORY)
    publisher = RecordingPublisher()
    tools = registry or default_registry(sandbox=resolve_sandbox("none"))
    async with approval_service(tmp_path / "a.db", publisher=publisher, poll_interval=0.02) as service:
        try:
            yield AgentRunner(
                ScriptedProvider(script), tools, SafetyPolicy(service), HistoryStore(conn),
                workspace_root=tmp_path / "ws",
            )  # fmt: skip
        finally:
            await conn.close()


def _fed(r: AgentRunner) -> list[str]:
    provider = r.provider
    assert isinstance(provider, ScriptedProvider)
    return [str(m["content"]) for m in provider.requests[-1].messages if m["role"] == "tool"]


async def _approve_each(r: AgentRunner, turn: asyncio.Task[Any]) -> list[ApprovalRequest]:
    """Approve every card the turn opens until it ends; the requests approved, as they were stored."""
    service = r.policy.service
    approved: list[ApprovalRequest] = []
    async with asyncio.timeout(20):
        while not turn.done():
            pending = await service.store.requests(pending_only=True)
            for request in pending:
                await service.decide(request.id, Decision.APPROVE, actor="web:admin", platform="web")
                approved.append(request)
            if not pending:
                await asyncio.wait({turn}, timeout=0.02)
    await turn
    return approved


async def _turn(r: AgentRunner) -> tuple[list[ApprovalRequest], list[str]]:
    turn = asyncio.create_task(r.run(BUILDER, CONVERSATION, "do it", requested_by="telegram:111"))
    approved = await _approve_each(r, turn)
    return approved, _fed(r)


@pytest.mark.parametrize(
    ("path", "said"),
    [("notes/", "write 'notes'"), ("a/../b.txt", "contains '..'"), ("./c.txt", "write 'c.txt'"),
     ("d//e.txt", "write 'd/e.txt'"), ("/d//e.txt", "write '/d/e.txt'"),
     # a card shows a trailing blank as nothing at all, and a line break as a second line
     ("notes.txt ", "blank space"), ("d /e.txt", "blank space"), ("\u00a0e.txt", "blank space"),
     ("a.txt\nb.txt", "control character")],
)  # fmt: skip
async def test_a_write_file_path_not_in_normal_form_is_refused_before_any_card(
    tmp_path: Path, path: str, said: str
) -> None:
    # The card would show the path as sent while the file written is another name: "notes/" wrote "notes".
    script: list[ScriptStep] = [
        ModelReply(content=None, tool_calls=(_call("write_file", {"path": path, "content": "x"}),)),
        ModelReply(content="ok"),
    ]
    async with _runner(tmp_path, script) as r:
        approved, fed = await _turn(r)
        assert approved == []  # nobody was asked to approve a path that would not run as shown
        ws = workspace_for(tmp_path / "ws", CONVERSATION)
        assert not ws.exists() or list(ws.iterdir()) == []
        (answer,) = fed
        assert answer.startswith("Error: the call to write_file was not run: invalid arguments for write_file: path:")
        assert said in answer  # the model is told how to write it


async def test_a_write_file_path_in_normal_form_writes_the_file_the_card_named(tmp_path: Path) -> None:
    script: list[ScriptStep] = [
        ModelReply(content=None, tool_calls=(_call("write_file", {"path": "d/e.txt", "content": "x"}),)),
        ModelReply(content="ok"),
    ]
    async with _runner(tmp_path, script) as r:
        (request,), _ = await _turn(r)
        assert request.args == {"path": "d/e.txt", "content": "x"}
        assert (workspace_for(tmp_path / "ws", CONVERSATION) / "d" / "e.txt").read_text() == "x"


@pytest.mark.parametrize("timeout", ["5", True, 5.0, "60"])
async def test_a_shell_timeout_of_the_wrong_type_is_refused_not_coerced_after_the_card(
    tmp_path: Path, timeout: object
) -> None:
    # Lax validation turned the "5" the card showed into 5 after hashing (and true into 1).
    script: list[ScriptStep] = [
        ModelReply(content=None, tool_calls=(_call("shell", {"command": "echo ran", "timeout_s": timeout}),)),
        ModelReply(content="ok"),
    ]
    async with _runner(tmp_path, script) as r:
        approved, fed = await _turn(r)
        assert approved == []
        (answer,) = fed
        assert answer.startswith("Error: the call to shell was not run: invalid arguments for shell: timeout_s:")
        assert "valid integer" in answer


async def test_the_default_timeout_is_on_the_card_and_under_its_hash(tmp_path: Path) -> None:
    script: list[ScriptStep] = [
        ModelReply(content=None, tool_calls=(_call("shell", {"command": "echo ran"}),)),
        ModelReply(content="ok"),
    ]
    async with _runner(tmp_path, script) as r:
        (request,), fed = await _turn(r)
        shown = {"command": "echo ran", "timeout_s": 60}
        assert request.args == shown
        assert request.args_hash == args_hash(shown)
        publisher = r.policy.service.publisher
        assert isinstance(publisher, RecordingPublisher)
        assert [a.name for a in publisher.published[0].arguments] == ["command", "timeout_s"]
        (answer,) = fed
        assert "ran" in answer
        assert "exit code 0" in answer


async def test_arguments_that_differ_from_the_approved_hash_do_not_run(tmp_path: Path) -> None:
    # The agent hands the registry the hash a person approved; what is about to run is hashed again against it.
    registry = default_registry(sandbox=resolve_sandbox("none"))
    ws = tmp_path / "ws"
    approved = args_hash({"path": "a.txt", "content": "x"})
    ctx = ToolContext(ws, CONVERSATION, approved_hash=approved)
    result = await registry.execute("write_file", {"path": "b.txt", "content": "x"}, ctx)
    assert not result.ok
    assert result.error is not None
    assert "approved" in result.error
    assert not (ws / "b.txt").exists()
    same = await registry.execute("write_file", {"path": "a.txt", "content": "x"}, ctx)
    assert same.ok, same.error
    assert (ws / "a.txt").read_text() == "x"


async def test_arguments_changed_between_the_approval_and_the_run_are_refused(tmp_path: Path) -> None:
    script: list[ScriptStep] = [
        ModelReply(content=None, tool_calls=(_call("shell", {"command": "echo approved", "timeout_s": 5}),)),
        ModelReply(content="ok"),
    ]
    registry = _SwappingRegistry([ShellTool(sandbox=resolve_sandbox("none"))])
    async with _runner(tmp_path, script, registry) as r:
        (request,), fed = await _turn(r)
        assert request.args == {"command": "echo approved", "timeout_s": 5}
        (answer,) = fed
        assert "not to what was approved" in answer
        assert "swapped\n" not in answer


async def test_a_default_left_out_of_the_approved_arguments_does_not_run_unshown(tmp_path: Path) -> None:
    # Approved without timeout_s, a call would still run for 60 s: a default nobody was shown.
    registry = default_registry(sandbox=resolve_sandbox("none"))
    ctx = ToolContext(tmp_path / "ws", CONVERSATION, approved_hash=args_hash({"command": "echo ran"}))
    result = await registry.execute("shell", {"command": "echo ran"}, ctx)
    assert not result.ok
    assert "ran\n" not in result.output


async def test_the_leads_dispatch_swarm_card_shows_the_call_as_it_starts(tmp_path: Path) -> None:
    # deadline_seconds true was shown as "true" and started a task with a deadline of 1 s; the aggregation,
    # deadline and options that applied by default were on no card.
    bad = {"pattern": "dispatch", "task": "say hi", "workers": ["builder"], "deadline_seconds": True}
    good = {"pattern": "dispatch", "task": "say hi", "workers": ["builder"]}
    scripts: dict[str, list[ScriptStep]] = {
        "kazma": [e2e_call("dispatch_swarm", bad), e2e_call("dispatch_swarm", good), ModelReply(content="Asked.")],
        "builder": [ModelReply(content="Said hi.")],
    }
    async with kazma(tmp_path, scripts) as (app, fake):
        fake.push_message(CHAT, ALICE, "@kazma have the builder say hi", username="alice")
        shown: list[dict[str, Any]] = []
        async with asyncio.timeout(30):
            while not any("Asked." in m.text for m in fake.bot_messages(CHAT)):
                for request in await app.service.store.requests(pending_only=True):  # every card denied: none hangs
                    shown.append(request.args)
                    await app.service.decide(request.id, Decision.DENY, actor="telegram:111", platform="telegram")
                await asyncio.sleep(0.02)
        assert shown == [
            {**good, "preset": None, "aggregation": "collect", "routes": {}, "expect": None, "deadline_seconds": None,
             "context": ""},
        ]  # fmt: skip


async def test_an_mcp_calls_card_says_which_server_defaults_apply_to_what_was_not_sent(tmp_path: Path) -> None:
    # Sent as shown (the server applies its own defaults, Kazma does not fill them in), but not unsaid: the
    # redefined create_issue files issues publicly unless "public" is sent.
    config, _log = tracker_config(tmp_path)
    connection = MCPConnection("tracker", config)
    connection.start()
    try:
        assert await connection.wait_ready(30)
        registry = ToolRegistry(
            [MCPTool(connection, connection.tools["create_issue"], lambda _n: DangerLevel.DANGEROUS)]
        )
        assert registry.call_notes("tracker/create_issue", {"title": "Bug"}) == (
            'Not sent, so the server\'s own defaults apply (as its schema declares them): body = "".',
        )
        assert registry.call_notes("tracker/create_issue", {"title": "Bug", "body": "x"}) == ()
        assert default_registry().call_notes("shell", {"command": "ls"}) == ()  # filled in before its card instead
    finally:
        await connection.stop()


async def test_the_card_of_an_mcp_call_carries_the_servers_defaults(tmp_path: Path) -> None:
    seen = Seen()
    steps: list[ScriptStep] = [mcp_call("tracker__create_issue", {"title": "Bug"}), seen.answer]
    async with kazma_with_tracker(tmp_path, steps) as (app, telegram, log):
        telegram.push_message(TG_CHAT, 42, "file it", username="alice")
        async with asyncio.timeout(20):
            while not (pending := await app.service.store.requests(pending_only=True)):
                await asyncio.sleep(0.02)
        [request] = pending
        await app.service.decide(request.id, Decision.DENY, actor=f"telegram:{TG_ADMIN}", platform="telegram")
        assert request.args == {"title": "Bug"}  # sent as shown: the server fills in its own
        assert 'Not sent, so the server\'s own defaults apply (as its schema declares them): body = "".' in (
            request.notes
        )
        await telegram.wait_until(lambda: bool(seen.tool_messages), timeout=20)
        assert calls_logged(log) == []
