"""Bounded waits keep a cancel (kazma.config.waits), for an event and for any awaitable, and every bounded wait in
the source uses them."""

from __future__ import annotations

import asyncio
import re

import pytest

from kazma.config.waits import bounded, until_set
from tests.conftest import REPO

SOURCE = ("adapters", "approvals", "bot", "config", "engine")


async def _waiting(event: asyncio.Event, seconds: float | None) -> tuple[asyncio.Task[bool], asyncio.Event]:
    """A task inside ``until_set``, suspended on the event (``started`` is set in the step that reaches it)."""
    started = asyncio.Event()

    async def wait() -> bool:
        started.set()
        return await until_set(event, seconds)

    task = asyncio.create_task(wait())
    await started.wait()
    return task, started


async def test_a_cancel_that_arrives_as_the_event_is_set_is_kept() -> None:
    # Python 3.11's wait_for returned True here and dropped the cancel: the loop around it went round again.
    event = asyncio.Event()
    task, _ = await _waiting(event, 3600)
    event.set()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_it_says_whether_the_event_was_set() -> None:
    event = asyncio.Event()
    assert await until_set(event, 0.01) is False
    task, _ = await _waiting(event, None)
    event.set()
    assert await task is True
    assert await until_set(event, 0) is True  # already set: no wait at all


async def test_a_cancel_that_arrives_as_the_awaited_call_finishes_is_kept() -> None:
    # The audit sink's delivery: answered in the very turn its sink was cancelled. wait_for returned the answer
    # and the sink went on delivering; the stop that cancelled it waited for it for good.
    answered: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    started = asyncio.Event()

    async def deliver() -> str:
        started.set()
        return await bounded(answered, 3600)

    task = asyncio.create_task(deliver())
    await started.wait()
    answered.set_result("ok")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_bounded_gives_the_result_or_times_out_and_cancels_what_it_waited_for() -> None:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[int] = loop.create_future()
    loop.call_soon(done.set_result, 7)
    assert await bounded(done, 60) == 7
    never: asyncio.Future[int] = loop.create_future()
    with pytest.raises(TimeoutError):
        await bounded(never, 0.01)
    assert never.cancelled()  # as wait_for did: what timed out is not left running
    assert await bounded(asyncio.sleep(0, result="unbounded"), None) == "unbounded"


def test_no_bounded_wait_in_the_source_uses_wait_for() -> None:
    pattern = re.compile(r"asyncio\.wait_for\(")
    found = [
        f"{path.relative_to(REPO)}:{number}"
        for folder in SOURCE
        for path in sorted((REPO / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line) and not line.lstrip().startswith(("#", "On Python"))
    ]
    assert found == [], f"use kazma.config.waits.until_set or bounded: {found}"
