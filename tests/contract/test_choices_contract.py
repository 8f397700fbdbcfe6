"""A question with choices (``ask_user(question, choices)``, a ``user`` step) on every platform: one button
per choice carrying the choice's data, and a press of one reaches the handlers like a card's press — who,
where, which choice — under the same press policy (a refused presser is told privately)."""

from __future__ import annotations

import pytest

from kazma.adapters.contract import CardRef
from kazma.approvals.model import PressResult, PressVerdict
from kazma.engine.conversation import question_button
from tests.contract.harness import Harness

pytestmark = pytest.mark.filterwarnings("ignore:.*retry_after.*:telegram.warnings.PTBDeprecationWarning")

QUESTION = "Q7xK2mP9vL4nB8cT"
CHOICES = [("eu-west", question_button(QUESTION, 0)), ("us-east", question_button(QUESTION, 1))]


async def test_a_question_gets_one_button_per_choice_and_a_press_carries_that_choice(harness: Harness) -> None:
    adapter = await harness.start()
    message_id = await adapter.send_choices(harness.home, "Which region should I deploy to?", CHOICES, agent="kazma")
    ref = CardRef(harness.platform, harness.home, message_id)
    wire = harness.card(ref)
    assert wire.buttons == ["eu-west", "us-east"]
    assert wire.data == [data for _, data in CHOICES]

    harness.recorder.result = PressResult(PressVerdict.WON, "Answered: us-east.")
    await harness.press(ref, CHOICES[1][1], harness.member)
    [press] = await harness.recorder.wait_until(lambda: harness.recorder.presses)
    await harness.settled()
    assert press.data == CHOICES[1][1]
    assert press.actor == f"{harness.platform}:{harness.member}"
    assert (press.chat, press.message_id) == (harness.home, message_id)
    assert harness.notices(harness.member) == []  # taken: no alarm, the plan goes on in the chat


async def test_a_refused_answer_is_told_privately_to_the_presser_only(harness: Harness) -> None:
    adapter = await harness.start()
    message_id = await adapter.send_choices(harness.home, "Which region?", CHOICES)
    ref = CardRef(harness.platform, harness.home, message_id)
    harness.recorder.result = PressResult(PressVerdict.REFUSED, "Only telegram:42 (or an admin) may answer this.")
    await harness.press(ref, CHOICES[0][1], harness.member)
    assert await harness.wait_for_notices(harness.member, 1) == ["Only telegram:42 (or an admin) may answer this."]
    assert harness.notices(harness.admin) == []
