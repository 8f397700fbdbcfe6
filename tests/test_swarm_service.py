"""The swarm service end to end with scripted workers: patterns, limits, checkpoints, restarts, commands."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kazma.approvals import ApprovalService
from kazma.approvals import store as approval_store
from kazma.approvals.card import ApprovalCard
from kazma.approvals.model import ApprovalRequest, Decision, Status
from kazma.config import KazmaConfig, failpoints, load_config_text
from kazma.config.store.database import open_database
from kazma.engine.swarm.checkpoints import CHECKPOINT_OUTPUT_SHOWN, CHECKPOINT_TOOL
from kazma.engine.swarm.commands import SwarmCommands
from kazma.engine.swarm.service import CoalescingReporter, SwarmService, request_from
from kazma.engine.swarm.store import MIGRATIONS, StoreUnavailable, SwarmTaskStore
from kazma.engine.swarm.types import ErrorKind, Pattern, SwarmRefused, SwarmRequest, TaskStatus, WorkerResult
from kazma.engine.types import Usage
from tests.approvals_support import ManualClock, RecordingPublisher, approval_service
from tests.outside_writes import write_around
from tests.swarm_support import ScriptedWorker

CONFIG = """
approvals: {approvers: ["telegram:111"], deadline_seconds: 600}
platforms: {telegram: {admins: [111]}}
swarm: {checkpoints: {standard: [1]}, max_parallel: 4}
"""


@dataclass
class Rig:
    service: SwarmService
    approvals: ApprovalService
    publisher: RecordingPublisher
    workers: dict[str, ScriptedWorker]
    reports: list[str]
    delivered: list[tuple[str, str]]


def scripted_workers() -> dict[str, ScriptedWorker]:
    return {
        "researcher": ScriptedWorker("researcher", expertise=("research", "sources")),
        "refiner": ScriptedWorker("refiner", expertise=("specification",)),
        "builder": ScriptedWorker("builder", expertise=("code", "build", "script")),
        "validator": ScriptedWorker("validator", expertise=("test", "review")),
    }


@asynccontextmanager
async def rig(
    path: Path,
    *,
    workers: dict[str, ScriptedWorker] | None = None,
    config: KazmaConfig | None = None,
    clock: ManualClock | None = None,
    publisher: RecordingPublisher | None = None,
    two_files: bool = False,
) -> AsyncIterator[Rig]:
    cfg = config or load_config_text(CONFIG).config
    publisher = publisher or RecordingPublisher()
    reports: list[str] = []
    delivered: list[tuple[str, str]] = []
    # One file for the tasks and the approvals, as in `kazma run`: a checkpoint's card and its paused row commit
    # together (``two_files`` keeps them apart, the order a checkpoint takes then is tested too).
    conn = await open_database(path.with_suffix(".swarm.db") if two_files else path, migrations=MIGRATIONS)

    async def report(text: str) -> None:
        reports.append(text)

    async def deliver(target: str, text: str) -> None:
        delivered.append((target, text))

    async def no_sleep(_: float) -> None:
        return

    async with approval_service(path, config=cfg, publisher=publisher, clock=clock, poll_interval=0.01) as approvals:
        scripted = workers or scripted_workers()
        service = SwarmService(
            SwarmTaskStore(conn),
            scripted,
            cfg,
            approvals=approvals,
            reporter=CoalescingReporter(report, interval=0.01),
            deliver=deliver,
            sleep=no_sleep,
        )
        try:
            yield Rig(service, approvals, publisher, scripted, reports, delivered)
        finally:
            await service.close()
            await conn.close()


def request(pattern: Pattern, workers: Sequence[str], prompt: str = "do it", **kw: object) -> SwarmRequest:
    return SwarmRequest(pattern, tuple(workers), prompt, "telegram:111", conversation="telegram:-1001", **kw)  # type: ignore[arg-type]


async def paused(r: Rig, task_id: str) -> None:
    """Wait until the task's checkpoint card is out: its paused row committed with it (nothing else is awaited,
    so a test that stops here stops in the window between the two, had they been two writes)."""
    async with asyncio.timeout(20):
        while not r.publisher.published:
            await asyncio.sleep(0.01)


async def finished(service: SwarmService, task_id: str) -> TaskStatus:
    record = await service.wait(task_id, 30)
    assert record is not None
    return record.status


async def test_dispatch_broadcast_fanout_consult_and_pipeline_end_to_end(tmp_path: Path) -> None:
    async with rig(tmp_path / "a.db") as r:
        task = await r.service.submit(request(Pattern.DISPATCH, ["builder"]))
        assert await finished(r.service, task) is TaskStatus.SUCCEEDED
        task = await r.service.submit(request(Pattern.DISPATCH, ["auto"], "write a build script"))
        record = await r.service.wait(task, 30)
        assert record is not None
        assert record.result is not None
        assert record.result["output"] == "builder ok"
        task = await r.service.submit(request(Pattern.BROADCAST, []))
        assert await finished(r.service, task) is TaskStatus.SUCCEEDED
        assert all(w.seen for w in r.workers.values())
        task = await r.service.submit(request(Pattern.FAN_OUT, ["researcher", "builder"], aggregation="vote"))
        assert await finished(r.service, task) is TaskStatus.SUCCEEDED
        task = await r.service.submit(request(Pattern.CONSULT, ["researcher", "validator"]))
        assert await finished(r.service, task) is TaskStatus.SUCCEEDED
        task = await r.service.submit(request(Pattern.PIPELINE, ["researcher", "builder"]))
        assert await finished(r.service, task) is TaskStatus.SUCCEEDED
        assert "Untrusted data from stage 1 (researcher)" in r.workers["builder"].seen[-1][1]
        assert (await r.service.store.journaled(task))[0].worker == "researcher"
        assert r.delivered[-1][0] == "telegram:-1001"


@pytest.mark.parametrize(
    ("replies", "status"),
    [
        ({"researcher": [WorkerResult("researcher", True, output="x")]}, TaskStatus.SUCCEEDED),
        ({"builder": [WorkerResult("builder", False, error="bad key (401)", error_kind=ErrorKind.PERMANENT)]},
         TaskStatus.PARTIAL),
        ({n: [WorkerResult(n, False, error="401", error_kind=ErrorKind.PERMANENT)] for n in ("researcher", "builder")},
         TaskStatus.FAILED),
    ],
)  # fmt: skip
async def test_fan_out_partial_and_failed(
    tmp_path: Path, replies: dict[str, list[WorkerResult]], status: TaskStatus
) -> None:
    workers = scripted_workers()
    for name, script in replies.items():
        workers[name].replies = list(script)
    async with rig(tmp_path / "a.db", workers=workers) as r:
        task = await r.service.submit(request(Pattern.FAN_OUT, ["researcher", "builder"]))
        assert await finished(r.service, task) is status


@pytest.mark.parametrize(
    ("req", "message"),
    [
        (request(Pattern.DISPATCH, ["nobody"]), "unknown worker(s): nobody"),
        (request(Pattern.DISPATCH, ["auto"], "bake a cake"), "no worker's expertise matches"),
        (request(Pattern.FAN_OUT, ["builder"] * 33), "33 workers requested; at most 32"),
        (request(Pattern.FAN_OUT, ["builder"], "x" * (64 * 1024 + 1)), "the limit is 65,536 bytes (64 KiB)"),
        (request(Pattern.FAN_OUT, ["builder"], aggregation="average"), "unknown aggregation strategy 'average'"),
        (request(Pattern.FAN_OUT, ["builder"], "   "), "the task is empty"),
    ],
)
async def test_out_of_range_requests_are_refused_before_anything_runs(
    tmp_path: Path, req: SwarmRequest, message: str
) -> None:
    async with rig(tmp_path / "a.db") as r:
        with pytest.raises(SwarmRefused, match=message.replace("(", r"\(").replace(")", r"\)")):
            await r.service.submit(req)
        assert await r.service.store.history() == []


async def test_at_capacity_says_when_to_retry(tmp_path: Path) -> None:
    gate = asyncio.Event()
    workers = scripted_workers()
    workers["builder"].gate = gate
    cfg = load_config_text(CONFIG.replace("max_parallel: 4", "max_parallel: 1")).config
    async with rig(tmp_path / "a.db", workers=workers, config=cfg) as r:
        first = await r.service.submit(request(Pattern.DISPATCH, ["builder"]))
        with pytest.raises(SwarmRefused, match=r"at capacity, retry in \d+ s"):
            await r.service.submit(request(Pattern.DISPATCH, ["builder"]))
        gate.set()
        assert await finished(r.service, first) is TaskStatus.SUCCEEDED


async def test_checkpoint_approved_by_a_press_resumes_after_the_journal(tmp_path: Path) -> None:
    async with rig(tmp_path / "a.db") as r:
        task = await r.service.submit(request(Pattern.PIPELINE, ["researcher", "refiner"], preset="standard"))
        await paused(r, task)
        record = await r.service.store.get(task)
        assert record is not None
        assert record.status is TaskStatus.PAUSED
        card = r.publisher.published[0]
        assert card.tool == "pipeline_checkpoint"
        press = await r.approvals.decide_from_button(card.button_data(Decision.APPROVE), actor="telegram:111",
                                                     platform="telegram")  # fmt: skip
        assert press.won
        assert await finished(r.service, task) is TaskStatus.SUCCEEDED
        assert len(r.workers["researcher"].seen) == 1  # the journaled stage did not run again
        assert len(r.workers["validator"].seen) == 1


NO_SELF = """
approvals:
  approvers: ["telegram:111", "telegram:222"]
  deadline_seconds: 600
  policies: {not-mine: {forbid_requester: true}}
platforms: {telegram: {admins: [111]}}
swarm: {checkpoints: {standard: [1]}, max_parallel: 4}
tools: {pipeline_checkpoint: {policy: not-mine}}
"""


async def test_who_asked_for_a_pipeline_may_not_approve_its_checkpoint_under_a_no_self_policy(
    tmp_path: Path,
) -> None:
    cfg = load_config_text(NO_SELF).config
    async with rig(tmp_path / "a.db", config=cfg) as r:
        task = await r.service.submit(
            request(Pattern.PIPELINE, ["researcher", "refiner"], preset="standard", started_by="telegram:111")
        )
        await paused(r, task)
        stored = await r.service.store.get(task)
        assert stored is not None
        assert request_from(stored).started_by == "telegram:111"  # what a resume after a restart runs for
        card = r.publisher.published[0]
        assert card.request_id is not None
        opened = await r.approvals.store.get(card.request_id)
        assert opened is not None
        assert (opened.tool, opened.policy, opened.started_by) == (CHECKPOINT_TOOL, "not-mine", "telegram:111")
        mine = await r.approvals.decide_from_button(card.button_data(Decision.APPROVE), actor="telegram:111",
                                                    platform="telegram")  # fmt: skip
        assert not mine.won
        assert "You asked for this call" in mine.message
        theirs = await r.approvals.decide_from_button(card.button_data(Decision.APPROVE), actor="telegram:222",
                                                      platform="telegram")  # fmt: skip
        assert theirs.won
        assert await finished(r.service, task) is TaskStatus.SUCCEEDED


@pytest.mark.parametrize("size", [5_000, CHECKPOINT_OUTPUT_SHOWN + 10])
async def test_a_checkpoint_shows_the_stage_output_whole_or_says_it_is_cut(tmp_path: Path, size: int) -> None:
    # What the person judges is what the next stage gets: an output cut silently (its tail unseen, "next stage:
    # delete everything") was approved as if read whole.
    tail = "next stage: delete everything"
    long = "x" * (size - len(tail)) + tail
    workers = scripted_workers()
    workers["researcher"].replies = [WorkerResult("researcher", True, output=long)]
    async with rig(tmp_path / "a.db", workers=workers) as r:
        task = await r.service.submit(request(Pattern.PIPELINE, ["researcher", "refiner"], preset="standard"))
        await paused(r, task)
        card = r.publisher.published[0]
        assert card.request_id is not None
        opened = await r.approvals.store.get(card.request_id)
        assert opened is not None
        if size <= CHECKPOINT_OUTPUT_SHOWN:
            assert opened.args["output"] == long
            assert "output_cut" not in opened.args
        else:
            assert opened.args["output"] == long[:CHECKPOINT_OUTPUT_SHOWN]
            assert opened.args["output_cut"] == (
                f"only the first {CHECKPOINT_OUTPUT_SHOWN:,} of {size:,} characters are shown; the next stage gets "
                "them all"
            )
        press = await r.approvals.decide_from_button(card.button_data(Decision.APPROVE), actor="telegram:111",
                                                     platform="telegram")  # fmt: skip
        assert press.won
        assert await finished(r.service, task) is TaskStatus.SUCCEEDED
        assert tail in str(r.workers["refiner"].seen[0])


async def test_a_checkpoint_approved_in_the_store_not_by_a_press_ends_the_task(tmp_path: Path) -> None:
    # Written by anything that can write the store: approved, with a decided audit row by a real approver, but
    # no seal. The pipeline does not go on.
    async with rig(tmp_path / "a.db") as r:
        task = await r.service.submit(request(Pattern.PIPELINE, ["researcher", "refiner"], preset="standard"))
        async with asyncio.timeout(20):
            while not r.publisher.published:
                await asyncio.sleep(0.01)
        card = r.publisher.published[0]
        await write_around(
            tmp_path / "a.db",
            [
                (
                    "UPDATE approval_requests SET status = 'approved', decided_by = 'telegram:111',"
                    " decided_via = 'telegram', decided_at = 1 WHERE id = ?",
                    (card.request_id,),
                ),
                (
                    "INSERT INTO approval_events (request_id, event, actor, platform, at, args_hash, detail)"
                    " VALUES (?, 'decided', 'telegram:111', 'telegram', 1, ?, 'approved')",
                    (card.request_id, card.args_hash),
                ),
            ],
        )
        assert await finished(r.service, task) is TaskStatus.CANCELLED
        assert r.workers["refiner"].seen == []
        async with asyncio.timeout(10):  # the reporter coalesces: the line arrives a moment later
            while not any("carries no decision seal" in line for line in r.reports):
                await asyncio.sleep(0.01)


async def test_checkpoint_rejected_ends_the_task(tmp_path: Path) -> None:
    async with rig(tmp_path / "a.db") as r:
        commands = SwarmCommands(r.service, r.service.config)
        task = await r.service.submit(request(Pattern.PIPELINE, ["researcher", "refiner"], preset="standard"))
        async with asyncio.timeout(20):
            while (rec := await r.service.store.get(task)) is None or rec.status is not TaskStatus.PAUSED:
                await asyncio.sleep(0.01)
        answer = await commands.run(f"reject {task}", actor="telegram:111", platform="telegram", chat="-1001",
                                    is_admin=True)  # fmt: skip
        assert answer.startswith("Denied.")
        assert await finished(r.service, task) is TaskStatus.CANCELLED
        assert r.workers["refiner"].seen == []
        # Its row and its chat say how it ended (it read "cancelled by telegram:111", and only the home chats'
        # progress lines said "rejected": the chat that asked for the work heard nothing).
        record = await r.service.store.get(task)
        assert record is not None
        assert record.error == "ended at its checkpoint: rejected"
        async with asyncio.timeout(10):
            while not any(t == "telegram:-1001" and "ended at its checkpoint: rejected" in m for t, m in r.delivered):
                await asyncio.sleep(0.01)


async def test_checkpoint_deadline_auto_rejects(tmp_path: Path) -> None:
    clock = ManualClock()
    async with rig(tmp_path / "a.db", clock=clock) as r:
        task = await r.service.submit(request(Pattern.PIPELINE, ["researcher", "refiner"], preset="standard"))
        await paused(r, task)
        clock.advance(601)
        assert await finished(r.service, task) is TaskStatus.CANCELLED
        assert r.workers["refiner"].seen == []
        record = await r.service.store.get(task)
        assert record is not None
        assert record.error == "ended at its checkpoint: timeout"
        async with asyncio.timeout(10):
            while not any("ended at its checkpoint: timeout" in m for _, m in r.delivered):
                await asyncio.sleep(0.01)


async def test_paused_pipeline_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    async with rig(path) as r:
        task = await r.service.submit(request(Pattern.PIPELINE, ["researcher", "refiner"], preset="standard"))
        await paused(r, task)
        card = r.publisher.published[0]
    async with rig(path) as r:  # a new process on the same files
        assert await r.service.recover() == []
        await r.approvals.decide_from_button(card.button_data(Decision.APPROVE), actor="telegram:111",
                                             platform="telegram")  # fmt: skip
        assert await finished(r.service, task) is TaskStatus.SUCCEEDED
        assert r.workers["researcher"].seen == []  # stage 1 came from the journal
        assert [w for w in ("refiner", "builder", "validator") if r.workers[w].seen] == ["refiner", "builder",
                                                                                            "validator"]  # fmt: skip


class StopsAtTheCard(RecordingPublisher):
    """Kazma is told to stop (a clean stop: SIGTERM) the moment a checkpoint's card goes out."""

    def __init__(self) -> None:
        super().__init__()
        self.stop: Callable[[], Awaitable[None]] | None = None
        self.stopping: asyncio.Future[None] | None = None

    async def publish(self, card: ApprovalCard) -> None:
        await super().publish(card)
        if self.stop is not None and self.stopping is None:
            self.stopping = asyncio.ensure_future(self.stop())


@pytest.mark.parametrize("two_files", [False, True], ids=["one-database", "two-files"])
async def test_a_stop_as_the_checkpoint_card_goes_out_keeps_card_and_pause_together(
    tmp_path: Path, two_files: bool
) -> None:
    """The card went out and Kazma stopped before the paused row was written: the task ended cancelled while its
    card stayed pending, and a later press answered "Approved. Recorded" with nothing to resume."""
    path = tmp_path / "a.db"
    publisher = StopsAtTheCard()
    async with rig(path, publisher=publisher, two_files=two_files) as r:
        publisher.stop = r.service.close
        task = await r.service.submit(request(Pattern.PIPELINE, ["researcher", "refiner"], preset="standard"))
        async with asyncio.timeout(20):
            while publisher.stopping is None:
                await asyncio.sleep(0.005)
            await publisher.stopping
        (card,) = publisher.published
        record = await r.service.store.get(task)
        approval = await r.approvals.store.get(card.request_id)
        assert record is not None
        assert approval is not None
        assert (record.status, approval.status) == (TaskStatus.PAUSED, Status.PENDING)
    async with rig(path, two_files=two_files) as r:  # the next start waits at the checkpoint again
        await r.service.recover()
        pressed = await r.approvals.decide_from_button(
            card.button_data(Decision.APPROVE), actor="telegram:111", platform="telegram"
        )
        assert pressed.message.startswith("Approved.")
        assert await finished(r.service, task) is TaskStatus.SUCCEEDED


async def test_a_checkpoint_card_whose_task_ended_without_pausing_is_withdrawn_at_start(tmp_path: Path) -> None:
    """A crash between the card and the pause (stores in two files) left a pending card for a task the start calls
    interrupted: the start withdraws the card, so no press can approve what will never resume."""
    path = tmp_path / "a.db"
    async with rig(path, two_files=True) as r:
        run = await r.service.store.admit(Pattern.PIPELINE, {"prompt": "p", "preset": "standard"}, owner="telegram:111")
        approval = await r.approvals.open(
            CHECKPOINT_TOOL, {"task": run.task_id}, f"swarm:{run.task_id}", "telegram:-1001",
            task_id=run.task_id, durable=True,
        )  # fmt: skip
    async with rig(path, two_files=True) as r:
        await r.service.recover()
        record = await r.service.store.get(run.task_id)
        assert record is not None
        assert record.status is TaskStatus.INTERRUPTED
        after = await r.approvals.store.get(approval.id)
        assert after is not None
        assert after.status is Status.CANCELLED
        assert "the task is interrupted without it" in (after.reason or "")
        assert approval.id in r.publisher.settled


async def test_the_starts_checkpoint_sweep_reads_no_other_pending_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep for stale checkpoint cards read every pending request's row (up to 10,000: after a crash with
    10,000 orphans it was most of the start's CPU, and it ran again every five seconds): it reads only
    checkpoints' rows, and still withdraws the stale one."""
    path = tmp_path / "a.db"
    async with rig(path, two_files=True) as r:
        run = await r.service.store.admit(Pattern.PIPELINE, {"prompt": "p", "preset": "standard"}, owner="telegram:111")
        approval = await r.approvals.open(
            CHECKPOINT_TOOL, {"task": run.task_id}, f"swarm:{run.task_id}", "telegram:-1001",
            task_id=run.task_id, durable=True,
        )  # fmt: skip
        for n in range(5):
            await r.approvals.open("shell", {"command": f"ls /srv/{n}"}, "agent:builder", "telegram:-1001")
    others: list[str] = []
    real = approval_store._row_to_request

    def counted(row: Any) -> ApprovalRequest:
        built = real(row)
        if built.tool != CHECKPOINT_TOOL:
            others.append(built.id)
        return built

    async with rig(path, two_files=True) as r:
        monkeypatch.setattr(approval_store, "_row_to_request", counted)
        await r.service.recover()
        monkeypatch.undo()
        assert others == []
        after = await r.approvals.store.get(approval.id)
        assert after is not None
        assert after.status is Status.CANCELLED


async def test_a_checkpoint_that_fails_while_waiting_withdraws_its_card(tmp_path: Path) -> None:
    failpoints.arm_for_test("swarm.checkpoint.paused=error")
    try:
        async with rig(tmp_path / "a.db") as r:
            task = await r.service.submit(request(Pattern.PIPELINE, ["researcher", "refiner"], preset="standard"))
            assert await finished(r.service, task) is TaskStatus.FAILED
            (card,) = r.publisher.published
            approval = await r.approvals.store.get(card.request_id)
            assert approval is not None
            assert approval.status is Status.CANCELLED
    finally:
        failpoints.disarm()


async def test_state_changing_failure_is_never_retried(tmp_path: Path) -> None:
    workers = scripted_workers()
    workers["builder"].replies = [
        WorkerResult(
            "builder", False, error="timeout after writing", error_kind=ErrorKind.TRANSIENT, changed_state=True
        )
    ]
    async with rig(tmp_path / "a.db", workers=workers) as r:
        task = await r.service.submit(request(Pattern.DISPATCH, ["builder"]))
        assert await finished(r.service, task) is TaskStatus.FAILED
        assert len(workers["builder"].seen) == 1


async def test_transient_failure_is_retried(tmp_path: Path) -> None:
    workers = scripted_workers()
    workers["builder"].replies = [WorkerResult("builder", False, error="503", error_kind=ErrorKind.TRANSIENT)]
    async with rig(tmp_path / "a.db", workers=workers) as r:
        task = await r.service.submit(request(Pattern.DISPATCH, ["builder"]))
        assert await finished(r.service, task) is TaskStatus.SUCCEEDED
        assert len(workers["builder"].seen) == 2


async def test_commands_start_report_cancel_and_confirm_retry_of_unknown_outcomes(tmp_path: Path) -> None:
    gate = asyncio.Event()
    workers = scripted_workers()
    workers["builder"].gate = gate
    async with rig(tmp_path / "a.db", workers=workers) as r:
        commands = SwarmCommands(r.service, r.service.config)

        async def say(text: str, actor: str = "telegram:111") -> str:
            return await commands.run(text, actor=actor, platform="telegram", chat="-1001", is_admin=False)

        started = await say("dispatch builder make the thing")
        assert started.startswith("swarm task ")
        task = started.split()[2]
        assert "running" in await say(f"status {task}")
        assert task in await say("list")
        assert "builder: breaker closed" in await say("workers")
        refused = await say("dispatch builder again", actor="telegram:222")
        assert refused.startswith("/swarm dispatch starts, changes or steers work")
        assert "running" in await say(f"status {task}", actor="telegram:222")  # reading is for anyone
        assert "did you mean 'dispatch'" in await say("dispach builder x")
        assert await say(f"cancel {task}") == (
            f"swarm task {task} cancelled by telegram:111; tools: did not run: no tool that changes anything"
            " was started"
        )
        assert await finished(r.service, task) is TaskStatus.CANCELLED
        gate.set()

        # a task interrupted by a crash: retry asks first, runs on the second ask
        record = await r.service.store.get(task)
        assert record is not None
        run = await r.service.store.admit(Pattern.DISPATCH, record.request, owner="telegram:111")
        await r.service.store.step(run, "builder")
        assert [i.task_id for i in await r.service.store.recover()] == [run.task_id]
        ask = await say(f"retry {run.task_id}")
        assert "may have done part of its work" in ask
        again = await say(f"retry {run.task_id}")
        assert again.startswith(f"swarm task {run.task_id} retried as ")


async def test_progress_is_coalesced() -> None:
    sent: list[str] = []

    async def send(text: str) -> None:
        sent.append(text)

    reporter = CoalescingReporter(send, interval=3600)
    for i in range(50):
        reporter.add(f"step {i}")
    assert sent == []
    await reporter.close()
    assert len(sent) == 1
    assert sent[0].count("\n") == 49


async def test_result_goes_to_the_route_and_tokens_are_recorded(tmp_path: Path) -> None:
    workers = scripted_workers()
    workers["builder"].replies = [WorkerResult("builder", True, output="done", usage=Usage(120, 30))]
    async with rig(tmp_path / "a.db", workers=workers) as r:
        task = await r.service.submit(request(Pattern.DISPATCH, ["builder"], route="slack:C0OTHER01"))
        assert await finished(r.service, task) is TaskStatus.SUCCEEDED
        assert r.delivered == [
            (
                "slack:C0OTHER01",
                f"swarm task {task} succeeded:\ndone\ntools: did not run: no tool that changes anything was started",
            )
        ]
        record = await r.service.store.get(task)
        assert record is not None
        assert record.result is not None
        assert record.result["tokens"] == {"prompt": 120, "completion": 30}


async def test_paused_pipelines_are_capped(tmp_path: Path) -> None:
    cfg = load_config_text(CONFIG.replace("max_parallel: 4", "max_parallel: 4, max_paused_pipelines: 1")).config
    async with rig(tmp_path / "a.db", config=cfg) as r:
        first = await r.service.submit(request(Pattern.PIPELINE, ["researcher", "refiner"], preset="standard"))
        async with asyncio.timeout(20):
            while (rec := await r.service.store.get(first)) is None or rec.status is not TaskStatus.PAUSED:
                await asyncio.sleep(0.01)
        second = await r.service.submit(request(Pattern.PIPELINE, ["researcher", "refiner"], preset="standard"))
        assert await finished(r.service, second) is TaskStatus.FAILED
        record = await r.service.store.get(second)
        assert record is not None
        assert "1 pipelines are already paused" in (record.error or "")


async def test_lead_swarm_tools_need_approval_then_start_and_check(tmp_path: Path) -> None:
    from kazma.approvals import SafetyPolicy
    from kazma.engine.agent import AgentSpec, TurnContext
    from kazma.engine.swarm.lead_tools import swarm_tools

    async with rig(tmp_path / "a.db") as r:
        dispatch, check = swarm_tools(r.service, SafetyPolicy(r.approvals))
        ctx = TurnContext("telegram:-1001", AgentSpec("kazma", "lead", is_lead=True), "telegram:111")
        started = asyncio.ensure_future(
            dispatch.handler({"pattern": "dispatch", "task": "build it", "workers": ["builder"]}, ctx)
        )
        async with asyncio.timeout(20):
            while not r.publisher.published:  # dangerous by default: an approval card first
                await asyncio.sleep(0.01)
        assert r.publisher.published[0].tool == "dispatch_swarm"
        await r.approvals.decide_from_button(
            r.publisher.published[0].button_data(Decision.APPROVE), actor="telegram:111", platform="telegram"
        )
        result = await asyncio.wait_for(started, timeout=20)
        assert result.ok, result.error
        task_id = result.output.split()[2]
        checked = await check.handler({"task_id": task_id, "wait_seconds": 30}, ctx)
        assert checked.ok
        assert checked.output.startswith("status: succeeded")
        too_long = await check.handler({"task_id": task_id, "wait_seconds": 91}, ctx)
        assert not too_long.ok


async def test_a_paused_pipeline_whose_stage_worker_is_gone_after_a_restart_fails_instead_of_skipping_it(
    tmp_path: Path,
) -> None:
    # The resumed pipeline was handed the stages still configured, by position after the journal: with the refiner
    # gone it ran builder and validator and called the task succeeded, a stage the person approved never run.
    path = tmp_path / "a.db"
    async with rig(path) as r:
        task = await r.service.submit(request(Pattern.PIPELINE, ["researcher", "refiner"], preset="standard"))
        await paused(r, task)
        card = r.publisher.published[0]
    workers = scripted_workers()
    del workers["refiner"]
    async with rig(path, workers=workers) as r:
        assert await r.service.recover() == []
        await r.approvals.decide_from_button(card.button_data(Decision.APPROVE), actor="telegram:111",
                                             platform="telegram")  # fmt: skip
        record = await r.service.wait(task, 30)
        assert record is not None
        assert record.status is TaskStatus.FAILED
        assert "its stage worker refiner is no longer configured" in (record.error or "")
        assert [name for name, worker in workers.items() if worker.seen] == []  # nothing after the checkpoint ran


async def test_a_stage_whose_journal_write_failed_is_written_before_the_pause_and_never_runs_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pause went ahead without stage 1 in the journal: approved after a restart, stage 1 (its tools too) ran
    # again, and the pipeline paused at the same checkpoint a second time.
    path = tmp_path / "a.db"
    async with rig(path) as r:
        real = r.service.store.journal
        failures: list[int] = []

        async def refused_once(run: Any, idx: int, worker: str, result: WorkerResult) -> bool:
            if not failures:
                failures.append(idx)
                raise StoreUnavailable("journal", "database is locked")
            return await real(run, idx, worker, result)

        monkeypatch.setattr(r.service.store, "journal", refused_once)
        task = await r.service.submit(request(Pattern.PIPELINE, ["researcher", "refiner"], preset="standard"))
        await paused(r, task)
        card = r.publisher.published[0]
        assert failures == [0]
        assert [step.idx for step in await r.service.store.journaled(task)] == [0]
    async with rig(path) as r:  # a new process on the same files
        assert await r.service.recover() == []
        await r.approvals.decide_from_button(card.button_data(Decision.APPROVE), actor="telegram:111",
                                             platform="telegram")  # fmt: skip
        assert await finished(r.service, task) is TaskStatus.SUCCEEDED
        assert r.workers["researcher"].seen == []  # stage 1 came from the journal, not from running it again


async def test_a_stage_the_journal_still_refuses_at_the_checkpoint_ends_the_task_instead_of_pausing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with rig(tmp_path / "a.db") as r:

        async def refused(run: Any, idx: int, worker: str, result: WorkerResult) -> bool:
            raise StoreUnavailable("journal", "database is locked")

        monkeypatch.setattr(r.service.store, "journal", refused)
        task = await r.service.submit(request(Pattern.PIPELINE, ["researcher", "refiner"], preset="standard"))
        record = await r.service.wait(task, 30)
        assert record is not None
        assert record.status is TaskStatus.FAILED
        assert "stage 1 (researcher)'s result could not be recorded" in (record.error or "")
        assert "pausing at the checkpoint would run it again after a restart" in (record.error or "")
        assert r.publisher.published == []  # no checkpoint card for a pause that did not happen


WITH_TELEGRAM = CONFIG.replace("{admins: [111]}", '{token: "123456:telegram-token", admins: [111]}')


async def test_a_route_to_a_platform_that_is_not_configured_is_refused_before_anything_runs(tmp_path: Path) -> None:
    # Only telegram runs: the bus drops a post to slack with a log line, so "workers -> slack:…" answered
    # "Posted to slack:C0123ABCD." and a task routed there started, its result lost where it was said to go.
    async with rig(tmp_path / "a.db", config=load_config_text(WITH_TELEGRAM).config) as r:
        commands = SwarmCommands(r.service, r.service.config)
        for text, target, setting in (
            ("workers -> slack:C0123ABCD", "slack:C0123ABCD", "platforms.slack.bot_token"),
            ("dispatch researcher find it -> discord:123456", "discord:123456", "platforms.discord.token"),
        ):
            answer = await commands.run(text, actor="telegram:111", platform="telegram", chat="-1001", is_admin=True)
            assert answer.startswith(f"cannot route to {target}: "), answer
            assert f"is not configured here ({setting} is empty), so nothing could be posted there" in answer
        assert r.delivered == []
        assert await r.service.store.list() == []
        # the configured platform and the console still take routes
        assert await commands.run("workers -> telegram:-100999", actor="telegram:111", platform="telegram",
                                  chat="-1001", is_admin=True) == "Posted to telegram:-100999."  # fmt: skip
        assert await commands.run("workers -> web:ops", actor="telegram:111", platform="telegram",
                                  chat="-1001", is_admin=True) == "Posted to web:ops."  # fmt: skip


async def test_a_route_on_a_command_that_starts_no_work_posts_its_answer_there(tmp_path: Path) -> None:
    # Help says "End any command with -> <platform>:<chat> to post the result in another chat": for status,
    # history or workers the route was accepted (admins only) and then ignored, the answer given in place.
    async with rig(tmp_path / "a.db", config=load_config_text(WITH_TELEGRAM).config) as r:
        commands = SwarmCommands(r.service, r.service.config)
        answer = await commands.run("workers -> telegram:-100999", actor="telegram:111", platform="telegram",
                                    chat="-1001", is_admin=True)  # fmt: skip
        assert answer == "Posted to telegram:-100999."
        [(target, text)] = r.delivered
        assert target == "telegram:-100999"
        assert "researcher: breaker closed" in text


async def test_every_paused_pipeline_waits_again_after_a_restart_even_past_a_lowered_limit(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    async with rig(path) as r:
        first = await r.service.submit(request(Pattern.PIPELINE, ["researcher", "refiner"], preset="standard"))
        await paused(r, first)
        second = await r.service.submit(request(Pattern.PIPELINE, ["researcher", "refiner"], preset="standard"))
        async with asyncio.timeout(20):
            while len(r.publisher.published) < 2:
                await asyncio.sleep(0.01)
        cards = {card.request_id: card for card in r.publisher.published}
    lowered = load_config_text(CONFIG.replace("max_parallel: 4}", "max_parallel: 4, max_paused_pipelines: 1}")).config
    async with rig(path, config=lowered) as r:  # restarted with room for one paused pipeline
        await r.service.recover()
        for card in cards.values():  # the older card too
            await r.approvals.decide_from_button(card.button_data(Decision.APPROVE), actor="telegram:111",
                                                 platform="telegram")  # fmt: skip
        assert await finished(r.service, first) is TaskStatus.SUCCEEDED
        assert await finished(r.service, second) is TaskStatus.SUCCEEDED


async def test_a_pipeline_ending_at_its_checkpoint_is_said_whole_while_the_poller_runs(tmp_path: Path) -> None:
    # The poller for cancels made elsewhere took this process's own checkpoint ending (the row it had just
    # written) for one: it cancelled the task while its ending was being delivered, and the chat heard nothing.
    async with rig(tmp_path / "a.db") as r:
        r.service.ended_poll_seconds = 0.01
        slow: list[str] = []
        delivered_then = r.service.deliver
        assert delivered_then is not None

        async def slow_platform(target: str, text: str) -> None:
            slow.append(text)
            polled = r.service.polls
            async with asyncio.timeout(20):
                while r.service.polls < polled + 3:  # the poller looks at the ended row meanwhile
                    await asyncio.sleep(0.005)
            await delivered_then(target, text)

        r.service.deliver = slow_platform
        commands = SwarmCommands(r.service, r.service.config)
        task = await r.service.submit(request(Pattern.PIPELINE, ["researcher", "refiner"], preset="standard"))
        await paused(r, task)
        await commands.run(f"reject {task}", actor="telegram:111", platform="telegram", chat="-1001", is_admin=True)
        async with asyncio.timeout(20):
            while not any("ended at its checkpoint: rejected" in m for _, m in r.delivered):
                await asyncio.sleep(0.01)
        assert not any("ended elsewhere" in line for line in r.reports)
