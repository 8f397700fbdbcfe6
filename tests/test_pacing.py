from __future__ import annotations

import asyncio

import pytest

from kazma.adapters.pacing import ChatRateLimiter


class FakeTime:
    """A clock that moves only when the limiter sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


async def test_min_interval_per_chat_and_chats_are_independent() -> None:
    t = FakeTime()
    limiter = ChatRateLimiter(min_interval=1.0, clock=t.clock, sleep=t.sleep)
    assert await limiter.acquire("a") == 0.0
    assert await limiter.acquire("b") == 0.0
    assert await limiter.acquire("a") == 1.0
    t.now += 0.25
    assert await limiter.acquire("a") == 0.75


async def test_drafts_leave_part_of_the_window_to_other_sends() -> None:
    t = FakeTime()
    limiter = ChatRateLimiter(min_interval=0.0, per_window=4, window=60.0, clock=t.clock, sleep=t.sleep, drafts_leave=1)
    for _ in range(3):
        assert await limiter.acquire("group", draft=True) == 0.0
    # a fourth draft waits for the oldest send to leave the window; an ordinary send takes the slot kept for it
    assert limiter.delay_for("group", draft=True) == 60.0
    assert await limiter.acquire("group") == 0.0
    assert await limiter.acquire("group", draft=True) == 60.0


def test_drafts_must_keep_a_send_of_the_window() -> None:
    with pytest.raises(ValueError, match="drafts_leave"):
        ChatRateLimiter(per_window=5, drafts_leave=5)


async def test_window_cap() -> None:
    t = FakeTime()
    limiter = ChatRateLimiter(min_interval=1.0, per_window=20, window=60.0, clock=t.clock, sleep=t.sleep)
    start = t.now
    for _ in range(20):
        await limiter.acquire("group")
    assert t.now - start == 19.0
    waited = await limiter.acquire("group")
    # the 21st send waits until the first one leaves the 60 s window
    assert t.now == start + 60.0
    assert waited == 41.0


async def test_block_after_429_delays_next_send() -> None:
    t = FakeTime()
    limiter = ChatRateLimiter(min_interval=0.0, clock=t.clock, sleep=t.sleep)
    await limiter.acquire("c")
    limiter.block("c", 7.0)
    assert limiter.delay_for("c") == 7.0
    assert await limiter.acquire("c") == 7.0


async def test_concurrent_senders_are_serialised_in_one_chat() -> None:
    t = FakeTime()
    limiter = ChatRateLimiter(min_interval=1.0, clock=t.clock, sleep=t.sleep)
    stamps: list[float] = []

    async def send() -> None:
        await limiter.acquire("x")
        stamps.append(t.now)

    await asyncio.gather(*(send() for _ in range(5)))
    assert stamps == [1000.0, 1001.0, 1002.0, 1003.0, 1004.0]


async def test_an_announced_card_edit_goes_before_a_send_queued_ahead_of_it() -> None:
    # Real time, short gaps: the order of the two sends is what is checked, not how long they took.
    limiter = ChatRateLimiter(min_interval=0.05)
    order: list[str] = []
    await limiter.acquire("group")  # the card's post took the chat's slot

    async def send(name: str, *, urgent: bool = False) -> None:
        await limiter.acquire("group", urgent=urgent)
        order.append(name)
        if urgent:
            limiter.expected_done("group")

    reply = asyncio.create_task(send("reply"))  # the agent answers the decision first...
    await asyncio.sleep(0)
    limiter.expect("group")  # ...but the decision announced its card edit
    edit = asyncio.create_task(send("edit", urgent=True))
    await asyncio.wait_for(asyncio.gather(reply, edit), timeout=10)
    assert order == ["edit", "reply"]


async def test_an_announced_edit_that_never_comes_holds_sends_only_briefly() -> None:
    limiter = ChatRateLimiter(min_interval=0.0, expect_seconds=0.05)
    limiter.expect("group")
    await asyncio.wait_for(limiter.acquire("group"), timeout=10)  # the announcement lapsed; the send went
    limiter.expect("group")
    limiter.expected_done("group")
    assert await asyncio.wait_for(limiter.acquire("group"), timeout=10) == 0.0  # released: no wait at all
