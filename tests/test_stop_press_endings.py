"""A press still being decided when Kazma stops: its presser hears how it ended before the platform closes."""

from __future__ import annotations

import asyncio
import sqlite3
from dataclasses import replace

import pytest

from kazma.adapters.contract import Press
from kazma.adapters.press_policy import PRESS_CUT_OFF, PRESS_PENDING
from kazma.adapters.telegram import TelegramAdapter
from kazma.approvals.model import Decision, PressResult, PressVerdict
from kazma.config.metrics import failure_count
from tests.fakes.telegram import FakeTelegram, Fault
from tests.test_telegram_adapter import GROUP, MEMBER, WAIT, Factory, fake, make_adapter, make_card

__all__ = ["fake", "make_adapter"]  # the fixtures, shared with the adapter's own tests

pytestmark = pytest.mark.filterwarnings("ignore:.*retry_after.*:telegram.warnings.PTBDeprecationWarning")


async def test_a_slow_press_refused_while_the_adapter_stops_is_still_told(
    fake: FakeTelegram, make_adapter: Factory
) -> None:
    """The press was answered "Recorded, updating…"; its decision comes back (refused) after the stop began,
    while the stop lets work in flight finish. The notice it makes is work started during that grace: the stop
    used to wait only for the work it saw when it began, closed the bot, and the refusal was never said."""
    bot, recorder = await make_adapter(press_timeout=0.2, stop_grace=WAIT)
    card = make_card({"path": "/tmp/x"})
    ref = await bot.post_card(card)
    hold = recorder.hold = asyncio.Event()
    refusal = "You are not an approver for this request; nothing was recorded."
    recorder.result = PressResult(PressVerdict.REFUSED, refusal)
    query = fake.push_callback(GROUP, ref.message_id, MEMBER, card.button_data(Decision.APPROVE), username="mia")
    assert (await fake.wait_for_answer(query))["text"] == PRESS_PENDING

    receiving_stopped = TelegramAdapter._stop_receiving

    async def stop_receiving(self: TelegramAdapter) -> None:
        await receiving_stopped(self)
        hold.set()  # the decision comes back as the stop starts draining the work in flight

    bot._stop_receiving = stop_receiving.__get__(bot)  # type: ignore[method-assign]
    fake.script("sendMessage", Fault.too_many_requests(1))  # the notice waits its turn a second
    await asyncio.wait_for(bot.stop(), 3 * WAIT)
    notices = [m.text for m in fake.bot_messages(GROUP) if m.message_id != int(ref.message_id)]
    assert notices == [f"@mia: {refusal}"]


async def _pending_press_cut_off_by_stop(
    fake: FakeTelegram, make_adapter: Factory, recorded: bool | Exception | None
) -> tuple[list[str], list[Press]]:
    """A press answered "Recorded, updating…" whose decision never comes back before the stop's grace ends (the
    decision is cancelled); the store, asked, says ``recorded``. The notices posted beside the card, and what the
    store was asked about."""
    bot, recorder = await make_adapter(press_timeout=0.2, stop_grace=1.0)
    asked: list[Press] = []

    async def press_recorded(press: Press) -> bool | None:
        asked.append(press)
        if isinstance(recorded, Exception):
            raise recorded
        return recorded

    assert bot._handlers is not None
    bot._handlers = replace(bot._handlers, press_recorded=press_recorded)
    card = make_card({"path": "/tmp/x"})
    ref = await bot.post_card(card)
    recorder.hold = asyncio.Event()  # never set: the decision is still running when the grace ends
    query = fake.push_callback(GROUP, ref.message_id, MEMBER, card.button_data(Decision.APPROVE), username="mia")
    assert (await fake.wait_for_answer(query))["text"] == PRESS_PENDING
    await asyncio.wait_for(bot.stop(), 3 * WAIT)
    notices = [m.text for m in fake.bot_messages(GROUP) if m.message_id != int(ref.message_id)]
    return notices, asked


@pytest.mark.parametrize("recorded", [False, None, sqlite3.OperationalError("database is locked")])
async def test_a_pending_press_cancelled_by_the_stop_is_told_it_was_not_recorded(
    fake: FakeTelegram, make_adapter: Factory, recorded: bool | Exception | None
) -> None:
    """The presser was told "Recorded, updating…"; the stop's grace ran out and cancelled the decision. That
    ending was silent: the person believed their press counted. The store (not on record, cannot say, or cannot
    be read) decides what they are told now: it was not recorded, press again."""
    before = failure_count("press_cut_off", "telegram")
    notices, asked = await _pending_press_cut_off_by_stop(fake, make_adapter, recorded)
    assert [p.actor for p in asked] == [f"telegram:{MEMBER}"]
    assert notices == [f"@mia: {PRESS_CUT_OFF}"]
    assert failure_count("press_cut_off", "telegram") == before + 1


async def test_a_pending_press_cancelled_by_the_stop_after_it_committed_is_not_told_to_press_again(
    fake: FakeTelegram, make_adapter: Factory
) -> None:
    before = failure_count("press_cut_off", "telegram")
    notices, asked = await _pending_press_cut_off_by_stop(fake, make_adapter, True)
    assert len(asked) == 1
    assert notices == []  # "Recorded, updating…" was true; the card's edit says the rest
    assert failure_count("press_cut_off", "telegram") == before


async def test_a_press_not_yet_answered_when_the_stop_cancels_its_decision_is_told_in_its_answer(
    fake: FakeTelegram, make_adapter: Factory
) -> None:
    """The stop's grace ends before ``press_timeout``: the press was not answered at all yet. Its query's answer
    says it was not recorded (an alert), rather than a spinner that stops with nothing said. The store, asked,
    never answers: the check gets half the stop's patience, not ``press_timeout`` (the platform closed first)."""
    bot, _ = await make_adapter(press_timeout=30.0, stop_grace=1.0)
    deciding = asyncio.Event()

    async def held(press: Press) -> PressResult:
        deciding.set()
        await asyncio.Event().wait()  # the decision never comes back
        raise AssertionError("unreachable")

    async def unanswered(press: Press) -> bool | None:
        await asyncio.Event().wait()  # the store never answers
        raise AssertionError("unreachable")

    assert bot._handlers is not None
    bot._handlers = replace(bot._handlers, on_press=held, press_recorded=unanswered)
    card = make_card({"path": "/tmp/x"})
    ref = await bot.post_card(card)
    query = fake.push_callback(GROUP, ref.message_id, MEMBER, card.button_data(Decision.APPROVE), username="mia")
    await asyncio.wait_for(deciding.wait(), WAIT)
    await asyncio.wait_for(bot.stop(), 3 * WAIT)
    answer = await fake.wait_for_answer(query)
    assert answer["text"] == PRESS_CUT_OFF
    assert answer.get("show_alert") in (True, "true", "True")
