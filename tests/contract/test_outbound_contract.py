"""The kit's outbound template, the same on every platform: one log schema for cards and text, one set of
refusals made before any call (a card the dialect cannot write, a malformed chat, another platform's card)."""

from __future__ import annotations

import pytest
import structlog

from kazma.adapters.contract import CardRef, PlatformError
from kazma.approvals.model import Status
from kazma.config.metrics import failure_count
from tests.contract.harness import Harness, make_card, outcome_of

pytestmark = pytest.mark.filterwarnings("ignore:.*retry_after.*:telegram.warnings.PTBDeprecationWarning")

# What every platform says about its outbound posts: the event names and the fields, whatever the dialect.
SCHEMA = {
    "platform.card_posted": {"platform", "request_id", "chat", "message_id", "whole"},
    "platform.card_settled": {"platform", "request_id", "chat", "message_id", "status", "changed"},
    "platform.text_sent": {"platform", "chat", "agent", "message_id", "parts"},
}


async def test_cards_and_text_are_logged_in_one_schema(harness: Harness) -> None:
    adapter = await harness.start()
    card = make_card({"path": "/tmp/x"})
    with structlog.testing.capture_logs() as logs:
        ref = await adapter.post_card(card)
        await adapter.settle_card(ref, card, outcome_of(card, Status.APPROVED))
        await adapter.send_text(harness.home, "hello", agent="lead")
    seen = {entry["event"]: entry for entry in logs if entry["event"] in SCHEMA}
    assert set(seen) == set(SCHEMA)
    for event, fields in SCHEMA.items():
        assert set(seen[event]) - {"event", "log_level"} == fields, event
        assert seen[event]["platform"] == harness.platform
    assert (seen["platform.card_posted"]["chat"], seen["platform.card_posted"]["message_id"]) == (
        ref.chat,
        ref.message_id,
    )
    assert seen["platform.card_posted"]["request_id"] == card.request_id
    # no platform's own dialect of the same lines is left
    assert not [e["event"] for e in logs if e["event"].endswith(("card_posted", "card_settled", ".sent"))
                and not e["event"].startswith("platform.")]  # fmt: skip


async def test_another_platforms_card_and_a_malformed_chat_are_refused_before_any_call(harness: Harness) -> None:
    adapter = await harness.start()
    card = make_card({"a": 1})
    before = failure_count("card_settle", harness.platform)
    with pytest.raises(PlatformError) as caught:
        await adapter.settle_card(CardRef("elsewhere", harness.home, "1"), card, outcome_of(card, Status.DENIED))
    assert (caught.value.site, caught.value.retryable) == ("card_settle", False)
    assert failure_count("card_settle", harness.platform) == before + 1
    before = failure_count("send", harness.platform)
    with pytest.raises(PlatformError) as caught:
        await adapter.send_text("not a chat!", "hello")
    assert (caught.value.site, caught.value.retryable) == ("send", False)
    assert failure_count("send", harness.platform) == before + 1
    assert harness.bot_texts(harness.home) == []
