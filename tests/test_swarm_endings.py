"""What a task's ending says, on every surface that shows the task (engine/swarm/endings.py).

- A task that hit its deadline keeps the answers of the workers that finished: ``/swarm status`` (which
  ``kazma swarm status`` runs too), ``kazma swarm show`` (its JSON), ``check_swarm_task``, the console's
  dashboard and the delivered message show them, not only their number.
- A run whose ending the store refuses is kept, said, shown as it ended, and stored once the store answers.
- A shell call cut off mid-run (a cancel, a deadline) reads "may have run (started, not finished)" on each of
  those surfaces, from the execution record; ``/swarm retry`` asks before running it again.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from kazma.approvals import ApprovalService, SafetyPolicy
from kazma.approvals.model import Decision
from kazma.bot.console.dashboard_data import DashboardData
from kazma.bot.console.pages import dashboard_html
from kazma.config import KazmaConfig, load_config_text
from kazma.config.models import ModelConfig
from kazma.config.store.database import open_database
from kazma.engine.agent import AgentRunner, AgentSpec, TurnContext
from kazma.engine.history import MIGRATIONS as HISTORY
from kazma.engine.history import HistoryStore
from kazma.engine.model import OpenAIProvider
from kazma.engine.swarm.commands import SwarmCommands
from kazma.engine.swarm.lead_tools import swarm_tools
from kazma.engine.swarm.records import task_json
from kazma.engine.swarm.service import CoalescingReporter, SwarmService
from kazma.engine.swarm.store import MIGRATIONS, SwarmTaskStore, TaskRecord
from kazma.engine.swarm.types import TaskStatus, Worker, WorkerResult
from kazma.engine.swarm.workers import AgentWorker
from kazma.engine.tools.builtin import default_registry
from kazma.engine.tools.executions import MIGRATIONS as EXECUTIONS
from kazma.engine.tools.executions import Ended, ExecutionRecord
from tests.approvals_support import RecordingPublisher, approval_service
from tests.fakes.openai import Completion, FakeOpenAI, FakeToolCall
from tests.lost_commit_answer import LostCommitAnswer
from tests.swarm_support import Locker, ScriptedWorker

CONFIG = """
approvals: {approvers: ["telegram:111"], deadline_seconds: 600}
platforms: {telegram: {admins: [111]}}
swarm: {max_parallel: 4}
"""
MODEL = "fake-model"
MAY_HAVE_RUN = "may have run: shell (started, not finished)"
MAY_HAVE_RUN_JSON = {"outcome": "may have run", "ran": [], "may_have_run": ["shell (started, not finished)"]}


@dataclass
class _Viewer:
    login: str = "ops"
    role: str = "operator"
    csrf: str = "c" * 32
    is_operator: bool = True
    may_decide: bool = True

    def may_decide_under(self, policy: str | None) -> bool:
        return self.may_decide

    proven: bool = True
    who: str = "ops"


@dataclass
class Rig:
    service: SwarmService
    commands: SwarmCommands
    approvals: ApprovalService
    publisher: RecordingPublisher
    reports: list[str]
    delivered: list[tuple[str, str]]
    path: Path

    async def send(self, text: str) -> str:
        return await self.commands.run(text, actor="telegram:111", platform="telegram", chat="-1001", is_admin=True)

    async def reported(self, words: str) -> str:
        async with asyncio.timeout(20):
            while not (found := [r for r in self.reports if words in r]):
                await asyncio.sleep(0.01)
        return found[0]

    async def surfaces(self, task_id: str) -> dict[str, str]:
        """The task as each surface shows it."""
        record = await self.service.task(task_id)
        assert record is not None
        calls = await self.service.store.calls(task_id)
        _, check = swarm_tools(self.service, SafetyPolicy(self.approvals))
        ctx = TurnContext("telegram:-1001", AgentSpec("kazma", "lead", is_lead=True), "telegram:111")
        checked = await check.handler({"task_id": task_id, "wait_seconds": 0}, ctx)
        data = DashboardData([record], [], [], {})
        return {
            "/swarm status": await self.send(f"status {task_id}"),
            "kazma swarm show": json.dumps(task_json(record, calls)),
            "check_swarm_task": checked.output,
            "console": dashboard_html(_Viewer(), data),
            "delivered": "\n".join(text for _, text in self.delivered if task_id in text),
        }


@asynccontextmanager
async def rig(
    path: Path,
    workers: Mapping[str, Worker],
    *,
    cfg: KazmaConfig | None = None,
    executions: ExecutionRecord | None = None,
) -> AsyncIterator[Rig]:
    cfg = cfg or load_config_text(CONFIG).config
    publisher = RecordingPublisher()
    reports: list[str] = []
    delivered: list[tuple[str, str]] = []
    conn = await open_database(path, migrations=[*MIGRATIONS, *EXECUTIONS], busy_timeout_ms=50)

    async def report(text: str) -> None:
        reports.append(text)

    async def deliver(target: str, text: str) -> None:
        delivered.append((target, text))

    async def no_sleep(_: float) -> None:
        return

    async with approval_service(
        path.with_suffix(".approvals.db"), config=cfg, publisher=publisher, poll_interval=0.01
    ) as approvals:
        service = SwarmService(
            SwarmTaskStore(conn, sleep=no_sleep),
            dict(workers),
            cfg,
            approvals=approvals,
            reporter=CoalescingReporter(report, interval=0.01),
            deliver=deliver,
            sleep=no_sleep,
            executions=executions,
        )
        try:
            yield Rig(service, SwarmCommands(service, cfg), approvals, publisher, reports, delivered, path)
        finally:
            await service.close()
            await conn.close()


async def ended(r: Rig, answer: str) -> TaskRecord:
    assert answer.startswith("swarm task "), answer
    record = await r.service.wait(answer.split()[2], 30)
    assert record is not None
    assert record.status.terminal, record
    return record


# -- the answers a deadline kept --------------------------------------------------------------------------


async def test_a_deadline_keeps_the_finished_answers_and_every_surface_shows_them(tmp_path: Path) -> None:
    never = asyncio.Event()
    workers = {
        "researcher": ScriptedWorker("researcher", [_answer("researcher", "three sources agree: use RFC 9110")]),
        "builder": ScriptedWorker("builder", gate=never),  # still working when the deadline passes
    }
    async with rig(tmp_path / "s.db", workers) as r:
        record = await ended(r, await r.send("fanout --deadline 1 researcher,builder compare the specs"))
        assert record.status is TaskStatus.TIMEOUT
        shown = await r.surfaces(record.id)
        for surface, text in shown.items():
            assert "three sources agree: use RFC 9110" in text, surface
        assert "kept answers (1):" in shown["/swarm status"]
        assert "[researcher] three sources agree" in shown["delivered"]
        assert json.loads(shown["kazma swarm show"])["kept_answers"] == [
            {"worker": "researcher", "output": "three sources agree: use RFC 9110"}
        ]


def _answer(worker: str, text: str) -> WorkerResult:
    return WorkerResult(worker, True, output=text)


# -- an ending the store refuses ----------------------------------------------------------------------------


async def test_a_result_the_store_refuses_is_kept_reported_shown_and_stored_later(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    locker = Locker(path)
    worker = ScriptedWorker("builder", [_answer("builder", "the script is written: build.sh")])
    original = worker.run

    async def run(prompt: str, *, context: str = "") -> WorkerResult:
        await locker.lock()  # the store is taken from here on: the ending cannot be written
        return await original(prompt, context=context)

    worker.run = run  # type: ignore[method-assign]
    async with rig(path, {"builder": worker}) as r:
        try:
            record = await ended(r, await r.send("dispatch builder write the script"))
            assert record.status is TaskStatus.SUCCEEDED  # as it ended, though its row still says running
            stored = await r.service.store.get(record.id)
            assert stored is not None
            assert stored.status is TaskStatus.RUNNING
            said = await r.reported("could not be stored")
            assert "the script is written" in said
            shown = await r.surfaces(record.id)
            assert shown["/swarm status"].startswith(f"swarm task {record.id}: succeeded")
            assert "not stored yet" in shown["/swarm status"]
            assert "status: succeeded" in shown["check_swarm_task"]
            assert "the script is written: build.sh" in shown["delivered"]
            assert "succeeded" in shown["console"]
            # /swarm list and tasks read the rows: they said "running" where /swarm status said succeeded.
            assert record.id not in await r.send("list")
            tasks = await r.send("tasks")
            assert record.id in tasks
            assert "running" not in next(line for line in tasks.splitlines() if record.id in line)
        finally:
            await locker.unlock()
        async with asyncio.timeout(20):  # the store answers again: the kept ending is written
            while (row := await r.service.store.get(record.id)) is None or row.status is not TaskStatus.SUCCEEDED:
                await asyncio.sleep(0.05)
        assert row.result is not None
        assert row.result["output"] == "the script is written: build.sh"
        await r.reported("result is stored now")


async def test_a_kept_result_the_row_refuses_once_the_store_answers_is_said_not_dropped(tmp_path: Path) -> None:
    """The ending could not be written (the store taken), so it was kept and said "stored when the store
    answers"; meanwhile another process, holding the store, cancelled the task. Once the store answered, the
    kept ending was refused by the row and dropped without a word: the promise made was silently broken. Now
    that is said."""
    path = tmp_path / "s.db"
    locker = Locker(path)
    worker = ScriptedWorker("builder", [_answer("builder", "the script is written: build.sh")])
    original = worker.run

    async def run(prompt: str, *, context: str = "") -> WorkerResult:
        await locker.lock()
        return await original(prompt, context=context)

    worker.run = run  # type: ignore[method-assign]
    async with rig(path, {"builder": worker}) as r:
        try:
            record = await ended(r, await r.send("dispatch builder write the script"))
            await r.reported("could not be stored")
            assert locker.conn is not None  # the other process, holding the store, cancels the task
            await locker.conn.execute(
                "UPDATE swarm_tasks SET status = 'cancelled', error = 'cancelled by telegram:222' WHERE id = ?",
                (record.id,),
            )
            await locker.conn.execute("COMMIT")
            await locker.conn.close()
            locker.conn = None  # given back, with the cancel in it
        finally:
            await locker.unlock()
        said = await r.reported("was not stored")
        assert said.startswith(f"swarm task {record.id}: its succeeded result, kept here, was not stored"), said
        assert "ended (cancelled by telegram:222)" in said, said
        assert not [line for line in r.reports if "result is stored now" in line]
        row = await r.service.store.get(record.id)
        assert row is not None
        assert row.status is TaskStatus.CANCELLED


async def test_an_ending_whose_commit_answer_was_lost_is_said_as_stored_not_as_ended_elsewhere(tmp_path: Path) -> None:
    """The ending was committed, its answer lost (a transient error), and the store's retry refused by the row this
    very run had just ended: the run was said to have "finished (succeeded) after it had been ended (succeeded);
    its result was not recorded", though its result was the one recorded, and its ending went undelivered. The
    row saying this run's own ending is the ending stored."""
    worker = ScriptedWorker("builder", [_answer("builder", "the script is written: build.sh")])
    async with rig(tmp_path / "s.db", {"builder": worker}) as r:
        lost = LostCommitAnswer(
            r.service.store.tables, lambda sql: sql.startswith("UPDATE swarm_tasks SET status") and "finished_at" in sql
        )
        r.service.store.tables = lost
        lost.armed = True
        record = await ended(r, await r.send("dispatch builder write the script"))
        assert not lost.armed, "the ending's commit was not reached"
        assert record.status is TaskStatus.SUCCEEDED
        said = await r.reported(f"swarm task {record.id} succeeded")
        assert "the script is written: build.sh" in said, said
        assert not [line for line in r.reports if "not recorded" in line], r.reports
        assert [text for _, text in r.delivered if "the script is written" in text], r.delivered


# -- a shell call cut off mid-run ---------------------------------------------------------------------------


@dataclass
class Shell:
    runner: AgentRunner
    records: ExecutionRecord
    model: FakeOpenAI
    approvals: ApprovalService
    publisher: RecordingPublisher

    async def approve_the_card(self) -> None:
        async with asyncio.timeout(20):
            while not self.publisher.published:
                await asyncio.sleep(0.01)
        request_id = self.publisher.published[0].request_id
        await self.approvals.decide(request_id, Decision.APPROVE, actor="telegram:111", platform="telegram")


@asynccontextmanager
async def shell_worker(tmp_path: Path, cfg: KazmaConfig, store: Path) -> AsyncIterator[Shell]:
    """A real agent worker (the real runner, policy and shell tool) on the wire-level fake model, recording its
    executions in the swarm's store."""
    publisher = RecordingPublisher()
    async with FakeOpenAI(models=(MODEL,)) as model:
        provider = OpenAIProvider(ModelConfig(base_url=model.base_url, name=MODEL, max_retries=0))
        history = await open_database(tmp_path / "history.db", migrations=HISTORY)
        conn = await open_database(store, migrations=[*MIGRATIONS, *EXECUTIONS])
        records = ExecutionRecord(conn)
        try:
            async with approval_service(
                tmp_path / "policy.db", config=cfg, publisher=publisher, poll_interval=0.01
            ) as approvals:
                runner = AgentRunner(
                    provider,
                    default_registry(),
                    SafetyPolicy(approvals),
                    HistoryStore(history),
                    workspace_root=tmp_path / "workspaces",
                    executions=records,
                )
                yield Shell(runner, records, model, approvals, publisher)
        finally:
            await provider.aclose()
            await history.close()
            await conn.close()


async def _shell_running(records: ExecutionRecord, task_id: str) -> None:
    async with asyncio.timeout(30):
        while not [e for e in await records.of_task(task_id) if e.tool == "shell" and e.ended is None]:
            await asyncio.sleep(0.02)


async def test_a_shell_call_cancelled_mid_run_may_have_run_on_every_surface_and_a_retry_asks(tmp_path: Path) -> None:
    cfg = load_config_text(CONFIG).config
    store = tmp_path / "s.db"
    async with shell_worker(tmp_path, cfg, store) as shell:
        shell.model.script(Completion(tool_calls=(FakeToolCall("shell", json.dumps({"command": "sleep 60"})),)))
        worker = AgentWorker(AgentSpec("builder", "You are builder.", ("shell",)), shell.runner, "swarm")
        async with rig(store, {"builder": worker}, cfg=cfg, executions=shell.records) as r:
            answer = await r.send("dispatch builder clean the build folder")
            task_id = answer.split()[2]
            await shell.approve_the_card()
            await _shell_running(shell.records, task_id)
            cancelled = await r.send(f"cancel {task_id}")
            assert cancelled.endswith(f"tools: {MAY_HAVE_RUN}")
            (execution,) = await shell.records.of_task(task_id)
            assert execution.ended is Ended.INTERRUPTED
            shown = await r.surfaces(task_id)
            for surface in ("/swarm status", "check_swarm_task", "console"):
                assert MAY_HAVE_RUN in shown[surface], surface
            assert json.loads(shown["kazma swarm show"])["execution"] == MAY_HAVE_RUN_JSON
            asked = await r.send(f"retry {task_id}")
            assert "running it again may do that again" in asked
            assert f"Send /swarm retry {task_id} again" in asked
            assert await r.service.store.count(TaskStatus.RUNNING) == 0  # nothing ran again unasked


async def test_a_shell_call_cut_off_by_the_deadline_says_it_may_have_run_and_a_retry_asks(tmp_path: Path) -> None:
    cfg = load_config_text(CONFIG).config
    store = tmp_path / "s.db"
    async with shell_worker(tmp_path, cfg, store) as shell:
        shell.model.script(Completion(tool_calls=(FakeToolCall("shell", json.dumps({"command": "sleep 60"})),)))
        worker = AgentWorker(AgentSpec("builder", "You are builder.", ("shell",)), shell.runner, "swarm")
        async with rig(store, {"builder": worker}, cfg=cfg, executions=shell.records) as r:
            answer = await r.send("dispatch --deadline 30 builder clean the build folder")
            task_id = answer.split()[2]
            await shell.approve_the_card()
            await _shell_running(shell.records, task_id)
            limit = r.service._deadlines[task_id]
            limit.reschedule(asyncio.get_running_loop().time())  # the deadline passes now, mid-shell
            record = await r.service.wait(task_id, 30)
            assert record is not None
            assert record.status is TaskStatus.TIMEOUT
            shown = await r.surfaces(task_id)
            for surface in ("/swarm status", "check_swarm_task", "console", "delivered"):
                assert MAY_HAVE_RUN in shown[surface], surface
            assert json.loads(shown["kazma swarm show"])["execution"] == MAY_HAVE_RUN_JSON
            assert "running it again may do that again" in await r.send(f"retry {task_id}")
