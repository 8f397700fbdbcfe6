"""A swarm task ended elsewhere starts no tool, on a real PostgreSQL with two replicas (see TaskFence).

Replica ``c`` runs a swarm task whose worker is a real agent (write_file needs no approval). The leader ``b``
judges ``c`` gone and ends its task as interrupted while ``c`` still runs (cut off, paused). ``c`` learns of it
only by reading the task's row, once a second: a tool its worker started before that read acted after the
leader said what the task's tools did. Held deterministically with events and a row lock, never with sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import psycopg
from structlog.testing import capture_logs

from kazma.approvals import SafetyPolicy
from kazma.config.store.backend import StoreConnection
from kazma.engine.agent import AgentRunner, AgentSpec, workspace_for
from kazma.engine.history import HistoryStore
from kazma.engine.swarm.service import CoalescingReporter, SwarmService
from kazma.engine.swarm.state_store import SwarmStateStore
from kazma.engine.swarm.store import SwarmTaskStore
from kazma.engine.swarm.types import Pattern, SwarmRequest, TaskStatus, task_conversation, working_for
from kazma.engine.swarm.workers import AgentWorker
from kazma.engine.tools.builtin import default_registry
from kazma.engine.tools.executions import ExecutionRecord
from kazma.engine.types import ModelReply
from tests.approvals_support import approval_service, approvals_config
from tests.store_backends import Engine, open_store, replica_store
from tests.swarm_rig import config as swarm_config
from tests.test_pg_step_taken_away import WRITE_UNAPPROVED, GatedModel, write

WAIT = 20.0
CHAT = "telegram:-1"
LIVE = {"a", "b"}  # c is gone, as the leader judges
BUILDER = AgentSpec("builder", "You build.", ("write_file",))
T = TypeVar("T")


async def _within(work: Awaitable[T]) -> T:
    return await asyncio.wait_for(work, WAIT)


class Lines(CoalescingReporter):
    """c's progress lines, kept as they are said (never sent anywhere)."""

    def __init__(self) -> None:
        super().__init__(self._never)
        self.said: list[str] = []

    async def _never(self, text: str) -> None:
        raise AssertionError(text)

    def add(self, line: str, *, heard_in: str | None = None) -> None:
        self.said.append(line)


@dataclass
class ReplicaC:
    service: SwarmService
    records: ExecutionRecord
    workspaces: Path
    lines: Lines

    def workspace(self, task_id: str) -> Path:
        with working_for(None, task_id):
            return workspace_for(self.workspaces, task_conversation("swarm"))


@asynccontextmanager
async def replica_c(tmp_path: Path, dsn: str, model: GatedModel) -> AsyncIterator[ReplicaC]:
    async with replica_store(dsn, "c") as sc, swarm_on(sc, tmp_path, model, replica="c") as c:
        yield c


@asynccontextmanager
async def swarm_on(
    sc: StoreConnection, tmp_path: Path, model: GatedModel, *, replica: str | None
) -> AsyncIterator[ReplicaC]:
    """c's swarm on ``sc``, its builder a real agent on ``model``; its watch for tasks ended elsewhere kept out
    of the way (an hour): whatever stops c's tool here is what stands just before it starts."""
    async with approval_service(tmp_path / "approvals.db", config=approvals_config(WRITE_UNAPPROVED)) as approvals:
        records = ExecutionRecord(sc, replica=replica)
        runner = AgentRunner(model, default_registry(), SafetyPolicy(approvals), HistoryStore(sc),
                             workspace_root=tmp_path / "ws", executions=records)  # fmt: skip
        lines = Lines()
        service = SwarmService(
            SwarmTaskStore(sc, replica=replica),
            {"builder": AgentWorker(BUILDER, runner, "swarm")},
            swarm_config(),
            state=SwarmStateStore(sc),
            executions=records,
            reporter=lines,
            ended_poll_seconds=3600.0,
        )
        try:
            yield ReplicaC(service, records, tmp_path / "ws", lines)
        finally:
            model.go.set()
            await service.close()


def _leader(sb: StoreConnection) -> SwarmService:
    return SwarmService(SwarmTaskStore(sb, replica="b"), {}, swarm_config(), state=SwarmStateStore(sb),
                        executions=ExecutionRecord(sb, replica="b"))  # fmt: skip


def _build() -> SwarmRequest:
    return SwarmRequest(Pattern.DISPATCH, ("builder",), "build it", "telegram:111", conversation=CHAT)


async def test_a_swarm_task_the_leader_ended_runs_none_of_its_tools_after(tmp_path: Path, pg_dsn: str) -> None:
    """The leader ended c's task as interrupted ("tools so far: ran: write_file") while c's model was thinking;
    c's next tool call (write_file b.txt, no approval needed) still ran, after the leader had said what the
    task's tools did: nothing read the task's row before a tool started. Now the tool's row is written only
    while the row still says c's run: it is not written, the tool never starts, and c stops the task at once
    and says what its tools did."""
    model = GatedModel([write("a.txt"), write("b.txt"), ModelReply(content="built")], held=1)
    async with replica_c(tmp_path, pg_dsn, model) as c, replica_store(pg_dsn, "b") as sb:
        task_id = await c.service.submit(_build())
        await _within(model.reached.wait())  # a.txt written; c thinks about its next call, cut off
        leader = _leader(sb)
        try:
            lines = await _within(leader.recover_gone(LIVE))
        finally:
            await leader.close()
        assert len(lines) == 1
        assert "tools so far: ran: write_file" in lines[0], lines[0]
        with capture_logs() as logs:
            model.go.set()  # c, back, goes on with its task
            await _within(c.service.wait(task_id, WAIT))

        workspace = c.workspace(task_id)
        assert (workspace / "a.txt").exists()
        assert not (workspace / "b.txt").exists(), "c's tool ran after the leader ended its task"
        rows = await c.records.tables.all("SELECT tool, replica FROM tool_executions ORDER BY started_at", ())
        assert [tuple(r) for r in rows] == [("write_file", "c")]
        assert [e["tool"] for e in logs if e["event"] == "agent.task_fenced_out"] == ["write_file"]
        assert model.calls == 2, "c's worker was asked on after its task was ended"
        (stopped,) = [line for line in c.lines.said if "stopped here: it was ended elsewhere" in line]
        assert stopped.endswith("tools: ran: write_file"), stopped
        record = await c.service.store.get(task_id)
        assert record is not None
        assert record.status is TaskStatus.INTERRUPTED


async def _blocked_on_a_lock(dsn: str, application: str) -> None:
    """Return once a session whose application name starts with ``application`` waits for a row lock."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        while True:
            cursor = await conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s AND wait_event_type = 'Lock'",
                (f"{application}%",),
            )
            row = await cursor.fetchone()
            if row is not None and row[0] > 0:
                return
            await asyncio.sleep(0.01)


async def test_a_tool_starting_as_its_swarm_task_is_ended_is_in_the_leaders_line(pg_dsn: str) -> None:
    """c's tool row was going in (its statement holding the task's row, FOR SHARE) as the leader ended the
    task: the leader's write waits for it, and what it says of the task's tools names it."""
    async with replica_store(pg_dsn, "c") as sc, replica_store(pg_dsn, "b") as sb:
        on_c = SwarmTaskStore(sc, replica="c")
        run = await on_c.admit(Pattern.DISPATCH, {"prompt": "p"}, owner="web:x")
        source, params = on_c.fence(lambda: run).source()
        async with await psycopg.AsyncConnection.connect(pg_dsn) as tool:  # c's row going in, not committed yet
            inserted = await tool.execute(
                "INSERT INTO tool_executions (id, tool, args_hash, conversation, agent, scope, task_id, replica,"
                f" changes_state, started_at) SELECT 'x1', 'write_file', 'h', 'swarm', 'builder', 's', %s, 'c', 1,"
                f" 1.0 {source.replace('?', '%s')}",
                (run.task_id, *params),
            )
            assert inserted.rowcount == 1
            leader = _leader(sb)
            try:
                ending = asyncio.ensure_future(leader.recover_gone(LIVE))
                await _within(_blocked_on_a_lock(pg_dsn, "kazma b"))
                await tool.commit()  # the tool starts
                lines = await _within(ending)
            finally:
                await leader.close()
        assert len(lines) == 1
        assert "tools so far: may have run: write_file (started, not finished)" in lines[0], lines[0]
        record = await on_c.get(run.task_id)
        assert record is not None
        assert record.status is TaskStatus.INTERRUPTED


async def test_a_swarm_task_cancelled_by_another_process_runs_none_of_its_tools_after(
    tmp_path: Path, store_engine: Engine
) -> None:
    """`kazma swarm cancel` in a terminal (or /swarm cancel heard by another replica) changed only the task's row
    while c's model was thinking: c's next tool call still ran. Now it is refused by the row and c stops."""
    model = GatedModel([write("a.txt"), write("b.txt"), ModelReply(content="built")], held=1)
    async with (
        open_store(store_engine, application_name="kazma c") as sc,
        open_store(store_engine, application_name="kazma b") as sb,
        swarm_on(sc, tmp_path, model, replica=None) as c,
    ):
        task_id = await c.service.submit(_build())
        await _within(model.reached.wait())
        assert await SwarmTaskStore(sb).cancel(task_id, actor="telegram:111")
        model.go.set()
        await _within(c.service.wait(task_id, WAIT))

        assert (c.workspace(task_id) / "a.txt").exists()
        assert not (c.workspace(task_id) / "b.txt").exists(), "c's tool ran after its task was cancelled elsewhere"
        rows = await c.records.tables.all("SELECT tool FROM tool_executions", ())
        assert [r[0] for r in rows] == ["write_file"]
        assert model.calls == 2
        (stopped,) = [line for line in c.lines.said if "stopped here: it was ended elsewhere" in line]
        assert "cancelled by telegram:111" in stopped, stopped


async def test_a_swarm_task_that_finishes_after_it_was_cancelled_elsewhere_says_so_once(
    tmp_path: Path, store_engine: Engine
) -> None:
    """Cancelled by another process while c's model was thinking, c's worker then answered with no further tool
    call: the dispatch finished before c's watch read the row, its ending was refused by the row
    (swarm.write_rejected), and c said nothing of the task. Now c says, once, that it finished after it had been
    ended (and how), that its result was not recorded, and what it was."""
    model = GatedModel([write("a.txt"), ModelReply(content="built the thing")], held=1)
    async with (
        open_store(store_engine, application_name="kazma c") as sc,
        open_store(store_engine, application_name="kazma b") as sb,
        swarm_on(sc, tmp_path, model, replica=None) as c,
    ):
        task_id = await c.service.submit(_build())
        await _within(model.reached.wait())
        assert await SwarmTaskStore(sb).cancel(task_id, actor="telegram:111")
        with capture_logs() as logs:
            model.go.set()
            await _within(c.service.wait(task_id, WAIT))

        assert [e["operation"] for e in logs if e["event"] == "swarm.write_rejected"] == ["finish"]
        about = [line for line in c.lines.said if task_id in line]
        assert len(about) == 2, about  # its start, and what became of it
        late = about[-1]
        assert "finished (succeeded) after it had been ended (cancelled by telegram:111)" in late, late
        assert "its result was not recorded" in late, late
        assert "built the thing" in late, late
        assert "tools: ran: write_file" in late, late
        record = await c.service.store.get(task_id)
        assert record is not None
        assert record.status is TaskStatus.CANCELLED


async def test_a_swarm_task_that_finishes_after_the_leader_ended_it_says_so_once(tmp_path: Path, pg_dsn: str) -> None:
    """The leader judged c gone and ended its task as interrupted ("outcome unknown") while c's model was
    thinking; c's worker then answered with no further tool call and c, its ending refused, said nothing: what
    the task came to was never told. Now c says it, once, with how the leader had ended it."""
    model = GatedModel([write("a.txt"), ModelReply(content="built the thing")], held=1)
    async with replica_c(tmp_path, pg_dsn, model) as c, replica_store(pg_dsn, "b") as sb:
        task_id = await c.service.submit(_build())
        await _within(model.reached.wait())
        leader = _leader(sb)
        try:
            assert len(await _within(leader.recover_gone(LIVE))) == 1
        finally:
            await leader.close()
        model.go.set()
        await _within(c.service.wait(task_id, WAIT))

        (late,) = [line for line in c.lines.said if "its result was not recorded" in line]
        assert f"swarm task {task_id} finished (succeeded) after it had been ended (interrupted: " in late, late
        assert late.endswith("built the thing (tools: ran: write_file)"), late
        record = await c.service.store.get(task_id)
        assert record is not None
        assert record.status is TaskStatus.INTERRUPTED
