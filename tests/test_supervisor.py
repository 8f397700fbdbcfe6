"""The one task supervisor: a failing task is logged and counted when it ends, never lost; stop drains, then
cancels; a kept loop starts again by the backoff; the owners that moved onto it report what they lost."""

from __future__ import annotations

import asyncio
import gc
import io
import sys
from typing import Any

import pytest
from structlog.testing import capture_logs

from kazma.adapters.contract import Handlers, Inbound, Press
from kazma.adapters.terminal import TerminalAdapter
from kazma.approvals.model import Decision, PressResult
from kazma.config.backoff import Backoff
from kazma.config.metrics import failure_count
from kazma.config.supervisor import Supervisor
from tests.ingress_support import make_card

WAIT = 10.0


class Boom(RuntimeError):
    pass


async def _fail(after: asyncio.Event | None = None) -> None:
    if after is not None:
        await after.wait()
    raise Boom("the work broke")


def _unretrieved() -> list[dict[str, Any]]:
    """Failures asyncio would report as "Task exception was never retrieved" (read after a collection)."""
    seen: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, context: seen.append(context))
    return seen


async def test_a_failing_task_is_logged_and_counted_when_it_ends_and_never_lost() -> None:
    lost = _unretrieved()
    tasks = Supervisor("test_task_a", platform="telegram")
    before = failure_count("test_task_a", "telegram")
    go = asyncio.Event()
    with capture_logs() as events:
        task = tasks.spawn(_fail(go), name="work-1")
        go.set()
        await asyncio.wait_for(asyncio.wait({task}), WAIT)
        await asyncio.sleep(0)  # the done callbacks run on the next turn of the loop
    failed = [e for e in events if e["event"] == "task.failed"]
    assert [(e["site"], e["platform"], e["task"], e["error"]) for e in failed] == [
        ("test_task_a", "telegram", "work-1", "Boom: the work broke")
    ]
    assert failed[0]["log_level"] == "error"
    assert isinstance(failed[0]["exc_info"], Boom)
    assert failure_count("test_task_a", "telegram") == before + 1
    assert tasks.failures == 1
    assert len(tasks) == 0
    del task
    gc.collect()
    assert lost == []  # retrieved by the supervisor: asyncio has nothing to complain about


async def test_success_and_cancellation_are_not_failures() -> None:
    tasks = Supervisor("test_task_b")
    before = failure_count("test_task_b")
    hang = asyncio.Event()
    with capture_logs() as events:
        done = tasks.spawn(asyncio.sleep(0, result=7), name="fine")
        stuck = tasks.spawn(hang.wait(), name="stuck")
        assert await asyncio.wait_for(done, WAIT) == 7
        assert tasks.cancel() == 1
        await asyncio.wait_for(asyncio.wait({stuck}), WAIT)
        await asyncio.sleep(0)
    assert stuck.cancelled()
    assert [e for e in events if e["event"] == "task.failed"] == []
    assert failure_count("test_task_b") == before
    assert tasks.failures == 0


async def test_an_awaited_task_s_failure_is_its_caller_s_alone() -> None:
    tasks = Supervisor("test_task_c")
    before = failure_count("test_task_c")
    with capture_logs() as events:
        task = tasks.spawn(_fail(), name="decision", awaited=True)
        with pytest.raises(Boom):
            await asyncio.wait_for(task, WAIT)
        await asyncio.sleep(0)
    assert [e for e in events if e["event"] == "task.failed"] == []
    assert failure_count("test_task_c") == before


async def test_stop_lets_work_finish_within_the_grace_then_cancels_the_rest() -> None:
    tasks = Supervisor("test_task_d")
    finish, forever = asyncio.Event(), asyncio.Event()
    ended: list[str] = []

    async def quick() -> None:
        await finish.wait()
        ended.append("quick finished")

    async def stuck() -> None:
        try:
            await forever.wait()
        finally:
            ended.append("stuck cleaned up")

    tasks.spawn(quick(), name="quick")
    slow = tasks.spawn(stuck(), name="stuck")
    assert tasks.names() == ["quick", "stuck"]
    stopping = asyncio.create_task(tasks.stop(grace=WAIT))
    await asyncio.sleep(0)
    finish.set()  # within the grace: quick ends by itself, uncancelled
    # stuck would hold the first stop for its whole grace; a second stop with none cancels it at once
    while "quick finished" not in ended:
        await asyncio.sleep(0)
    cancelled = await asyncio.wait_for(tasks.stop(), WAIT)
    assert cancelled == {slow}
    assert slow.cancelled()
    assert ended == ["quick finished", "stuck cleaned up"]  # cancelled and awaited: its cleanup ran
    assert await asyncio.wait_for(stopping, WAIT) == set()  # the first stop found nothing left to cancel
    assert len(tasks) == 0


async def test_stop_with_no_grace_cancels_everything_and_waits_for_it() -> None:
    tasks = Supervisor("test_task_e")
    cleaned: list[int] = []

    async def worker(n: int) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0)  # cleanup that itself awaits: stop waits for it
            cleaned.append(n)

    for n in range(5):
        tasks.spawn(worker(n), name=f"w{n}")
    await asyncio.sleep(0)
    assert len(await asyncio.wait_for(tasks.stop(), WAIT)) == 5
    assert sorted(cleaned) == [0, 1, 2, 3, 4]


async def test_stop_ends_a_task_that_lost_its_cancel_and_went_on() -> None:
    """Python 3.11's asyncio.wait_for returns its result when a cancel meets it (psycopg_pool waits for a connection
    with it): the task goes on as if never cancelled, and a stop that cancelled each task once waited for it
    forever (an app's stop hung, its sweep asleep in its loop, "cancelling")."""
    tasks = Supervisor("test_task_lost_cancel")
    answer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    went_on: list[bool] = []

    async def worker() -> None:
        await asyncio.wait_for(answer, WAIT)
        went_on.append(True)
        await asyncio.Event().wait()  # the loop's sleep: only a cancel ends it

    task = tasks.spawn(worker(), name="loses-its-cancel")
    await asyncio.sleep(0)  # the worker waits in wait_for
    answer.set_result(None)  # the answer and the stop's cancel meet in the same turn
    async with asyncio.timeout(WAIT):
        assert await tasks.stop() == {task}
    assert task.cancelled()
    if sys.version_info < (3, 12):  # the cancel was lost once, as 3.11 loses it
        assert went_on == [True]


async def test_drain_waits_for_work_started_while_it_waits() -> None:
    tasks = Supervisor("test_task_f")
    order: list[str] = []

    async def second() -> None:
        await asyncio.sleep(0)
        order.append("second")

    async def first() -> None:
        await asyncio.sleep(0)
        tasks.spawn(second(), name="second")
        order.append("first")

    tasks.spawn(first(), name="first")
    await asyncio.wait_for(tasks.drain(), WAIT)
    assert order == ["first", "second"]
    assert len(tasks) == 0


async def test_a_task_that_stops_its_own_supervisor_does_not_wait_for_itself() -> None:
    tasks = Supervisor("test_task_g")
    other = tasks.spawn(asyncio.Event().wait(), name="other")

    async def stopper() -> set[asyncio.Task[Any]]:
        return await tasks.stop()

    me = tasks.spawn(stopper(), name="stopper")
    assert await asyncio.wait_for(me, WAIT) == {other}


async def test_tracking_counts_a_foreign_task_only_inside_the_block() -> None:
    tasks = Supervisor("test_task_h")
    inside, leave, left, again = asyncio.Event(), asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def listener() -> None:  # a task a library started, not the supervisor
        with tasks.tracking():
            inside.set()
            await leave.wait()
        left.set()
        await again.wait()
        with tasks.tracking():
            await asyncio.Event().wait()

    foreign = asyncio.create_task(listener())
    await asyncio.wait_for(inside.wait(), WAIT)
    assert len(tasks) == 1
    assert await tasks.wait(0) == {foreign}  # still running: waiting and stopping see it
    leave.set()
    await asyncio.wait_for(left.wait(), WAIT)
    assert len(tasks) == 0
    assert await tasks.wait() == set()  # outside the block it is not this supervisor's
    again.set()
    while len(tasks) == 0:  # back inside
        await asyncio.sleep(0)
    assert await asyncio.wait_for(tasks.stop(), WAIT) == {foreign}
    assert foreign.cancelled()
    assert len(tasks) == 0


async def test_a_kept_loop_starts_again_by_the_backoff_until_it_returns() -> None:
    tasks = Supervisor("test_task_i")
    before = failure_count("test_task_i")
    backoff = Backoff(base=0.01, cap=0.04, jitter=False)
    runs: list[int] = []

    async def loop() -> None:
        runs.append(len(runs) + 1)
        if len(runs) < 4:
            raise Boom(f"run {len(runs)}")

    with capture_logs() as events:
        kept = tasks.keep(loop, name="sweep", backoff=backoff)
        await asyncio.wait_for(kept, WAIT)
    failed = [(e["task"], e["error"], e["restart_in"]) for e in events if e["event"] == "task.failed"]
    assert failed == [("sweep", "Boom: run 1", 0.01), ("sweep", "Boom: run 2", 0.02), ("sweep", "Boom: run 3", 0.04)]
    assert runs == [1, 2, 3, 4]
    assert failure_count("test_task_i") == before + 3
    assert tasks.failures == 3


async def test_a_kept_loop_is_stopped_by_cancelling_it() -> None:
    tasks = Supervisor("test_task_j")
    started = asyncio.Event()

    async def loop() -> None:
        started.set()
        await asyncio.Event().wait()

    kept = tasks.keep(loop, name="watch", backoff=Backoff(base=0.01, cap=0.01))
    await asyncio.wait_for(started.wait(), WAIT)
    assert await asyncio.wait_for(tasks.stop(), WAIT) == {kept}
    assert kept.cancelled()
    assert tasks.failures == 0


async def test_a_terminal_press_that_fails_is_reported_not_lost() -> None:
    """An owner moved onto the supervisor: the terminal's press task, whose failure used to vanish with it."""

    async def on_press(_press: Press) -> PressResult:
        raise Boom("the decision could not be stored")

    async def on_inbound(_message: Inbound) -> None:
        return None

    before = failure_count("terminal_task")
    adapter = TerminalAdapter(out=io.StringIO(), interactive=False, auto=Decision.APPROVE)
    await adapter.start(Handlers(on_inbound=on_inbound, on_press=on_press))
    with capture_logs() as events:
        card = make_card("cli:terminal")
        await adapter.post_card(card)
        async with asyncio.timeout(WAIT):
            while failure_count("terminal_task") == before:
                await asyncio.sleep(0.01)
    await adapter.stop()
    failed = [e for e in events if e["event"] == "task.failed"]
    assert [(e["site"], e["task"], e["error"]) for e in failed] == [
        ("terminal_task", f"terminal-press-{card.request_id}", "Boom: the decision could not be stored")
    ]
