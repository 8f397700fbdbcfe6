"""A step's turn on a replica judged gone while it still ran is stopped once its step is taken away.

Replica ``c`` runs a plan step (attempt 1) on a real PostgreSQL. It is cut off (or paused) for longer than the
takeover bound; the leader ``b`` judges it gone, fails the step as interrupted, and the lead retries it on ``b``
(attempt 2). ``c`` itself goes on: its turn's next tool call (a ``write_file`` that needs no approval) acted
beside the retry, and only its result was dropped. Now ``c`` notices — just before its next tool, or by its
periodic read of the step while its turn waits on a model — and stops that turn, said once in the conversation.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

import psycopg
from structlog.testing import capture_logs

from kazma.approvals import SafetyPolicy
from kazma.config.address import Address
from kazma.config.outgoing import Outgoing
from kazma.engine.agent import AgentRunner, AgentSpec, StepRef, workspace_for
from kazma.engine.conversation import Conversations
from kazma.engine.executor import INTERRUPTED, PlanExecutor
from kazma.engine.history import HistoryStore
from kazma.engine.plan import PlanOrigin, PlanSpec, StepSpec, StepStatus
from kazma.engine.plan_store import PlanStore
from kazma.engine.step_watch import StepWatch
from kazma.engine.tools.builtin import default_registry
from kazma.engine.tools.executions import ExecutionRecord
from kazma.engine.types import Message, ModelReply, ToolCall, ToolSpec
from tests.approvals_support import approval_service, approvals_config
from tests.store_backends import replica_store
from tests.tcp_proxy import CuttableProxy
from tests.test_executor import RecordingDispatcher

WAIT = 20.0
CHAT = "telegram:-1"
REQUESTER = "telegram:111"
LIVE = {"a", "b"}  # c is gone, as the leader judges
LEAD = AgentSpec("kazma", "You lead.", is_lead=True)
BUILDER = AgentSpec("builder", "You build.", ("write_file",))
WRITE_UNAPPROVED = "tools: {write_file: write, allow_unapproved: [write_file]}\n"
STOPPED = "stopped working on step 1"
T = TypeVar("T")


def write(path: str) -> ModelReply:
    return ModelReply(content=None, tool_calls=(ToolCall(f"id-{path}", "write_file", {"path": path, "content": "x"}),))


class GatedModel:
    """c's model: its answers in order; the one at ``held`` waits for the test (the model thinking while the
    leader judges c gone). ``reached`` is set when that call is made."""

    def __init__(self, replies: Sequence[ModelReply], held: int) -> None:
        self.replies = list(replies)
        self.held = held
        self.calls = 0
        self.reached = asyncio.Event()
        self.go = asyncio.Event()
        self.cancelled = False

    @property
    def label(self) -> str:
        return "scripted (test)"

    async def complete(
        self, messages: Sequence[Message], tools: Sequence[ToolSpec] = (), *, model: str | None = None
    ) -> ModelReply:
        index = self.calls
        self.calls += 1
        if index == self.held:
            self.reached.set()
            try:
                await self.go.wait()
            except asyncio.CancelledError:
                self.cancelled = True
                raise
        return self.replies[index]


@dataclass
class Chat:
    """Where c posts: every text, and an event once c says it stopped the step's turn."""

    texts: list[str] = field(default_factory=list)
    stopped: asyncio.Event = field(default_factory=asyncio.Event)

    async def send(self, to: Address, message: Outgoing) -> str | None:
        self.texts.append(str(message.text))
        if STOPPED in str(message.text):
            self.stopped.set()
        return str(len(self.texts))


@asynccontextmanager
async def replica_c(
    tmp_path: Path, dsn: str, model: GatedModel, *, poll_seconds: float
) -> AsyncIterator[tuple[Conversations, Chat]]:
    async with (
        replica_store(dsn, "c") as sc,
        approval_service(dsn, config=approvals_config(WRITE_UNAPPROVED)) as service,
    ):
        runner = AgentRunner(
            model,
            default_registry(),
            SafetyPolicy(service),
            HistoryStore(sc),
            workspace_root=tmp_path / "ws",
            executions=ExecutionRecord(sc, replica="c"),
        )
        chat = Chat()
        c = Conversations(
            chat,
            runner,
            {"kazma": LEAD, "builder": BUILDER},
            LEAD,
            plans=PlanStore(sc, replica="c"),
            step_poll_seconds=poll_seconds,
        )
        try:
            yield c, chat
        finally:
            model.go.set()
            await c.drain()


def _plan() -> PlanSpec:
    return PlanSpec(goal="ship it", steps=[StepSpec(index=1, title="build", assignee="builder", input="build")])


async def _within(work: Awaitable[T]) -> T:
    return await asyncio.wait_for(work, WAIT)


async def test_a_step_taken_away_runs_none_of_its_tools_after(tmp_path: Path, pg_dsn: str) -> None:
    """The leader failed c's step as interrupted and the lead retried it on b while c's model was thinking;
    c's next tool call (write_file, no approval needed) ran anyway, beside attempt 2 on b. The periodic read is
    kept out of it (an hour): the check just before the tool is what stops it."""
    model = GatedModel([write("a.txt"), write("b.txt"), ModelReply(content="built")], held=1)
    async with replica_c(tmp_path, pg_dsn, model, poll_seconds=3600.0) as (c, chat), replica_store(pg_dsn, "b") as sb:
        assert c.executor is not None
        with capture_logs() as logs:
            plan = await c.executor.start(CHAT, _plan(), PlanOrigin("ship it", REQUESTER))
            await _within(model.reached.wait())  # a.txt written; c thinks about its next call, cut off
            leader = PlanExecutor(PlanStore(sb, replica="b"), RecordingDispatcher(PlanStore(sb, replica="b")),
                                  lead_name="kazma", assignees={"builder"})  # fmt: skip
            failed, actions = await _within(leader.mark_interrupted(LIVE))
            assert failed == [(plan.id, 1)]
            await leader.perform(actions)
            await leader.retry_step(CHAT, 1, None, by="kazma")  # attempt 2 runs on b
            model.go.set()  # c, back, goes on with its turn
            await _within(c.drain())

        workspace = workspace_for(tmp_path / "ws", CHAT)
        assert (workspace / "a.txt").exists()
        assert not (workspace / "b.txt").exists(), "c's tool ran after its step was taken away"
        assert model.calls == 2, "c's turn went on after its step was taken away"
        assert sum(STOPPED in t for t in chat.texts) == 1
        stopped = [e for e in logs if e["event"] == "plan.step_turn_stopped"]
        assert [(e["step"], e["attempt"]) for e in stopped] == [(1, 1)]
        rows = await leader.store.tables.all("SELECT tool FROM tool_executions ORDER BY started_at", ())
        assert [r[0] for r in rows] == ["write_file"]
        loaded = await leader.store.load(plan.id)
        assert loaded is not None
        assert (loaded.steps[1].status, loaded.steps[1].attempts) == (StepStatus.IN_PROGRESS, 2)


async def test_a_step_taken_away_is_stopped_while_its_turn_waits_on_the_model(tmp_path: Path, pg_dsn: str) -> None:
    """The leader failed c's step as interrupted while c's turn waited on its model (a long answer): nothing
    told c, and its turn ran on to its end. The periodic read stops it within the poll interval."""
    model = GatedModel([write("a.txt"), write("b.txt"), ModelReply(content="built")], held=1)
    async with replica_c(tmp_path, pg_dsn, model, poll_seconds=0.05) as (c, chat), replica_store(pg_dsn, "b") as sb:
        assert c.executor is not None
        plan = await c.executor.start(CHAT, _plan(), PlanOrigin("ship it", REQUESTER))
        await _within(model.reached.wait())
        leader = PlanExecutor(PlanStore(sb, replica="b"), RecordingDispatcher(PlanStore(sb, replica="b")),
                              lead_name="kazma", assignees={"builder"})  # fmt: skip
        failed, _ = await _within(leader.mark_interrupted(LIVE))
        assert failed == [(plan.id, 1)]
        await _within(chat.stopped.wait())  # the model is never let go: only the watch ends the turn
        await _within(c.drain())

        assert model.cancelled
        assert model.calls == 2
        assert not (workspace_for(tmp_path / "ws", CHAT) / "b.txt").exists()
        assert sum(STOPPED in t for t in chat.texts) == 1
        loaded = await leader.store.load(plan.id)
        assert loaded is not None
        assert loaded.steps[1].status is StepStatus.FAILED
        assert loaded.steps[1].failure_reason.startswith(INTERRUPTED)


async def test_a_replica_cut_off_from_the_database_stops_its_step_once_it_is_back(tmp_path: Path, pg_dsn: str) -> None:
    """c loses its link to PostgreSQL while its model thinks; the leader fails c's step and the lead retries
    it on b. c's link comes back and its model answers with a write_file: it ran, beside attempt 2 on b."""
    url = urlsplit(pg_dsn)
    proxy = CuttableProxy(url.hostname or "127.0.0.1", url.port or 5432)
    await proxy.start()
    proxied = urlunsplit(url._replace(netloc=f"{url.username}@127.0.0.1:{proxy.port}"))
    model = GatedModel([write("a.txt"), write("b.txt"), ModelReply(content="built")], held=1)
    try:
        async with (
            replica_c(tmp_path, proxied, model, poll_seconds=3600.0) as (c, chat),
            replica_store(pg_dsn, "b") as sb,
        ):
            assert c.executor is not None
            plan = await c.executor.start(CHAT, _plan(), PlanOrigin("ship it", REQUESTER))
            await _within(model.reached.wait())
            proxy.cut()  # c's sessions end; it cannot reach the database
            leader = PlanExecutor(PlanStore(sb, replica="b"), RecordingDispatcher(PlanStore(sb, replica="b")),
                                  lead_name="kazma", assignees={"builder"})  # fmt: skip
            failed, actions = await _within(leader.mark_interrupted(LIVE))
            assert failed == [(plan.id, 1)]
            await leader.perform(actions)
            await leader.retry_step(CHAT, 1, None, by="kazma")
            proxy.restore()
            model.go.set()
            await _within(c.drain())

            assert not (workspace_for(tmp_path / "ws", CHAT) / "b.txt").exists()
            assert sum(STOPPED in t for t in chat.texts) == 1
            assert model.calls == 2
    finally:
        await proxy.stop()


class HeldWatch(StepWatch):
    """c's step watch, whose check before the ``held``-th tool (counting from 1) waits for the test once it has
    read the step as still running: the leader's write taking the step away lands right there."""

    def __init__(self, store: PlanStore, held: int) -> None:
        super().__init__(store, poll_seconds=3600.0)
        self.held = held
        self.checks = 0
        self.checked = asyncio.Event()
        self.go = asyncio.Event()

    async def check(self, step: StepRef) -> None:
        await super().check(step)
        self.checks += 1
        if self.checks == self.held:
            self.checked.set()
            await self.go.wait()


async def test_a_step_taken_away_right_after_its_check_runs_no_tool(tmp_path: Path, pg_dsn: str) -> None:
    """c's check read its step as running just before the leader failed it as interrupted and the lead retried
    it on b: that one tool (write_file b.txt) still started, beside attempt 2 on b, and the leader's ending said
    nothing of it. The check and the tool's row are one statement now: the row is not written, the tool never
    starts, and the turn is stopped."""
    model = GatedModel([write("a.txt"), write("b.txt"), ModelReply(content="built")], held=-1)
    async with replica_c(tmp_path, pg_dsn, model, poll_seconds=3600.0) as (c, chat), replica_store(pg_dsn, "b") as sb:
        assert c.executor is not None
        assert c.plans is not None
        watch = c.steps = HeldWatch(c.plans, held=2)
        plan = await c.executor.start(CHAT, _plan(), PlanOrigin("ship it", REQUESTER))
        await _within(watch.checked.wait())  # a.txt written; b.txt's check read the step as running
        leader = PlanExecutor(PlanStore(sb, replica="b"), RecordingDispatcher(PlanStore(sb, replica="b")),
                              lead_name="kazma", assignees={"builder"},
                              executions=ExecutionRecord(sb, replica="b"))  # fmt: skip
        failed, actions = await _within(leader.mark_interrupted(LIVE))
        assert failed == [(plan.id, 1)]
        await leader.perform(actions)
        await leader.retry_step(CHAT, 1, None, by="kazma")  # attempt 2 runs on b
        watch.go.set()
        await _within(c.drain())

        assert not (workspace_for(tmp_path / "ws", CHAT) / "b.txt").exists(), "c's tool ran beside the retry"
        rows = await leader.store.tables.all("SELECT tool, replica FROM tool_executions ORDER BY started_at", ())
        assert [tuple(r) for r in rows] == [("write_file", "c")]
        assert sum(STOPPED in t for t in chat.texts) == 1
        assert model.calls == 2


async def _blocked_on_a_lock(dsn: str, application: str) -> None:
    """Return once a session of ``application`` waits for a row lock (the condition is read until it holds)."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        while True:
            cursor = await conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND wait_event_type = 'Lock'",
                (application,),
            )
            row = await cursor.fetchone()
            if row is not None and row[0] > 0:
                return
            await asyncio.sleep(0.01)


async def test_a_tool_starting_as_its_step_is_taken_away_is_in_the_steps_ending(pg_dsn: str) -> None:
    """c's tool row was going in (its transaction holding the step's row, FOR SHARE) as the leader failed the
    step: the leader read the step's tools before its write, found none, and the ending said no tool ran while
    write_file did. Now its write waits for c's row and reads the tools after it."""
    async with replica_store(pg_dsn, "c") as sc, replica_store(pg_dsn, "b") as sb:
        c = PlanExecutor(PlanStore(sc, replica="c"), RecordingDispatcher(PlanStore(sc, replica="c")),
                         lead_name="kazma", assignees={"builder"})  # fmt: skip
        plan = await c.start(CHAT, _plan(), PlanOrigin("ship it", REQUESTER))
        scope = f"plan:{plan.id}:1:1"
        async with await psycopg.AsyncConnection.connect(pg_dsn) as tool:  # c's row going in, not committed yet
            inserted = await tool.execute(
                "INSERT INTO tool_executions (id, tool, args_hash, conversation, agent, scope, replica, changes_state,"
                " started_at) SELECT 'x1', 'write_file', 'h', %s, 'builder', %s, 'c', 1, 1.0 FROM plan_steps"
                " WHERE plan_id = %s AND idx = 1 AND attempts = 1 AND status = 'in_progress' AND replica = 'c'"
                " FOR SHARE",
                (CHAT, scope, plan.id),
            )
            assert inserted.rowcount == 1
            leader = PlanExecutor(PlanStore(sb, replica="b"), RecordingDispatcher(PlanStore(sb, replica="b")),
                                  lead_name="kazma", assignees={"builder"},
                                  executions=ExecutionRecord(sb, replica="b"))  # fmt: skip
            taking = asyncio.ensure_future(leader.mark_interrupted(LIVE))
            await _within(_blocked_on_a_lock(pg_dsn, "kazma b-writer"))
            await tool.commit()  # the tool starts
            failed, _ = await _within(taking)
        assert failed == [(plan.id, 1)]
        loaded = await leader.store.load(plan.id)
        assert loaded is not None
        step = loaded.steps[1]
        assert step.status is StepStatus.FAILED
        assert step.failure_reason.startswith(INTERRUPTED)
        assert "write_file" in step.failure_reason, step.failure_reason
        assert step.record.execution is not None
        assert step.record.execution.may_have_run == ("write_file (started, not finished)",)
