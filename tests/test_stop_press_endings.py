"""A press still being decided when Kazma stops: its presser hears how it ended before the platform closes."""

from __future__ import annotations

import asyncio

import pytest

from kazma.adapters.press_policy import PRESS_PENDING
from kazma.adapters.telegram import TelegramAdapter
from kazma.approvals.model import Decision, PressResult, PressVerdict
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
