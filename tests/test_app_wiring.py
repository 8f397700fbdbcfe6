"""The composition root's wiring, seen from outside: what each agent is offered once build_app has made the parts,
and the services the console is handed answering from the same parts the app runs."""

from __future__ import annotations

from pathlib import Path

from kazma.adapters.contract import Inbound
from kazma.adapters.web import CONSOLE
from kazma.approvals.model import Status
from kazma.bot.app import build_app
from kazma.bot.console.services import SwarmCommand
from kazma.config import load_config_text
from kazma.engine.model import ScriptedProvider
from kazma.engine.swarm.types import TaskStatus
from kazma.engine.types import ModelReply

PLAN_TOOLS = ["write_plan", "retry_step", "replace_steps", "skip_step", "abort_plan"]
SWARM_TOOLS = ["dispatch_swarm", "check_swarm_task"]


def _config(tmp_path: Path) -> str:
    return f"""
store: {{path: '{tmp_path / "state" / "kazma.db"}'}}
approvals: {{approvers: ["web:alice"]}}
agents:
  lead: {{name: kazma, system_prompt: "lead prompt", tools: [read_file]}}
  workers:
    builder: {{system_prompt: "builder prompt", tools: [write_file]}}
pipelines: {{standard: [builder]}}
"""


def _said(text: str, *, mentions: tuple[str, ...] = (), message_id: str = "1") -> Inbound:
    return Inbound(
        platform="web",
        chat=CONSOLE,
        message_id=message_id,
        author="web:alice",
        author_name="alice",
        text=text,
        mentions=mentions,
    )


async def test_each_agent_is_offered_its_own_tools_then_its_configured_ones(tmp_path: Path) -> None:
    # The lead's plan and swarm tools and a worker's ask_user start work that runs agents on the same runner:
    # they are made after it, and the runner must still offer them, in this order, at every turn.
    provider = ScriptedProvider([ModelReply(content="lead here"), ModelReply(content="builder here")])
    app = await build_app(load_config_text(_config(tmp_path), environ={}), provider=provider, adapters=[])
    try:
        await app.on_inbound(_said("hello"))
        await app.conversations.drain()
        await app.on_inbound(_said("@builder build", mentions=("builder",), message_id="2"))
        await app.conversations.drain()
    finally:
        await app.stop()
    lead, builder = ([spec.name for spec in request.tools] for request in provider.requests)
    assert lead == [*PLAN_TOOLS, *SWARM_TOOLS, "read_file"]
    assert builder == ["ask_user", "write_file"]


async def test_the_console_services_answer_from_the_parts_the_app_runs(tmp_path: Path) -> None:
    provider = ScriptedProvider([])
    app = await build_app(load_config_text(_config(tmp_path), environ={}), provider=provider, adapters=[])
    services = app.console
    changes: list[str] = []
    stop = services.watch(lambda: changes.append("changed"))
    try:
        assert services.config is app.loaded.config
        assert services.approvals is app.service
        assert not services.replicated
        assert await services.replica_health() is None

        opened = await app.service.open("deploy", {"build": 7}, "agent:kazma", "web:console", deadline=60)
        assert changes, "opening an approval did not reach the console's watcher"
        record = await services.approval_record(opened.id)
        assert record is not None
        assert (record.request.id, record.request.status) == (opened.id, Status.PENDING)
        assert [e.event for e in record.events][:1] == ["opened"]
        assert await services.approval_record("no-such-request-id-000") is None

        reads = await services.dashboard_reads()
        assert [r.id for r in reads.approvals] == [opened.id]
        assert reads.counts == {status.value: 0 for status in TaskStatus}
        assert await services.task_counts() == dict.fromkeys(TaskStatus, 0)

        answer = await services.run_swarm(
            SwarmCommand("status", actor="web:alice", platform="web", chat=CONSOLE, is_admin=True)
        )
        commands = app.conversations.swarm
        assert commands is not None
        assert answer == await commands.run("status", actor="web:alice", platform="web", chat=CONSOLE, is_admin=True)
        assert answer
        assert await services.describe_plans(f"web:{CONSOLE}") == await app.conversations.describe(f"web:{CONSOLE}")

        stop()
        seen = len(changes)
        await app.service.cancel(opened.id, reason="test")
        assert len(changes) == seen, "the console's watcher was still told after it stopped watching"
    finally:
        stop()
        await app.stop()


async def test_the_shell_hides_kazma_yaml_from_its_commands_as_the_mcp_servers_do(tmp_path: Path) -> None:
    # kazma.yaml may hold platform tokens; kept where the sandbox binds system files (/usr/local/etc/kazma) a
    # command read it. The shell's hidden paths are the ones the sandbox covers (tests/test_sandbox.py).
    from kazma.config import load_config
    from kazma.engine.tools.shell import ShellTool

    config_file = tmp_path / "etc" / "kazma.yaml"
    config_file.parent.mkdir()
    config_file.write_text(_config(tmp_path), encoding="utf-8")
    app = await build_app(load_config(config_file, environ={}), provider=ScriptedProvider([]), adapters=[])
    try:
        shell = app.conversations.runner.registry.get("shell")
        assert isinstance(shell, ShellTool)
        hidden = set(shell.hidden_paths)
        assert config_file.resolve() in hidden
        assert (tmp_path / "state").resolve() in hidden
    finally:
        await app.stop()
