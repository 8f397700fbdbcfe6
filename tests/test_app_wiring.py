"""The composition root's wiring, seen from outside: what each agent is offered once build_app has made the parts,
and the services the console is handed answering from the same parts the app runs."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from kazma.adapters.contract import Inbound
from kazma.adapters.web import CONSOLE
from kazma.approvals.model import Status, Waits
from kazma.approvals.withdrawal import POLL_GRACE
from kazma.bot.app import App, build_app
from kazma.bot.console.services import SwarmCommand
from kazma.config import load_config_text
from kazma.config.metrics import failure_count
from kazma.engine.model import ScriptedProvider
from kazma.engine.plan import PlanSpec, StepSpec
from kazma.engine.swarm.types import TaskStatus
from kazma.engine.types import ModelReply
from tests.approvals_support import ManualClock
from tests.outside_writes import write_around

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


async def _aged_parts(app: App, days: float) -> tuple[str, str]:
    """A long history, a transcript message and an ended and an active plan, the latter ``days`` old; returns
    (the ended plan, the active plan)."""
    old = time.time() - days * 86400.0
    history = app.conversations.runner.history
    for i in range(history.max_messages + 6):
        await history.append("web:c", "kazma", "user" if i % 2 == 0 else "assistant", f"m{i}")
    app.transcript.clock = lambda: old
    await app.transcript.record("web", CONSOLE, author="web:alice", name="alice", text="long ago", direction="in")
    plans = app.executor.store
    plans.clock = lambda: old
    spec = PlanSpec(goal="g", steps=[StepSpec(index=1, title="t", assignee="builder", input="i")])
    ended, active = await plans.create("web:c", spec), await plans.create("web:c", spec)
    await plans.set_plan_status(ended.id, "finished")
    app.transcript.clock = plans.clock = time.time
    return ended.id, active.id


@pytest.mark.parametrize("days", [0, 30])
async def test_the_retention_sweep_prunes_history_transcript_and_ended_plans(tmp_path: Path, days: int) -> None:
    # Only swarm tasks were ever pruned: the lead's history, the console's transcript and every finished plan grew
    # for as long as Kazma ran. 0 keeps the transcript and the plans; the history past what a turn reads always goes.
    text = _config(tmp_path) + f"web: {{transcript_retention_days: {days}}}\n"
    text = text.replace("agents:\n", f"agents:\n  plan_retention_days: {days}\n")
    app = await build_app(load_config_text(text, environ={}), provider=ScriptedProvider([]), adapters=[])
    try:
        ended, active = await _aged_parts(app, 31)
        history = app.conversations.runner.history
        before = await history.recent("web:c", "kazma")
        await app.prune_kept()
        kept = await app.transcript.messages(f"web:{CONSOLE}")
        assert [e.text for e in kept] == ([] if days else ["long ago"])
        assert (await app.executor.store.load(ended) is None) == bool(days)
        assert await app.executor.store.load(active) is not None
        assert await history.recent("web:c", "kazma") == before
        rows = await history.tables.one("SELECT COUNT(*) FROM agent_history")
        assert int(rows[0]) == history.max_messages
    finally:
        await app.stop()


async def test_a_failing_part_of_the_retention_sweep_is_counted_and_the_others_still_run(tmp_path: Path) -> None:
    app = await build_app(load_config_text(_config(tmp_path), environ={}), provider=ScriptedProvider([]), adapters=[])
    try:
        ended, _ = await _aged_parts(app, 91)
        # The transcript's delete fails.
        await write_around(app.loaded.config.store.path, ["ALTER TABLE conversation_titles RENAME TO titles_elsewhere"])
        before = failure_count("retention")
        with capture_logs() as logs:
            await app.prune_kept()
        assert failure_count("retention") == before + 1
        failed = [e for e in logs if e["event"] == "retention.sweep_failed"]
        assert [(e["part"], e["log_level"]) for e in failed] == [("transcript", "warning")]
        assert [e.text for e in await app.transcript.messages(f"web:{CONSOLE}")] == ["long ago"]  # rolled back
        assert await app.executor.store.load(ended) is None  # the plans were pruned all the same
    finally:
        await app.stop()


async def test_the_claims_and_keys_sweeps_are_counted_when_they_fail_and_run_again_next_time(tmp_path: Path) -> None:
    """Before, the inbound claims' and the approvals API keys' sweeps failing were logged (under names of their
    own) and counted nowhere: tables that could not be swept for weeks showed on no dashboard."""
    app = await build_app(load_config_text(_config(tmp_path), environ={}), provider=ScriptedProvider([]), adapters=[])
    try:
        ended, _ = await _aged_parts(app, 91)
        assert app.signed_requests is not None
        assert app.api_keys is not None
        old = time.time() - 3 * 86400.0
        app.signed_requests.clock = lambda: old
        assert await app.signed_requests.first_signed("slack", ["sig-1"])
        app.signed_requests.clock = time.time
        assert await app.api_keys.keep("ci", "key-1", "h", "req-1", expires_at=old)
        path = app.loaded.config.store.path

        async def rename(pairs: list[tuple[str, str]]) -> None:
            await write_around(path, [f"ALTER TABLE {table} RENAME TO {to}" for table, to in pairs])

        await rename([("inbound_claims", "claims_elsewhere"), ("api_idempotency", "keys_elsewhere")])
        before = failure_count("retention")
        with capture_logs() as logs:
            await app.prune_kept()
        assert failure_count("retention") == before + 2
        failed = [(e["part"], e["log_level"]) for e in logs if e["event"] == "retention.sweep_failed"]
        assert failed == [("inbound_claims", "warning"), ("api_keys", "warning")]
        assert await app.executor.store.load(ended) is None  # the other parts ran all the same

        await rename([("claims_elsewhere", "inbound_claims"), ("keys_elsewhere", "api_idempotency")])
        with capture_logs() as logs:
            await app.prune_kept()  # the next sweep: both go now
        assert failure_count("retention") == before + 2
        pruned = {e["part"]: e["rows"] for e in logs if e["event"] == "retention.pruned"}
        assert (pruned.get("inbound_claims"), pruned.get("api_keys")) == (1, 1)
        assert await app.api_keys.replays("ci", "key-1") is None
    finally:
        await app.stop()


async def test_a_failing_part_of_the_approvals_sweep_is_counted_and_the_others_still_run(tmp_path: Path) -> None:
    """Before, the approvals sweep was one try: a deadline the store would not end failed the pass at its first
    part, every pass, and the withdrawal of requests whose polling askers went quiet (and the checkpoint cards,
    and among replicas the recovery of a gone replica) never ran."""
    app = await build_app(load_config_text(_config(tmp_path), environ={}), provider=ScriptedProvider([]), adapters=[])
    try:
        clock = ManualClock(time.time())
        app.service.clock = app.service.store.clock = clock
        late = await app.service.open("shell", {"c": "late"}, "agent:b", "web:c", deadline=60)
        quiet = await app.service.open(
            "deploy", {"c": "quiet"}, "api:ci", "api:ci", durable=True, waits=Waits.POLLING, seen=True, deadline=3600
        )
        await write_around(  # the store refuses every timeout (as a full disk would refuse the write)
            app.loaded.config.store.path,
            [
                "CREATE TRIGGER refuse_timeouts BEFORE UPDATE OF status ON approval_requests"
                " WHEN NEW.status = 'timeout' BEGIN SELECT RAISE(ABORT, 'the store refused it'); END"
            ],
        )
        clock.advance(POLL_GRACE + 1)
        before = failure_count("approval_sweep")
        with capture_logs() as logs:
            await app.sweep_once()
        withdrawn, still = await app.service.store.get(quiet.id), await app.service.store.get(late.id)
        assert withdrawn is not None
        assert withdrawn.status is Status.CANCELLED  # the next part ran all the same
        assert still is not None
        assert still.status is Status.PENDING
        assert failure_count("approval_sweep") == before + 1
        failed = [(e.get("part"), e["log_level"]) for e in logs if e["event"] == "approvals.sweep_failed"]
        assert failed == [("deadlines", "warning")]
    finally:
        await app.stop()
