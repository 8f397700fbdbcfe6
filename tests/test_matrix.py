"""Matrix beyond the contract, against a real Synapse: where the sync stands across restarts, only the leader
syncs, a real 429 from the homeserver's own limits, reactions only on the bot's own cards, encrypted rooms,
and ``kazma doctor``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import types
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import structlog
from aiohttp import web
from mautrix.api import Method
from mautrix.errors import MatrixRequestError

from kazma.adapters import kit
from kazma.adapters.admission import DirectPolicy, FileBounds, FileTooLarge
from kazma.adapters.contract import CardRef, Inbound, PlatformError, ingress_trouble
from kazma.adapters.kit import PlatformBase
from kazma.adapters.matrix import MatrixAdapter
from kazma.adapters.matrix import adapter as matrix_adapter
from kazma.adapters.matrix.client import close_client, make_client
from kazma.adapters.matrix.doctor import check as check_matrix
from kazma.adapters.matrix.errors import ENCRYPTED_NOTICE, classify
from kazma.adapters.matrix.position import ACCOUNT_DATA_TYPE
from kazma.adapters.matrix.render import CARD_BUDGET, EDIT_POINTER, edit_content, render_card
from kazma.adapters.pacing import ChatRateLimiter
from kazma.adapters.platform_cli import Level
from kazma.approvals.card import ApprovalCard
from kazma.approvals.model import Decision
from kazma.config.metrics import failure_count
from kazma.config.models import MatrixConfig
from kazma.config.waits import until_set
from tests.contract.harness import MatrixHarness, make_card, outcome_of
from tests.matrix_support import SynapseError

pytestmark = pytest.mark.filterwarnings("ignore:.*retry_after.*:telegram.warnings.PTBDeprecationWarning")


@pytest.fixture
async def harness() -> AsyncIterator[MatrixHarness]:
    made = MatrixHarness()
    await made.open()
    try:
        yield made
    finally:
        await made.close()


async def texts_arrived(harness: MatrixHarness, count: int, *, timeout: float | None = None) -> list[str]:
    if timeout is None:
        await harness.recorder.wait_until(lambda: len(harness.recorder.inbound) >= count)
    else:
        await harness.recorder.wait_until(lambda: len(harness.recorder.inbound) >= count, timeout=timeout)
    return [i.text for i in harness.recorder.inbound]


# --------------------------------------------------------------------------- where the sync stands


async def test_a_restart_neither_loses_nor_repeats_a_message(harness: MatrixHarness) -> None:
    adapter = await harness.start()
    await harness.say(harness.home, harness.admin, "before the restart")
    await texts_arrived(harness, 1)
    await adapter.quiesce()
    await adapter.stop()
    await harness.say(harness.home, harness.admin, "while Kazma was down")  # nobody syncs now
    await harness.start()
    await texts_arrived(harness, 2)
    await harness.say(harness.home, harness.admin, "after")
    found = await texts_arrived(harness, 3)
    await harness.settled()
    assert found == ["before the restart", "while Kazma was down", "after"]


async def test_more_messages_while_down_than_one_sync_holds_are_all_taken_in_order(harness: MatrixHarness) -> None:
    adapter = await harness.start()
    await adapter.quiesce()
    await adapter.stop()
    said = [f"while down {n:03d}" for n in range(130)]  # a sync's timeline holds 100 a room: "limited"
    for text in said:
        await harness.say(harness.home, harness.admin, text)
    await harness.start()
    # each event taken in is recorded on the homeserver before the next: 130 of them take a while on a busy machine
    await harness.recorder.wait_until(lambda: len(harness.recorder.inbound) >= len(said), timeout=90)
    await harness.say(harness.home, harness.admin, "after")
    found = await texts_arrived(harness, len(said) + 1)
    await harness.settled()
    assert found == [*said, "after"]


async def test_a_batch_cut_short_resumes_after_the_events_it_took_in(harness: MatrixHarness) -> None:
    """A process that stops in the middle of a batch (killed after taking in its first event) left the batch's
    token and that event's id; the next start takes that batch again and skips exactly that event."""
    adapter = await harness.start()
    await adapter.stop()
    cut = await asyncio.to_thread(harness.bot.account_data, ACCOUNT_DATA_TYPE)
    assert cut is not None
    assert cut["done"] == []
    await harness.say(harness.home, harness.admin, "first of the batch")
    await harness.say(harness.home, harness.admin, "second of the batch")
    await harness.start()
    await texts_arrived(harness, 2)
    await harness.adapter.stop()
    first = next(i for i in harness.recorder.inbound if i.text == "first of the batch")
    # what a kill after the first event was taken in leaves behind: the batch's token, the room's mark
    kill = {**cut, "rooms": {harness.home: first.message_id}}
    await asyncio.to_thread(harness.bot.set_account_data, ACCOUNT_DATA_TYPE, kill)
    harness.recorder.inbound.clear()
    await harness.start()
    found = await texts_arrived(harness, 1)
    await harness.say(harness.home, harness.admin, "later")
    found = await texts_arrived(harness, 2)
    assert found == ["second of the batch", "later"]


async def test_a_restart_deep_in_a_long_batch_repeats_nothing_it_took_in(harness: MatrixHarness) -> None:
    """A batch after an outage holds up to 2,000 events a room, read back: a position kept after more than a
    thousand of them were taken in is read back whole (an earlier Kazma listed each event it took in)."""
    adapter = await harness.start()
    await adapter.stop()
    cut = await asyncio.to_thread(harness.bot.account_data, ACCOUNT_DATA_TYPE)
    assert cut is not None
    await harness.say(harness.home, harness.admin, "first of the batch")
    await harness.say(harness.home, harness.admin, "second of the batch")
    await harness.start()
    await texts_arrived(harness, 2)
    await harness.adapter.stop()
    first = next(i for i in harness.recorder.inbound if i.text == "first of the batch")
    done = [*(f"$taken-in-before-{n}" for n in range(1_200)), first.message_id]
    await asyncio.to_thread(harness.bot.set_account_data, ACCOUNT_DATA_TYPE, {**cut, "done": done})
    harness.recorder.inbound.clear()
    await harness.start()
    await texts_arrived(harness, 1)
    await harness.say(harness.home, harness.admin, "later")
    assert await texts_arrived(harness, 2) == ["second of the batch", "later"]


async def test_a_stop_in_the_middle_of_a_long_catch_up_loses_and_repeats_nothing(harness: MatrixHarness) -> None:
    adapter = await harness.start()
    await adapter.stop()
    cut = await asyncio.to_thread(harness.bot.account_data, ACCOUNT_DATA_TYPE)
    assert cut is not None
    said = [f"while down {n:03d}" for n in range(130)]  # more than one sync holds: read back, one batch
    for text in said:
        await harness.say(harness.home, harness.admin, text)
    recorder = harness.recorder
    stopping: list[asyncio.Task[None]] = []
    taken_in = recorder.on_inbound

    async def stop_after_the_30th(inbound: Inbound) -> None:
        await taken_in(inbound)
        if len(recorder.inbound) == 30:  # the stop is asked while the 30th is taken in: it ends the batch there
            stopping.append(asyncio.create_task(harness.adapter.stop()))

    recorder.on_inbound = stop_after_the_30th  # type: ignore[method-assign]
    await harness.start()
    await recorder.wait_until(lambda: stopping)
    await stopping[0]
    recorder.on_inbound = taken_in  # type: ignore[method-assign]
    kept = await asyncio.to_thread(harness.bot.account_data, ACCOUNT_DATA_TYPE)
    assert kept is not None
    assert kept["since"] == cut["since"]  # the batch is not through
    # one mark a room for what was taken in, however long the batch: not a list of every event
    assert kept["rooms"] == {harness.home: recorder.inbound[29].message_id}
    assert len(json.dumps(kept)) < 1_000
    await harness.start()
    await harness.recorder.wait_until(lambda: len(harness.recorder.inbound) >= len(said), timeout=90)
    await harness.say(harness.home, harness.admin, "after")
    found = await texts_arrived(harness, len(said) + 1)
    await harness.settled()
    assert found == [*said, "after"]


async def test_the_first_start_never_takes_a_rooms_history_as_requests(harness: MatrixHarness) -> None:
    await harness.say(harness.home, harness.admin, "@builder something said before Kazma ever ran")
    await asyncio.to_thread(harness.bot.set_account_data, ACCOUNT_DATA_TYPE, {})
    await harness.start()
    await harness.say(harness.home, harness.admin, "now")
    assert await texts_arrived(harness, 1) == ["now"]
    await harness.settled()
    assert [i.text for i in harness.recorder.inbound] == ["now"]


async def test_only_the_leader_syncs_and_a_new_leader_takes_what_came_meanwhile(harness: MatrixHarness) -> None:
    leader = await harness.start()
    await leader.stop()  # the old leader is gone; its position stays on the homeserver
    config = harness.adapter.config
    synced = harness.proxy.count("GET", r"/sync$")
    replica = MatrixAdapter(config, limiter=ChatRateLimiter(min_interval=0.0), poll_timeout=5.0)
    await replica.start(harness.recorder.handlers(), ingress=False)
    try:
        assert replica.started
        assert not replica.ingress_running
        await replica.send_text(harness.home, "a replica sends without syncing")
        await harness.say(harness.home, harness.admin, "said while no replica leads")
        posted = await replica.post_card(make_card({"path": "/tmp/x"}))
        assert posted.message_id
        # the message is on the homeserver and this replica has had every chance to sync it: it did not
        assert harness.proxy.count("GET", r"/sync$") == synced
        assert harness.recorder.inbound == []
        await replica.start_ingress()  # this replica became the leader
        assert await texts_arrived(harness, 1) == ["said while no replica leads"]
    finally:
        await replica.stop()


# --------------------------------------------------------------------------- rate limits, for real


async def test_the_homeservers_own_429_is_waited_out_and_every_message_sent_once(harness: MatrixHarness) -> None:
    limited = harness.server.register("hasty", limited=True)  # Synapse's real rc_message: 3 at once, 2 a second
    session = limited  # its own token: the one Synapse limits (an admin's puppet token is not)
    for room in (harness.home,):
        await asyncio.to_thread(harness.people[harness.admin].request, "POST",
                                f"/_matrix/client/v3/rooms/{room}/invite", {"user_id": limited.user_id})  # fmt: skip
        await asyncio.to_thread(session.join, room)
    config = MatrixConfig(
        homeserver=harness.proxy.url, access_token=session.token, rooms=[harness.home], home_room=harness.home
    )
    adapter = MatrixAdapter(config, limiter=ChatRateLimiter(min_interval=0.0), poll_timeout=5.0)
    await adapter.start(harness.recorder.handlers(), ingress=False)
    try:
        with structlog.testing.capture_logs() as logs:
            for index in range(8):
                await adapter.send_text(harness.home, f"burst {index}")
        waits = [e for e in logs if e["event"] == "platform.rate_limited"]
        assert waits, "Synapse's limits were never met: the test proves nothing"
        assert all(0 < e["retry_after"] <= 5 for e in waits)  # the homeserver's retry_after_ms, in seconds
        reader = harness.people[harness.admin]
        sent = [
            str(e["content"]["body"])
            for e in await asyncio.to_thread(reader.messages, harness.home, harness.since[harness.home])
            if e.get("sender") == limited.user_id and e.get("type") == "m.room.message"
        ]  # fmt: skip
        assert sent == [f"burst {index}" for index in range(8)]
    finally:
        await adapter.stop()


async def test_a_sync_that_keeps_failing_is_said_as_the_inbound_failing_until_one_succeeds(
    harness: MatrixHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The homeserver answered every sync with 502: each failure was logged and counted, tried again with backoff,
    and /healthz said Matrix served (nothing came in from it)."""
    monkeypatch.setattr(kit, "INBOUND_TROUBLE_AFTER", 2)
    monkeypatch.setattr(matrix_adapter, "until_set", lambda event, seconds: until_set(event, 0.05))
    adapter = await harness.start()
    assert isinstance(adapter, MatrixAdapter)
    assert ingress_trouble(adapter) is None
    failed = failure_count("sync", "matrix")
    harness.proxy.fail("GET", r"/sync$", 502, times=1_000)
    await harness.say(harness.home, harness.admin, "wakes the long poll; the next syncs meet the 502")
    async with asyncio.timeout(30):
        while failure_count("sync", "matrix") < failed + 2:
            await asyncio.sleep(0.02)
    trouble = ingress_trouble(adapter)  # what the bus says on /healthz
    assert trouble is not None
    assert trouble.startswith("the sync failed "), trouble
    assert "502" in trouble
    harness.proxy.faults.clear()
    await harness.say(harness.home, harness.admin, "after")
    assert await texts_arrived(harness, 2) == ["wakes the long poll; the next syncs meet the 502", "after"]
    assert ingress_trouble(adapter) is None


async def test_a_429_on_sync_waits_as_long_as_the_homeserver_asks(
    harness: MatrixHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    waits: list[float] = []

    async def waiting(event: asyncio.Event, seconds: float | None) -> bool:
        waits.append(seconds or 0.0)
        return await until_set(event, 0.05)  # what was asked is recorded; the test need not wait it out

    monkeypatch.setattr(matrix_adapter, "until_set", waiting)
    await harness.start()
    harness.proxy.fail("GET", r"/sync$", 429, retry_after_ms=7_000)
    await harness.say(harness.home, harness.admin, "wakes the long poll; the next sync meets the 429")
    await texts_arrived(harness, 1)
    async with asyncio.timeout(30):
        while not waits:
            await asyncio.sleep(0.05)
    assert waits[0] == 7.0
    await harness.say(harness.home, harness.admin, "after")
    assert await texts_arrived(harness, 2) == ["wakes the long poll; the next sync meets the 429", "after"]


# --------------------------------------------------------------------------- reactions


async def test_a_press_still_being_decided_when_kazma_stops_is_taken_at_the_next_start(
    harness: MatrixHarness,
) -> None:
    """The sync moves past a press only once it is decided: a process that ends before that (a crash, or a
    stop whose grace the decision outlives) leaves it to the next start, which takes it again. The homeserver
    would not take the same reaction twice, so nobody could press it again."""
    adapter = await harness.start(stop_grace=0.5)
    harness.recorder.hold = asyncio.Event()
    card = make_card({"path": "/tmp/x"})
    ref = await adapter.post_card(card)
    await harness.press(ref, card.button_data(Decision.APPROVE), harness.admin)
    await harness.recorder.wait_until(lambda: harness.recorder.presses)  # being decided, held
    await adapter.stop()  # the decision outlives the grace: cut off, as a crash cuts it
    harness.recorder.hold = None
    await harness.start()
    await harness.recorder.wait_until(lambda: len(harness.recorder.presses) == 2)
    assert [p.data for p in harness.recorder.presses] == [card.button_data(Decision.APPROVE)] * 2
    assert harness.recorder.presses[1].actor == f"matrix:{harness.admin}"


async def test_a_press_whose_decision_hangs_holds_the_sync_only_so_long(harness: MatrixHarness) -> None:
    """A decision that hangs (a store that stopped answering) held every room's events behind it for good."""
    adapter = await harness.start()
    assert isinstance(adapter, MatrixAdapter)
    adapter.decision_wait = 0.2
    harness.recorder.hold = asyncio.Event()
    try:
        card = make_card({"path": "/tmp/x"})
        ref = await adapter.post_card(card)
        await harness.press(ref, card.button_data(Decision.APPROVE), harness.admin)
        await harness.recorder.wait_until(lambda: harness.recorder.presses)  # being decided, held
        await harness.say(harness.home, harness.admin, "still heard")
        assert await texts_arrived(harness, 1) == ["still heard"]
    finally:
        harness.recorder.hold.set()
        harness.recorder.hold = None


async def test_a_reaction_counts_only_on_the_bots_own_card(harness: MatrixHarness) -> None:
    """Someone posts a look-alike "card" carrying choices of their own: a ✅ on it presses nothing."""
    await harness.start()
    card = make_card({"path": "/tmp/x"})
    forged = {"msgtype": "m.text", "body": "Approval needed", "org.kazma.choices": [
        {"key": "✅", "label": "Approve", "data": card.button_data(Decision.APPROVE)}]}  # fmt: skip
    mallory = harness.people[harness.member]
    event = await asyncio.to_thread(mallory.send, harness.home, forged)
    await asyncio.to_thread(harness.people[harness.admin].react, harness.home, event, "✅")
    await harness.say(harness.home, harness.admin, "after the reaction")
    # the forged message itself arrives as text; the reaction came before the second message, so it was read
    assert await texts_arrived(harness, 2) == ["Approval needed", "after the reaction"]
    await harness.settled()
    assert harness.recorder.presses == []


async def test_reactions_on_a_message_that_is_no_card_read_it_once(harness: MatrixHarness) -> None:
    """People react to ordinary messages all day: each reaction cost a GET of the message's event (to see whether
    the bot sent it, as a card), every time, because only the bot's own events were remembered."""
    await harness.start()
    member = harness.people[harness.member]
    event = await asyncio.to_thread(member.send, harness.home, {"msgtype": "m.text", "body": "lunch?"})
    reads = r"/rooms/[^/]+/event/"
    before = harness.proxy.count("GET", reads)
    for person, key in ((harness.admin, "👍"), (harness.member, "🎉"), (harness.admin, "✅")):
        await asyncio.to_thread(harness.people[person].react, harness.home, event, key)
    await harness.say(harness.home, harness.admin, "after the reactions")
    assert await texts_arrived(harness, 2) == ["lunch?", "after the reactions"]  # the reactions were read before
    assert harness.proxy.count("GET", reads) - before == 1
    assert harness.recorder.presses == []


async def test_the_bots_own_cards_are_remembered_bounded_and_a_forgotten_card_still_presses(
    harness: MatrixHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every card and question the bot posted (and every message of its someone reacted to) stayed in memory until
    a restart. Bounded now, least recently used first, a settled card before the others: a press on a card that
    was forgotten reads it back from the homeserver (its content carries its choices) and presses the same."""
    monkeypatch.setattr(matrix_adapter, "CHOICES_KEPT", 2, raising=False)  # before the bound: fails on the reads
    adapter = await harness.start()
    assert isinstance(adapter, MatrixAdapter)
    # three requests, three cards (one request's card is posted once per room: the same event again)
    cards = [dataclasses.replace(make_card({"path": f"/tmp/{n}"}), request_id=f"Rq7xK2mP9vL4nB8cT1wZ5aY{n}")
             for n in range(3)]  # fmt: skip
    first, second = [await adapter.post_card(card) for card in cards[:2]]
    await adapter.settle_card(second, cards[1], outcome_of(cards[1]))  # decided: the first forgotten of the two
    third = await adapter.post_card(cards[2])  # one too many: the settled card is forgotten, not the pending one
    reads = r"/rooms/[^/]+/event/"

    async def press_reads(ref: CardRef, card: ApprovalCard) -> int:
        before, pressed = harness.proxy.count("GET", reads), len(harness.recorder.presses)
        await harness.press(ref, card.button_data(Decision.APPROVE), harness.admin)
        await harness.recorder.wait_until(lambda: len(harness.recorder.presses) == pressed + 1)
        assert harness.recorder.presses[-1].data == card.button_data(Decision.APPROVE)
        assert harness.recorder.presses[-1].message_id == ref.message_id
        return harness.proxy.count("GET", reads) - before

    assert await press_reads(first, cards[0]) == 0  # still remembered: older, but its request may be decided
    assert await press_reads(third, cards[2]) == 0
    assert await press_reads(second, cards[1]) == 1  # forgotten: read back once, pressed the same
    assert len(adapter._choices) == 2  # the bound itself, which no behaviour shows before it is hit


@pytest.mark.parametrize("restarted", [False, True], ids=["remembered", "read back after a restart"])
async def test_a_press_on_a_redacted_card_never_counts_and_its_requests_other_card_still_does(
    harness: MatrixHarness, restarted: bool
) -> None:
    # A moderator redacts a card (its content, choices and all, is gone). A press on it counted while the card was
    # remembered with its choices, and was passed by unsaid once a restart read it back: neither counts now, and
    # the log says why. The request's card in another room still stands.
    adapter = await harness.start()
    card = make_card({"path": "/tmp/redacted"})
    ref = await adapter.post_card(card)
    other = await adapter.post_card_in(card, harness.other)
    approve = card.button_data(Decision.APPROVE)
    [key] = [c["key"] for c in (await asyncio.to_thread(harness.people[harness.admin].event, ref.chat,
                                                        ref.message_id))["content"]["org.kazma.choices"]
             if c["data"] == approve]  # fmt: skip
    if restarted:
        await adapter.quiesce()
        await adapter.stop()
    alice = harness.people[harness.admin]
    path = f"/_matrix/client/v3/rooms/{quote(ref.chat)}/redact/{quote(ref.message_id)}/kazma-test-{restarted}"
    await asyncio.to_thread(alice.request, "PUT", path, {"reason": "posted by mistake"})
    await asyncio.to_thread(alice.react, ref.chat, ref.message_id, key)
    with structlog.testing.capture_logs() as logged:
        if restarted:
            await harness.start()
        await harness.say(harness.home, harness.admin, "after the press")
        assert await texts_arrived(harness, 1) == ["after the press"]  # the press came before it, and was read
    assert harness.recorder.presses == []
    [said] = [e for e in logged if e["event"] == "matrix.press_on_redacted_card"]
    assert (said["room"], said["card"], said["actor"]) == (ref.chat, ref.message_id, f"matrix:{alice.user_id}")
    await harness.press(other, approve, harness.admin)
    [press] = await harness.recorder.wait_until(lambda: harness.recorder.presses)
    assert (press.chat, press.message_id, press.data) == (harness.other, other.message_id, approve)


@pytest.mark.parametrize("restarted", [False, True], ids=["seen in the sync", "read back after a restart"])
async def test_a_redacted_card_is_not_edited_again_while_its_requests_other_card_is(
    harness: MatrixHarness, restarted: bool
) -> None:
    # A moderator redacts a card whose arguments showed something sensitive. When its request was decided, the
    # settle edit (m.new_content, the whole card) went out over it all the same and published again what was
    # removed. No edit goes to a redacted card now, known from the sync or read back once when it is settled,
    # and its request's other card is edited as ever.
    adapter = await harness.start()
    card = make_card({"path": "/tmp/secret-token"})
    ref = await adapter.post_card(card)
    other = await adapter.post_card_in(card, harness.other)
    alice = harness.people[harness.admin]
    path = f"/_matrix/client/v3/rooms/{quote(ref.chat)}/redact/{quote(ref.message_id)}/kazma-edit-{restarted}"
    await asyncio.to_thread(alice.request, "PUT", path, {"reason": "shows a secret"})
    await harness.say(harness.home, harness.admin, "after the redaction")
    assert await texts_arrived(harness, 1) == ["after the redaction"]  # the sync took the redaction before it
    if restarted:
        await adapter.quiesce()
        await adapter.stop()
        adapter = await harness.start()  # remembers nothing of the card, and syncs on from past the redaction
    since = await asyncio.to_thread(alice.now, ref.chat)
    with structlog.testing.capture_logs() as logged:
        if not restarted:
            await adapter.update_card(ref, dataclasses.replace(card, progress="1 of 2 approvals"))
        for posted in (ref, other):  # the request decided: the bus settles each of its cards
            await adapter.settle_card(posted, card, outcome_of(card))
    events = await asyncio.to_thread(alice.messages, ref.chat, since)
    over = [e for e in events if ((e.get("content") or {}).get("m.relates_to") or {}).get("event_id") == ref.message_id]
    assert over == []
    edits = await asyncio.to_thread(alice.request, "GET",
        f"/_matrix/client/v1/rooms/{quote(ref.chat)}/relations/{quote(ref.message_id)}/m.replace")  # fmt: skip
    assert edits["chunk"] == []
    skipped = [e for e in logged if e["event"] == "matrix.edit_skipped_redacted"]
    assert [(e["card"], e["settled"]) for e in skipped] == [(ref.message_id, False)] * (not restarted) + [
        (ref.message_id, True)
    ]
    settled = [e for e in logged if e["event"] == "platform.card_settled"]
    assert [(e["message_id"], e["changed"]) for e in settled] == [(ref.message_id, False), (other.message_id, True)]
    shown = harness.card(other)
    assert shown.text.startswith("APPROVED")
    assert shown.buttons == []


async def test_a_reaction_with_the_variation_selector_is_the_same_press(harness: MatrixHarness) -> None:
    adapter = await harness.start()
    card = make_card({"path": "/tmp/x"})
    ref = await adapter.post_card(card)
    await asyncio.to_thread(harness.people[harness.admin].react, ref.chat, ref.message_id, "✅\ufe0f")
    [press] = await harness.recorder.wait_until(lambda: harness.recorder.presses)
    assert press.data == card.button_data(Decision.APPROVE)


async def test_a_reaction_in_another_room_naming_a_card_of_this_one_presses_nothing(harness: MatrixHarness) -> None:
    """A relation is held to its room only by the sender's own homeserver (Synapse refuses its own users' strays;
    an event from another server arrives as that server made it). The bot remembered its cards by event id alone:
    a ✅ in another room naming a card of this one was a press on that card from the other room, which the card's
    own read there (the homeserver answers 404: no such event in that room) would never have allowed."""
    adapter = await harness.start()
    card = make_card({"path": "/tmp/x"})
    ref = await adapter.post_card(card)  # in the home room, remembered with its choices
    assert ref.chat == harness.home

    def from_elsewhere(sync: dict[str, Any]) -> bool:
        room = ((sync.get("rooms") or {}).get("join") or {}).get(harness.other) or {}
        events = (room.get("timeline") or {}).get("events") or []
        if not any((e.get("content") or {}).get("body") == "after the reaction" for e in events):
            return False
        relates = {"rel_type": "m.annotation", "event_id": ref.message_id, "key": "✅"}
        reaction = {"type": "m.reaction", "event_id": "$a-reaction-made-elsewhere", "sender": harness.admin,
                    "room_id": harness.other, "origin_server_ts": int(time.time() * 1000),
                    "content": {"m.relates_to": relates}}  # fmt: skip
        events.insert(0, reaction)
        return True

    harness.proxy.rewrite("GET", r"/sync$", from_elsewhere)
    await harness.say(harness.other, harness.admin, "after the reaction")
    assert await texts_arrived(harness, 1) == ["after the reaction"]
    assert not harness.proxy.rewrites  # the stray reaction was in that batch, before the message
    await harness.settled()
    assert harness.recorder.presses == []


async def test_a_reply_in_another_room_to_a_reason_prompt_is_no_reason(harness: MatrixHarness) -> None:
    """A reply names the event it answers without any room check (``m.in_reply_to`` is no relation to a
    homeserver): a reply in another room to a reason prompt remembered here was taken as the reason, a Deny from a
    room where the card never was."""
    _, _, _, prompt = await _reason_prompted(harness)
    relates = {"m.relates_to": {"m.in_reply_to": {"event_id": prompt}}}
    await asyncio.to_thread(harness.people[harness.admin].say, harness.other, "it drops the prod table", **relates)
    await harness.say(harness.other, harness.admin, "after the reply")
    assert await texts_arrived(harness, 2) == ["it drops the prod table", "after the reply"]
    await harness.settled()
    assert harness.recorder.presses == []


async def card_posted_by_an_earlier_process(harness: MatrixHarness) -> tuple[MatrixAdapter, ApprovalCard, CardRef]:
    """A card posted, then a new process (the adapter started again): it must read the card on the homeserver to
    know which reaction means what."""
    adapter = await harness.start()
    card = make_card({"path": "/tmp/x"})
    ref = await adapter.post_card(card)
    await adapter.stop()
    again = await harness.start()
    assert isinstance(again, MatrixAdapter)
    return again, card, ref


async def test_a_press_whose_card_the_homeserver_failed_to_show_once_is_taken_when_the_batch_comes_again(
    harness: MatrixHarness,
) -> None:
    _, card, ref = await card_posted_by_an_earlier_process(harness)
    before = failure_count("sync", "matrix")
    harness.proxy.fail("GET", r"/rooms/[^/]+/event/", 500, times=1)
    await harness.press(ref, card.button_data(Decision.APPROVE), harness.admin)
    [press] = await harness.recorder.wait_until(lambda: harness.recorder.presses, timeout=30)
    assert press.data == card.button_data(Decision.APPROVE)
    assert harness.proxy.count("GET", r"/rooms/[^/]+/event/") == 2
    assert failure_count("sync", "matrix") == before + 1  # the batch failed once and came again


async def test_a_card_read_the_homeserver_never_answers_is_given_up_and_read_again_with_the_batch(
    harness: MatrixHarness,
) -> None:
    # The homeserver takes the card read's connection and says nothing: the read waited for ever, and the sync with
    # it, so this press and every later message and press were never taken in. Silence now ends the read after the
    # request timeout, a failure like a 5xx: the batch comes again and the press is taken.
    first = await harness.start()
    card = make_card({"path": "/tmp/x"})
    ref = await first.post_card(card)
    await first.stop()
    await harness.start(request_timeout=1.0)  # a new process: it must read the card to know what ✅ means
    before = failure_count("sync", "matrix")
    harness.proxy.fail("GET", r"/rooms/[^/]+/event/", None, times=1)
    await harness.press(ref, card.button_data(Decision.APPROVE), harness.admin)
    [press] = await harness.recorder.wait_until(lambda: harness.recorder.presses, timeout=60)
    assert press.data == card.button_data(Decision.APPROVE)
    assert harness.proxy.count("GET", r"/rooms/[^/]+/event/") == 2
    assert failure_count("sync", "matrix") == before + 1  # said and counted as the sync's failure, then tried again


async def test_a_card_the_homeserver_never_shows_holds_the_sync_for_a_bounded_number_of_tries(
    harness: MatrixHarness,
) -> None:
    # A card event every read of which fails (a 5xx for ever) was read again with the batch for ever: every room's
    # later messages and presses waited behind it. After card_read_tries the reaction is passed by, counted.
    adapter, card, ref = await card_posted_by_an_earlier_process(harness)
    adapter.card_read_tries = 2
    before = failure_count("matrix_press_card_unreadable", "matrix")
    harness.proxy.fail("GET", r"/rooms/[^/]+/event/", 500, times=1_000)
    await harness.press(ref, card.button_data(Decision.APPROVE), harness.admin)
    await harness.say(harness.home, harness.admin, "after the press")
    assert await texts_arrived(harness, 1, timeout=60) == ["after the press"]
    assert harness.recorder.presses == []
    assert harness.proxy.count("GET", r"/rooms/[^/]+/event/") == 2
    assert failure_count("matrix_press_card_unreadable", "matrix") == before + 1


async def test_deny_with_a_reason_is_asked_then_taken_from_the_pressers_reply(harness: MatrixHarness) -> None:
    adapter = await harness.start()
    card = make_card({"path": "/tmp/x"})
    ref = await adapter.post_card(card)
    await asyncio.to_thread(harness.people[harness.admin].react, ref.chat, ref.message_id, "💬")
    prompts = await harness.wait_for_notices(harness.admin, 1)
    assert "reply to this message with your reason" in prompts[0]
    [prompt] = [e["event_id"] for e in harness._bot_events(harness.home) if e["content"].get("msgtype") == "m.notice"]
    relates = {"m.relates_to": {"m.in_reply_to": {"event_id": prompt}}}
    # someone else's reply is not the reason; the presser's is
    await asyncio.to_thread(harness.people[harness.member].say, harness.home, "it is fine, ship it", **relates)
    await asyncio.to_thread(harness.people[harness.admin].say, harness.home, "touches production", **relates)
    [press] = await harness.recorder.wait_until(lambda: harness.recorder.presses)
    assert (press.data, press.reason, press.actor) == (
        card.button_data(Decision.DENY),
        "touches production",
        f"matrix:{harness.admin}",
    )


async def _reason_prompted(harness: MatrixHarness) -> tuple[PlatformBase, ApprovalCard, CardRef, str]:
    """A card and its reason prompt (the admin's 💬): the adapter running, the card, where it is and the prompt's
    event id."""
    adapter = await harness.start()
    card = make_card({"path": "/tmp/x"})
    ref = await adapter.post_card(card)
    await asyncio.to_thread(harness.people[harness.admin].react, ref.chat, ref.message_id, "💬")
    await harness.wait_for_notices(harness.admin, 1)
    [prompt] = [e["event_id"] for e in harness._bot_events(harness.home) if e["content"].get("msgtype") == "m.notice"]
    return adapter, card, ref, prompt


async def test_a_reply_to_a_reason_prompt_without_words_decides_nothing_and_the_prompt_stands(
    harness: MatrixHarness,
) -> None:
    """A picture alone in reply to the prompt denied the request with the reason "shot.png" (its file name), and a
    reply of blanks denied it with none: a reason is words, as on Telegram; the prompt stands for them."""
    _, card, _, prompt = await _reason_prompted(harness)
    admin = harness.people[harness.admin]
    relates = {"m.relates_to": {"m.in_reply_to": {"event_id": prompt}}}
    mxc = await asyncio.to_thread(admin.upload, "shot.png", b"\x89PNG not really")
    picture = {"msgtype": "m.image", "body": "shot.png", "filename": "shot.png", "url": mxc, **relates}
    await asyncio.to_thread(admin.send, harness.home, picture)
    await asyncio.to_thread(admin.say, harness.home, "   ", **relates)
    told = await harness.wait_for_notices(harness.admin, 3)
    assert all("a reason is words" in said for said in told[1:]), told
    assert harness.recorder.presses == []
    await asyncio.to_thread(admin.say, harness.home, "it drops the prod table", **relates)
    [press] = await harness.recorder.wait_until(lambda: harness.recorder.presses)
    assert (press.data, press.reason) == (card.button_data(Decision.DENY), "it drops the prod table")
    await harness.settled()
    assert harness.recorder.inbound == []  # none of the replies was chat for the agents


async def test_a_reason_prompt_the_homeserver_failed_to_take_is_posted_when_the_batch_comes_again(
    harness: MatrixHarness,
) -> None:
    """The prompt's post failed (a 5xx): the sync moved past the 💬 all the same, so the presser saw nothing happen,
    could not react 💬 again (the homeserver takes one reaction of a key from a person), and the request stayed
    pending. The batch comes again now; the prompt's post is one event however often it is tried."""
    adapter = await harness.start()
    card = make_card({"path": "/tmp/x"})
    ref = await adapter.post_card(card)
    await adapter.quiesce()  # the card's own reactions are out
    before = failure_count("sync", "matrix")
    harness.proxy.fail("PUT", r"/send/m\.room\.message/", 500, times=1)  # not taken
    harness.proxy.fail("PUT", r"/send/m\.room\.message/", 500, times=1, after=True)  # taken; its answer lost
    await asyncio.to_thread(harness.people[harness.admin].react, ref.chat, ref.message_id, "💬")
    await harness.say(harness.home, harness.admin, "after the press")
    assert await texts_arrived(harness, 1, timeout=60) == ["after the press"]
    assert failure_count("sync", "matrix") == before + 2  # the batch failed twice and came again
    [prompt] = harness.notices(harness.admin)
    assert "reply to this message with your reason" in prompt


async def test_deny_with_a_reason_from_someone_whose_press_would_not_count_asks_for_nothing(
    harness: MatrixHarness,
) -> None:
    harness.recorder.deciders = {f"matrix:{harness.admin}"}
    adapter = await harness.start()
    ref = await adapter.post_card(make_card({"path": "/tmp/x"}))
    await asyncio.to_thread(harness.people[harness.member].react, ref.chat, ref.message_id, "💬")
    [told] = await harness.wait_for_notices(harness.member, 1)
    assert "not an approver for this request" in told
    assert "reply to this message" not in told
    assert harness.recorder.presses == []


async def _reason_prompted_then_stopped(harness: MatrixHarness) -> tuple[ApprovalCard, CardRef, str]:
    """A card, its reason prompt (the admin's 💬) and the adapter stopped: the card, where it is and the prompt's
    event id."""
    adapter, card, ref, prompt = await _reason_prompted(harness)
    await adapter.quiesce()
    await adapter.stop()
    return card, ref, prompt


async def _reason_prompted_then_restarted(harness: MatrixHarness) -> tuple[ApprovalCard, CardRef, str, PlatformBase]:
    """As _reason_prompted_then_stopped, and the adapter started again: also the adapter now running."""
    card, ref, prompt = await _reason_prompted_then_stopped(harness)
    return card, ref, prompt, await harness.start()


async def test_a_reply_to_a_reason_prompt_after_a_restart_is_still_the_reason_and_never_chat(
    harness: MatrixHarness,
) -> None:
    """The prompts were kept in the process alone: after a restart (or on another replica) the presser's reply was
    no reason, and its words (meant for the approvals record, perhaps saying why the call is dangerous) reached the
    agents as an ordinary message while the request stayed pending. The prompt carries what it asks now."""
    card, ref, prompt, restarted = await _reason_prompted_then_restarted(harness)
    relates = {"m.relates_to": {"m.in_reply_to": {"event_id": prompt}}}
    await asyncio.to_thread(harness.people[harness.member].say, harness.home, "it is fine, ship it", **relates)
    await asyncio.to_thread(harness.people[harness.admin].say, harness.home, "it drops the prod table", **relates)
    await harness.say(harness.home, harness.admin, "after the reply")
    await texts_arrived(harness, 1)
    [press] = await harness.recorder.wait_until(lambda: harness.recorder.presses)
    assert (press.data, press.reason, press.actor, press.message_id) == (
        card.button_data(Decision.DENY),
        "it drops the prod table",
        f"matrix:{harness.admin}",
        ref.message_id,
    )
    await harness.settled()
    # neither reply to the prompt is chat for the agents
    assert [i.text for i in harness.recorder.inbound] == ["after the reply"]

    # a reply sent past its prompt's window (a prompt asked long ago) is answered "expired", never for the agents
    assert isinstance(restarted, MatrixAdapter)
    restarted.reason_clock = lambda: time.time() - 1_000  # the prompt below ends before its reply is sent
    old = dataclasses.replace(make_card({"path": "/tmp/y"}), request_id="Rq7xK2mP9vL4nB8cT1wZ5aOd")
    old_ref = await restarted.post_card(old)
    await asyncio.to_thread(harness.people[harness.admin].react, old_ref.chat, old_ref.message_id, "💬")
    await harness.wait_for_notices(harness.admin, 2)
    [late_prompt] = [e["event_id"] for e in harness._bot_events(harness.home)
                     if e["content"].get("msgtype") == "m.notice" and e["event_id"] != prompt]  # fmt: skip
    restarted.reason_clock = time.time
    late = {"m.relates_to": {"m.in_reply_to": {"event_id": late_prompt}}}
    await asyncio.to_thread(harness.people[harness.admin].say, harness.home, "late words", **late)
    await harness.say(harness.home, harness.admin, "after the late reply")
    await texts_arrived(harness, 2)
    told = await harness.wait_for_notices(harness.admin, 3)
    assert "that prompt has expired" in told[-1], told
    await harness.settled()
    assert [i.text for i in harness.recorder.inbound] == ["after the reply", "after the late reply"]
    assert len(harness.recorder.presses) == 1


async def test_a_reason_given_in_time_but_read_after_the_window_is_the_reason(
    harness: MatrixHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reply is read from the kept sync position, perhaps long after it was sent (Kazma restarted, the
    homeserver was away, the sync waited on a slow press). Judged by when it was read, the presser's reason given
    within the window was refused "expired", and the request stayed pending."""
    card, _, prompt = await _reason_prompted_then_stopped(harness)
    relates = {"m.relates_to": {"m.in_reply_to": {"event_id": prompt}}}
    await asyncio.to_thread(harness.people[harness.admin].say, harness.home, "it drops the prod table", **relates)
    # back long after the window (its clock, from its start): the reply waited for it on the homeserver
    monkeypatch.setattr(matrix_adapter, "time", types.SimpleNamespace(time=lambda: time.time() + 10_000))
    await harness.start()
    [press] = await harness.recorder.wait_until(lambda: harness.recorder.presses)
    assert (press.data, press.reason) == (card.button_data(Decision.DENY), "it drops the prod table")
    assert all("expired" not in told for told in harness.notices(harness.admin))


async def test_a_reaction_on_a_reason_prompt_after_a_restart_leaves_the_reply_the_reason(
    harness: MatrixHarness,
) -> None:
    """Someone reacted (👀) to a reason prompt after a restart: reading the reaction remembered the prompt as one of
    the bot's own events without choices, and the prompt was then taken for a card, so the presser's reply was no
    reason but chat for the agents, and the request stayed pending."""
    card, ref, prompt, _ = await _reason_prompted_then_restarted(harness)
    await asyncio.to_thread(harness.people[harness.member].react, harness.home, prompt, "👀")
    await harness.say(harness.home, harness.admin, "after the reaction")
    await texts_arrived(harness, 1)  # the reaction was read before this
    relates = {"m.relates_to": {"m.in_reply_to": {"event_id": prompt}}}
    await asyncio.to_thread(harness.people[harness.admin].say, harness.home, "it drops the prod table", **relates)
    await harness.say(harness.home, harness.admin, "after the reply")
    await texts_arrived(harness, 2)
    await harness.settled()
    assert [i.text for i in harness.recorder.inbound] == ["after the reaction", "after the reply"]
    [press] = harness.recorder.presses
    assert (press.data, press.reason, press.message_id) == (
        card.button_data(Decision.DENY),
        "it drops the prod table",
        ref.message_id,
    )


async def test_the_reason_button_of_a_decided_request_asks_for_nothing_and_tells_the_outcome(
    harness: MatrixHarness,
) -> None:
    adapter = await harness.start()
    card = make_card({"path": "/tmp/x"})
    harness.recorder.outcomes = {card.request_id: "Already denied by bob via telegram."}
    ref = await adapter.post_card(card)
    await asyncio.to_thread(harness.people[harness.admin].react, ref.chat, ref.message_id, "💬")
    [told] = await harness.wait_for_notices(harness.admin, 1)
    assert "Already denied by bob via telegram." in told
    assert "reply to this message" not in told
    assert harness.recorder.presses == []


# --------------------------------------------------------------------------- encrypted rooms


async def test_an_encrypted_room_is_told_once_how_to_make_an_unencrypted_one(harness: MatrixHarness) -> None:
    alice = harness.people[harness.admin]
    room = await asyncio.to_thread(alice.create_room, invite=[harness.bot.user_id], encrypted=True)
    await asyncio.to_thread(harness.bot.join, room)
    harness.since[room] = await asyncio.to_thread(alice.now, room)
    before = failure_count("encrypted_room", "matrix")
    await harness.start(chats=[harness.home, room])
    encrypted = {"algorithm": "m.megolm.v1.aes-sha2", "ciphertext": "AwgAEpABfake", "sender_key": "k",
                 "session_id": "s", "device_id": alice.device_id}  # fmt: skip
    await asyncio.to_thread(alice.send, room, encrypted, "m.room.encrypted")
    # a plain message after them in the same room: when it arrives, every event before it there was read
    await harness.say(room, harness.admin, "after")
    await texts_arrived(harness, 1)
    await harness.settled()
    assert harness.bot_texts(room) == [ENCRYPTED_NOTICE]
    assert "unencrypted room" in ENCRYPTED_NOTICE
    assert failure_count("encrypted_room", "matrix") == before + 1
    assert harness.recorder.inbound[0].text == "after"


# --------------------------------------------------------------------------- kazma doctor


async def test_doctor_names_the_account_the_home_room_and_an_encrypted_one(harness: MatrixHarness) -> None:
    base = MatrixConfig(homeserver=harness.server.url, access_token=harness.bot.token, home_room=harness.home)
    async with httpx.AsyncClient(timeout=30) as client:
        good = await check_matrix(base, client)
        assert [c.level for c in good] == [Level.OK, Level.OK]
        assert harness.bot.user_id in good[0].detail
        other = base.model_copy(update={"user_id": harness.admin})
        [wrong] = await check_matrix(other, client)
        assert wrong.level is Level.FAIL
        assert "not @alice" in wrong.detail
        [refused] = await check_matrix(base.model_copy(update={"access_token": "syt_not_a_token"}), client)
        assert refused.level is Level.FAIL
        assert "refused" in refused.detail
        assert "syt_not_a_token" not in refused.detail
        alice = harness.people[harness.admin]
        locked = await asyncio.to_thread(alice.create_room, invite=[harness.bot.user_id], encrypted=True)
        unjoined = await asyncio.to_thread(alice.create_room)
        await asyncio.to_thread(harness.bot.join, locked)
        _, encrypted = await check_matrix(base.model_copy(update={"home_room": locked}), client)
        assert encrypted.level is Level.FAIL
        assert "end-to-end encrypted" in encrypted.detail
        _, absent = await check_matrix(base.model_copy(update={"home_room": unjoined}), client)
        assert absent.level is Level.FAIL
        assert "has not joined" in absent.detail


# --------------------------------------------------------------------------- direct rooms


async def test_the_bot_joins_a_direct_room_only_from_someone_dm_policy_allows(harness: MatrixHarness) -> None:
    await harness.start(direct=DirectPolicy.of([f"matrix:{harness.admin}"], ()))
    alice, bob = harness.people[harness.admin], harness.people[harness.member]
    refused = await asyncio.to_thread(bob.create_room, invite=[harness.bot.user_id], direct=True)
    allowed = await asyncio.to_thread(alice.create_room, invite=[harness.bot.user_id], direct=True)

    def joined() -> list[str]:
        return list(harness.bot.request("GET", "/_matrix/client/v3/joined_rooms")["joined_rooms"])

    async with asyncio.timeout(30):
        while allowed not in await asyncio.to_thread(joined):
            await asyncio.sleep(0.05)
    harness.since[allowed] = await asyncio.to_thread(alice.now, allowed)
    await harness.say(allowed, harness.admin, "hello in private")
    [inbound] = await harness.recorder.wait_until(lambda: harness.recorder.inbound)
    assert (inbound.chat, inbound.direct, inbound.text) == (allowed, True, "hello in private")
    assert refused not in await asyncio.to_thread(joined)  # an invitation from someone else is left alone
    direct = await asyncio.to_thread(harness.bot.account_data, "m.direct")
    assert direct is not None
    assert allowed in direct[harness.admin]  # kept with the account, as clients keep direct rooms


async def test_an_invite_is_judged_by_its_own_event_not_by_the_state_its_inviter_sent_with_it(
    harness: MatrixHarness,
) -> None:
    """An invite comes with the room's "stripped state", which the inviting server supplies unchecked; the
    homeserver puts the invite itself last. The bot took the first member event for itself it found there: a
    server inviting from @bob (whom dm_policy refuses) put one saying @alice invited, and the bot joined as for
    Alice and listed the room as Alice's direct room, where her DM cards (her calls' arguments) would go."""
    await harness.start(direct=DirectPolicy.of([f"matrix:{harness.admin}"], ()))
    bob = harness.people[harness.member]

    def vouched_for_by_alice(sync: dict[str, Any]) -> bool:
        for data in ((sync.get("rooms") or {}).get("invite") or {}).values():
            events = (data.get("invite_state") or {}).get("events") or []
            mine = [e for e in events if e.get("type") == "m.room.member" and e.get("state_key") == harness.bot.user_id]
            if mine and mine[-1].get("sender") == bob.user_id:
                forged = {**mine[-1], "sender": harness.admin, "content": {"membership": "invite", "is_direct": True}}
                events.insert(0, forged)
                return True
        return False

    harness.proxy.rewrite("GET", r"/sync$", vouched_for_by_alice)
    room = await asyncio.to_thread(bob.create_room, invite=[harness.bot.user_id], direct=True)
    await harness.say(harness.home, harness.admin, "after the invite")  # its batch is taken after the invite's
    await texts_arrived(harness, 1)
    assert not harness.proxy.rewrites  # the forged state came with the invite
    await harness.settled()
    joined = await asyncio.to_thread(harness.bot.request, "GET", "/_matrix/client/v3/joined_rooms")
    assert room not in joined["joined_rooms"]
    direct = await asyncio.to_thread(harness.bot.account_data, "m.direct") or {}
    assert room not in direct.get(harness.admin, [])


async def test_a_dm_card_never_goes_to_a_direct_room_its_person_has_left(harness: MatrixHarness) -> None:
    """The account's direct-room list keeps a room after its person leaves it (or declines the bot's invitation):
    every later DM card for them was posted there, where nobody who may decide it would ever see it."""
    adapter = await harness.start()
    assert isinstance(adapter, MatrixAdapter)
    carol = harness.server.register("carol")
    first = await adapter.direct_chat(carol.user_id)  # a new room, carol invited
    assert await adapter.direct_chat(carol.user_id) == first  # invited: still hers
    await asyncio.to_thread(carol.request, "POST", f"/_matrix/client/v3/rooms/{quote(first)}/leave", {})
    second = await adapter.direct_chat(carol.user_id)
    assert second != first
    member = f"/_matrix/client/v3/rooms/{quote(second)}/state/m.room.member/{quote(carol.user_id)}"
    assert (await asyncio.to_thread(harness.bot.request, "GET", member))["membership"] == "invite"
    assert await adapter.direct_chat(carol.user_id) == second


DIRECT_LIST = r"/account_data/m\.direct$"


async def test_a_direct_room_list_the_homeserver_fails_to_show_is_never_taken_for_an_empty_one(
    harness: MatrixHarness,
) -> None:
    # A 5xx on reading m.direct was taken for "no direct rooms yet": a DM card opened a second room with the
    # person, and the list written back held that one room alone, every other person's direct room lost.
    adapter = await harness.start()
    assert isinstance(adapter, MatrixAdapter)
    kept = await asyncio.to_thread(harness.bot.account_data, "m.direct")
    assert kept is not None
    try:
        harness.proxy.fail("GET", DIRECT_LIST, 500, times=2)
        for _ in range(2):
            with pytest.raises(PlatformError) as failed:
                await adapter.direct_chat(harness.admin)
            assert failed.value.retryable  # the card's post is tried again
        assert await adapter.direct_chat(harness.admin) == harness.direct[harness.admin]
        assert await asyncio.to_thread(harness.bot.account_data, "m.direct") == kept
    finally:
        await asyncio.to_thread(harness.bot.set_account_data, "m.direct", kept)


async def test_direct_rooms_the_start_failed_to_read_are_read_before_the_sync_takes_anything_in(
    harness: MatrixHarness,
) -> None:
    # Unread at the start, every direct room was a group room to this process: a person's DM went unanswered.
    harness.proxy.fail("GET", DIRECT_LIST, 500, times=2)
    before = failure_count("direct", "matrix")
    await harness.start(direct=DirectPolicy.of([f"matrix:{harness.admin}"], ()))
    assert failure_count("direct", "matrix") == before + 1  # said and counted at the start
    room = await harness.say_direct(harness.admin, "hello in private")
    [inbound] = await harness.recorder.wait_until(lambda: harness.recorder.inbound, timeout=30)
    assert (inbound.chat, inbound.direct, inbound.text) == (room, True, "hello in private")
    assert harness.proxy.count("GET", DIRECT_LIST) == 3  # at the start, before the first batch, then read


async def joined_rooms(harness: MatrixHarness) -> list[str]:
    answer = await asyncio.to_thread(harness.bot.request, "GET", "/_matrix/client/v3/joined_rooms")
    return list(answer["joined_rooms"])


async def until_joined(harness: MatrixHarness, room: str) -> None:
    async with asyncio.timeout(30):
        while room not in await joined_rooms(harness):
            await asyncio.sleep(0.1)  # polled: the bot's membership is the homeserver's


async def test_an_invite_whose_join_failed_once_is_joined_when_the_batch_comes_again(harness: MatrixHarness) -> None:
    alice = harness.people[harness.admin]
    room = await asyncio.to_thread(alice.create_room, name="served, invited later")
    await harness.start(chats=[harness.home, room])
    harness.proxy.fail("POST", r"/join$", 502, times=1)
    path = f"/_matrix/client/v3/rooms/{quote(room)}/invite"
    await asyncio.to_thread(alice.request, "POST", path, {"user_id": harness.bot.user_id})
    await until_joined(harness, room)
    assert harness.proxy.count("POST", r"/join$") == 2


async def test_an_invite_whose_join_never_works_holds_the_sync_for_a_bounded_number_of_tries(
    harness: MatrixHarness,
) -> None:
    # A join failing with a 5xx for ever (the room's only server down) failed the batch for ever: every room's
    # later events waited behind the invite. After upgrade_join_tries the invite is passed by, counted.
    alice = harness.people[harness.admin]
    room = await asyncio.to_thread(alice.create_room, name="served, its server down")
    adapter = await harness.start(chats=[harness.home, room])
    assert isinstance(adapter, MatrixAdapter)
    adapter.upgrade_join_tries = 2
    before = failure_count("matrix_invite_join_failed", "matrix")
    harness.proxy.fail("POST", r"/join$", 502, times=1_000)
    path = f"/_matrix/client/v3/rooms/{quote(room)}/invite"
    await asyncio.to_thread(alice.request, "POST", path, {"user_id": harness.bot.user_id})
    await harness.say(harness.home, harness.admin, "after the invite")
    assert await texts_arrived(harness, 1, timeout=60) == ["after the invite"]
    assert harness.proxy.count("POST", r"/join$") == 2
    assert failure_count("matrix_invite_join_failed", "matrix") == before + 1


async def test_an_invite_seen_at_the_first_start_whose_join_failed_once_is_joined(harness: MatrixHarness) -> None:
    """The first start's sync is the only one that shows an invite made before it: a join that fails there is
    tried again before the position moves past that sync."""
    alice = harness.people[harness.admin]
    room = await asyncio.to_thread(alice.create_room, invite=[harness.bot.user_id], name="invited before start")
    harness.proxy.fail("POST", r"/join$", 502, times=1)
    await harness.start(chats=[harness.home, room])
    await until_joined(harness, room)
    assert harness.proxy.count("POST", r"/join$") == 2


async def test_a_position_the_homeserver_would_not_keep_repeats_nothing(harness: MatrixHarness) -> None:
    await harness.start()
    before = failure_count("sync", "matrix")
    harness.proxy.fail("PUT", r"/account_data/org\.kazma\.sync$", 500, times=1)  # the save after the first message
    await harness.say(harness.home, harness.admin, "one")
    await harness.say(harness.home, harness.admin, "two")
    await texts_arrived(harness, 2)
    await harness.say(harness.home, harness.admin, "three")
    found = await texts_arrived(harness, 3)
    await harness.settled()
    assert [i.text for i in harness.recorder.inbound] == found == ["one", "two", "three"]
    assert failure_count("sync", "matrix") == before + 1  # counted, and the batch was taken again


async def test_a_5xx_or_a_long_429_says_what_the_homeserver_answered(harness: MatrixHarness) -> None:
    """The words the card outbox and the log keep: the status of a 5xx (Synapse's body says only M_UNKNOWN), and the
    wait a 429 asked for (here longer than the pacing waits out inside a call, so the error goes up at once)."""
    adapter = await harness.start()
    card = make_card({"path": "/tmp/x"})
    harness.proxy.fail("PUT", r"/send/m\.room\.message/kazma-card-", 500)
    with pytest.raises(PlatformError) as caught:
        await adapter.post_card(card)
    assert str(caught.value) == "matrix card_post: HTTP 500 M_UNKNOWN: Internal server error"
    assert caught.value.retryable
    harness.proxy.fail("PUT", r"/send/m\.room\.message/kazma-card-", 429, retry_after_ms=60_000)
    with pytest.raises(PlatformError) as caught:
        await adapter.post_card(card)
    assert str(caught.value) == (
        "matrix card_post: rate limited: HTTP 429 M_LIMIT_EXCEEDED: Too Many Requests (retry after 60 s)"
    )
    assert caught.value.retry_after == 60.0


NGINX_502 = (
    "<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n<center><h1>502 Bad Gateway</h1></center>"
    "\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n"
)


async def test_a_proxy_s_502_page_is_told_by_its_status_not_repeated_whole() -> None:
    """A reverse proxy in front of the homeserver answers its own HTML page: mautrix's words were that whole page."""

    async def gateway(request: web.Request) -> web.Response:
        return web.Response(status=502, text=NGINX_502, content_type="text/html")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", gateway)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    client = make_client(f"http://127.0.0.1:{runner.addresses[0][1]}", "token", request_timeout=5)
    try:
        with pytest.raises(MatrixRequestError) as caught:
            await client.api.request(Method.PUT, "/_matrix/client/v3/rooms/!r:x/send/m.room.message/t1", {"body": "x"})
    finally:
        await close_client(client)
        await runner.cleanup()
    error = classify("card_post", caught.value, timeout=5)
    assert str(error) == "matrix card_post: HTTP 502"
    assert error.retryable


async def test_a_card_posted_again_is_the_same_event_not_a_second_card(harness: MatrixHarness) -> None:
    """What the bus counts on (``idempotent_posts``) when a post's answer was lost or its process died: the
    transaction id makes the homeserver give the first event back, also to a new process with the token."""
    adapter = await harness.start()
    card = make_card({"path": "/tmp/x"})
    harness.proxy.fail("PUT", r"/send/m\.room\.message/kazma-card-", 500, after=True)  # landed; answer lost
    with pytest.raises(PlatformError):
        await adapter.post_card(card)
    await adapter.stop()
    again = await harness.start()
    first = await again.post_card(card)
    second = await again.post_card(card)
    assert first.message_id == second.message_id
    cards = [e for e in harness._bot_events(harness.home) if "org.kazma.choices" in e["content"]]
    assert [e["event_id"] for e in cards] == [first.message_id]


async def test_the_card_carries_its_reactions_so_one_click_presses(harness: MatrixHarness) -> None:
    adapter = await harness.start()
    ref = await adapter.post_card(make_card({"path": "/tmp/x"}))
    await adapter.quiesce()  # the reactions follow the post
    path = f"/_matrix/client/v1/rooms/{quote(ref.chat)}/relations/{quote(ref.message_id)}/m.annotation"
    reactions = (await asyncio.to_thread(harness.people[harness.admin].request, "GET", path))["chunk"]
    offered = sorted((e["sender"], e["content"]["m.relates_to"]["key"]) for e in reactions)
    assert offered == sorted((harness.bot.user_id, key) for key in ("✅", "❌", "💬"))
    await harness.say(harness.home, harness.admin, "after")
    await texts_arrived(harness, 1)
    await harness.settled()
    assert harness.recorder.presses == []  # the bot's own reactions press nothing


async def test_a_file_larger_than_one_read_arrives_whole_and_one_too_large_is_refused(harness: MatrixHarness) -> None:
    """A file was fetched with one ``read(limit)``, which gives what has arrived so far: a 1 MB file reached the
    agents as its first ~118 KB, said nowhere, and a file larger than files.max_bytes that declared a small size
    passed whenever its first piece was under the bound."""
    await harness.start(files=FileBounds(max_bytes=1_500_000, max_count=3))
    whole = bytes(range(256)) * 4_000  # 1 MB: many reads' worth
    await harness.send_files(harness.home, harness.member, "the dump", [("dump.bin", whole, None)])
    await harness.send_files(harness.home, harness.member, "small, it says", [("liar.bin", b"y" * 2_000_000, 10)])
    await harness.recorder.wait_until(lambda: len(harness.recorder.inbound) >= 2)
    first, liar = harness.recorder.inbound
    assert await first.attachments[0].fetch() == whole
    with pytest.raises(FileTooLarge, match=r"liar\.bin"):
        await liar.attachments[0].fetch()


async def test_a_file_whose_media_address_climbs_out_of_the_media_api_is_never_fetched(harness: MatrixHarness) -> None:
    """A file message's ``url`` is whatever its sender wrote. ``mxc://localhost/../../../../v3/joined_rooms`` was
    fetched as ``/_matrix/client/v1/media/download/localhost/../../../../v3/joined_rooms``, which the URL resolves
    to ``/_matrix/client/v3/joined_rooms``: any client API read, with the bot's access token, handed to the agents
    as the file (the bot's rooms, another room's messages, its account data)."""
    await harness.start()
    member = harness.people[harness.member]
    for climbing in ("mxc://localhost/../../../../v3/joined_rooms", "mxc://../../../../v3/joined_rooms/x"):
        message = {"msgtype": "m.file", "body": "notes", "filename": "notes.txt", "url": climbing, "info": {"size": 9}}
        await asyncio.to_thread(member.send, harness.home, message)
    await harness.say(harness.home, harness.member, "after the files")
    await harness.recorder.wait_until(lambda: any(i.text == "after the files" for i in harness.recorder.inbound))
    fetched = []
    for attachment in (a for i in harness.recorder.inbound for a in i.attachments):
        with contextlib.suppress(PlatformError):  # a path the homeserver has no answer for
            fetched.append(await attachment.fetch())
    assert not any(harness.unserved.encode() in data for data in fetched), fetched
    assert [i.text for i in harness.recorder.inbound] == ["after the files"]  # files Kazma cannot fetch, as ever
    assert harness.proxy.count("GET", r"/joined_rooms") == 0


async def test_a_notice_is_a_bots_message(harness: MatrixHarness) -> None:
    await harness.start()
    other_bot = harness.people[harness.member]
    await asyncio.to_thread(other_bot.send, harness.home, {"msgtype": "m.notice", "body": "@builder deploy it"})
    [inbound] = await harness.recorder.wait_until(lambda: harness.recorder.inbound)
    assert (inbound.from_bot, inbound.mentions) == (True, ("builder",))


# --------------------------------------------------------------------------- rooms that are upgraded

JOIN = r"/rooms/[^/]+/join$"


async def served_public_room(harness: MatrixHarness) -> tuple[MatrixAdapter, str]:
    """A public room the bot is in and serves (its replacement needs no invite), one message in it taken in."""
    alice, bot = harness.people[harness.admin], harness.bot

    def make_room() -> str:
        room = alice.create_room(invite=[bot.user_id], name="public, to be upgraded", public=True)
        bot.join(room)
        return room

    room = await asyncio.to_thread(make_room)
    adapter = await harness.start(chats=[harness.home, room])
    assert isinstance(adapter, MatrixAdapter)
    await harness.say(room, harness.admin, "before the upgrade")
    await texts_arrived(harness, 1)
    return adapter, room


async def upgraded(harness: MatrixHarness, room: str, version: str = "10") -> str:
    """``room`` upgraded by its admin (Synapse's own upgrade): the replacement's id."""
    path = f"/_matrix/client/v3/rooms/{quote(room)}/upgrade"
    answer = await asyncio.to_thread(harness.people[harness.admin].request, "POST", path, {"new_version": version})
    return str(answer["replacement_room"])


async def test_a_replacement_room_the_homeserver_failed_to_join_once_is_joined_when_the_batch_comes_again(
    harness: MatrixHarness,
) -> None:
    # A public room's replacement needs no invite: the join at the tombstone is the only one. A 5xx there was taken
    # for "not invited yet" and the bot never joined the room it now served.
    alice, bot = harness.people[harness.admin], harness.bot
    adapter, room = await served_public_room(harness)
    harness.proxy.fail("POST", JOIN, 500, times=1)
    new = await upgraded(harness, room)

    def bot_joined() -> bool:
        members = alice.request("GET", f"/_matrix/client/v3/rooms/{quote(new)}/joined_members")["joined"]
        return bot.user_id in members

    async with asyncio.timeout(60):  # joined, then moved once the replacement showed itself the successor
        while adapter.moved_to(room) != new:
            await asyncio.sleep(0.1)
    assert await asyncio.to_thread(bot_joined)
    assert harness.proxy.count("POST", JOIN) == 2  # the failed join, then the one with the batch again
    await harness.say(new, harness.admin, "in the replacement")
    assert await texts_arrived(harness, 2) == ["before the upgrade", "in the replacement"]


async def test_a_replacement_room_the_homeserver_never_joins_holds_the_sync_for_a_bounded_number_of_tries(
    harness: MatrixHarness,
) -> None:
    # The join at a tombstone is tried again with the batch while it fails with a 5xx: one that fails for ever (the
    # replacement's only server down: "Failed to make_join via any server", a 502) held every room's later events
    # behind the tombstone for ever, as a card the homeserver never shows did. After upgrade_join_tries the
    # tombstone is passed by, counted; the chat stays where it was (a replacement never read is not shown to be the
    # room's successor) until the bot is invited there.
    adapter, room = await served_public_room(harness)
    adapter.upgrade_join_tries = 2
    before = failure_count("matrix_upgrade_join_failed", "matrix")
    harness.proxy.fail("POST", JOIN, 502, times=1_000)
    new = await upgraded(harness, room)
    async with asyncio.timeout(60):  # the batch with the tombstone, then once again (tries: 2), then passed by
        while failure_count("matrix_upgrade_join_failed", "matrix") == before:
            await asyncio.sleep(0.1)
    await harness.say(harness.home, harness.admin, "after the upgrade")
    assert await texts_arrived(harness, 2, timeout=60) == ["before the upgrade", "after the upgrade"]
    assert harness.proxy.count("POST", JOIN) == 2  # not tried again: the sync has moved past the tombstone
    assert adapter.moved_to(room) == room != new
    assert failure_count("matrix_upgrade_join_failed", "matrix") == before + 1


def membership(person: Any, room: str, user: str) -> str | None:
    path = f"/_matrix/client/v3/rooms/{quote(room)}/state/m.room.member/{quote(user)}"
    try:
        return str(person.request("GET", path)["membership"])
    except SynapseError:
        return None


def forged_upgrade(alice: Any, room: str, *, claims: bool, private: bool) -> str:
    """A room of ``alice``'s own (invite-only when ``private``), named in a tombstone she sends in ``room``;
    ``claims``: made to name ``room`` as its predecessor (room version 10)."""
    made: dict[str, Any] = {"preset": "private_chat" if private else "public_chat", "name": "mine"}
    if claims:
        made |= {"room_version": "10", "creation_content": {"predecessor": {"room_id": room}}}
    mine = str(alice.request("POST", "/_matrix/client/v3/createRoom", made)["room_id"])
    path = f"/_matrix/client/v3/rooms/{quote(room)}/state/m.room.tombstone"
    alice.request("PUT", path, {"body": "moved", "replacement_room": mine})
    return mine


async def invited_after_the_tombstone(harness: MatrixHarness, logged: list[Any], mine: str) -> None:
    """The bot invited to ``mine`` once its join at the tombstone was refused (not invited yet): the invite is
    then followed, not the tombstone."""
    async with asyncio.timeout(60):
        while not any(e["event"] == "matrix.upgrade_join_waits_for_invite" for e in logged):
            await asyncio.sleep(0.1)
    path = f"/_matrix/client/v3/rooms/{quote(mine)}/invite"
    await asyncio.to_thread(harness.people[harness.admin].request, "POST", path, {"user_id": harness.bot.user_id})


@pytest.mark.parametrize(
    ("claims", "invited"),
    [(False, False), (True, False), (True, True)],
    ids=["a room of ones own", "one claiming the room without the tombstone", "the same, invite-only"],
)
async def test_a_tombstone_naming_a_room_that_is_no_upgrade_moves_nothing_and_the_bot_leaves_it(
    harness: MatrixHarness, claims: bool, invited: bool
) -> None:
    # Anyone with power level 100 in a served room may send a tombstone naming any room. Taken for an upgrade, the
    # chat moved there: every later card (a dangerous call with its arguments) was posted in the sender's own room,
    # and presses there decided. A room made to name the served one as its predecessor is no successor either (room
    # version 10): a real upgrade's create event names the tombstone itself, sent after the room was made.
    alice, bot = harness.people[harness.admin], harness.bot
    adapter, room = await served_public_room(harness)
    before = failure_count("matrix_upgrade_forged", "matrix")
    with structlog.testing.capture_logs() as logged:
        mine = await asyncio.to_thread(forged_upgrade, alice, room, claims=claims, private=invited)
        if invited:
            await invited_after_the_tombstone(harness, logged, mine)
        async with asyncio.timeout(60):
            while failure_count("matrix_upgrade_forged", "matrix") == before:
                await asyncio.sleep(0.1)
        async with asyncio.timeout(30):  # the leave follows the count
            while await asyncio.to_thread(membership, alice, mine, bot.user_id) != "leave":
                await asyncio.sleep(0.1)
    assert adapter.moved_to(room) == room
    assert room in adapter.served
    assert mine not in adapter.served
    [forged] = [e for e in logged if e["event"] == "matrix.upgrade_forged"]
    assert (forged["room"], forged["replacement"], forged["sender"]) == (room, mine, alice.user_id)
    # the served room is still the chat: what is said there arrives from it
    await harness.say(room, harness.admin, "still here")
    assert await texts_arrived(harness, 2) == ["before the upgrade", "still here"]
    assert harness.recorder.inbound[-1].chat == room


async def test_an_invite_whose_old_room_cannot_be_read_holds_the_sync_for_a_bounded_number_of_tries(
    harness: MatrixHarness,
) -> None:
    # At an invite to a room that names a served one as its predecessor, the served room's tombstone is read: a
    # read that fails for ever (a 5xx) held every later event behind the invite. After upgrade_join_tries the
    # invite is taken as any other (not joined), said, and the chat stays where it was.
    alice, bot = harness.people[harness.admin], harness.bot
    adapter, room = await served_public_room(harness)
    adapter.upgrade_join_tries = 2
    harness.proxy.fail("GET", r"/state/m\.room\.tombstone$", 502, times=1_000)
    with structlog.testing.capture_logs() as logged:
        mine = await asyncio.to_thread(forged_upgrade, alice, room, claims=True, private=True)
        await invited_after_the_tombstone(harness, logged, mine)
        await harness.say(room, harness.admin, "after the invite")
        assert await texts_arrived(harness, 2, timeout=60) == ["before the upgrade", "after the invite"]
    assert harness.proxy.count("GET", r"/state/m\.room\.tombstone$") == 2
    assert [e["replacement"] for e in logged if e["event"] == "matrix.upgrade_unreadable"] == [mine]
    assert adapter.moved_to(room) == room
    assert await asyncio.to_thread(membership, alice, mine, bot.user_id) == "invite"  # passed by, not joined


async def test_a_tombstone_naming_another_served_room_moves_nothing_and_the_bot_stays_there(
    harness: MatrixHarness,
) -> None:
    # The room a forged tombstone names is left again, unless the bot serves it anyway: a tombstone naming the home
    # room would otherwise have the bot leave its own home room.
    alice, bot = harness.people[harness.admin], harness.bot
    adapter, room = await served_public_room(harness)
    before = failure_count("matrix_upgrade_forged", "matrix")
    path = f"/_matrix/client/v3/rooms/{quote(room)}/state/m.room.tombstone"
    await asyncio.to_thread(alice.request, "PUT", path, {"body": "moved", "replacement_room": harness.home})
    async with asyncio.timeout(60):
        while failure_count("matrix_upgrade_forged", "matrix") == before:
            await asyncio.sleep(0.1)
    await harness.say(harness.home, harness.admin, "still in the home room")
    assert await texts_arrived(harness, 2) == ["before the upgrade", "still in the home room"]
    assert adapter.moved_to(room) == room
    assert await asyncio.to_thread(membership, alice, harness.home, bot.user_id) == "join"


@pytest.mark.parametrize("version", ["10", "12"])
async def test_a_real_upgrade_of_a_public_room_moves_the_chat_at_the_tombstone(
    harness: MatrixHarness, version: str
) -> None:
    # Synapse's upgrade names the old room and the tombstone in the new room's create event; from room version 12
    # on (the room's id its create event's hash, made before the tombstone) the old room alone.
    alice, bot = harness.people[harness.admin], harness.bot
    adapter, room = await served_public_room(harness)
    new = await upgraded(harness, room, version)
    async with asyncio.timeout(60):
        while adapter.moved_to(room) != new:
            await asyncio.sleep(0.1)
    assert await asyncio.to_thread(membership, alice, new, bot.user_id) == "join"
    await harness.say(new, harness.admin, "in the replacement")
    assert await texts_arrived(harness, 2) == ["before the upgrade", "in the replacement"]
    assert harness.recorder.inbound[-1].chat == new


async def test_an_upgraded_room_is_served_as_its_replacement(harness: MatrixHarness) -> None:
    alice, bot = harness.people[harness.admin], harness.bot

    def make_room() -> str:
        room = alice.create_room(invite=[bot.user_id], name="to be upgraded")  # its own: others share home
        bot.join(room)
        return room

    room = await asyncio.to_thread(make_room)
    adapter = await harness.start(chats=[harness.home, room])
    await harness.say(room, harness.admin, "before the upgrade")
    await texts_arrived(harness, 1)

    def upgrade() -> str:
        new = str(alice.request("POST", f"/_matrix/client/v3/rooms/{quote(room)}/upgrade", {"new_version": "10"})[
            "replacement_room"
        ])  # fmt: skip
        # an invite-only room's replacement needs an invite: the bot joins at it, the new room being served
        alice.request("POST", f"/_matrix/client/v3/rooms/{quote(new)}/invite", {"user_id": bot.user_id})
        return new

    new = await asyncio.to_thread(upgrade)

    def bot_joined() -> bool:
        members = alice.request("GET", f"/_matrix/client/v3/rooms/{quote(new)}/joined_members")["joined"]
        return bot.user_id in members

    async with asyncio.timeout(30):  # joined at the invite, then moved once the replacement showed itself the successor
        while adapter.moved_to(room) != new:
            await asyncio.sleep(0.1)
    assert await asyncio.to_thread(bot_joined)
    assert new in adapter.served
    assert room not in adapter.served
    # what people say in the replacement reaches Kazma as that room; what Kazma sends to the old id lands there
    await harness.say(new, harness.admin, "in the replacement")
    found = await texts_arrived(harness, 2)
    assert found == ["before the upgrade", "in the replacement"]
    assert harness.recorder.inbound[-1].chat == new
    await adapter.send_text(room, "sent to the old room's id")
    events = await asyncio.to_thread(alice.messages, new)
    said = [
        e["content"].get("body") for e in events if e.get("sender") == bot.user_id and e["type"] == "m.room.message"
    ]
    assert said == ["sent to the old room's id"]


async def test_the_outcome_shown_again_over_a_progress_edit_is_a_new_edit(harness: MatrixHarness) -> None:
    # The bus shows the outcome again when a progress edit (another replica's, in flight at the decision) landed
    # over it. The edit's transaction id was made of its words alone, so the homeserver answered the second settle
    # with the first one's event and added nothing: the decided card went on showing the progress and its buttons.
    adapter = await harness.start()
    card = make_card({"path": "/tmp/x"})
    ref = await adapter.post_card(card)
    outcome = outcome_of(card)
    await adapter.settle_card(ref, card, outcome)
    await adapter.update_card(ref, dataclasses.replace(card, progress="1 of 2 approvals"))
    assert harness.card(ref).buttons != []  # the progress edit landed over the outcome
    await adapter.settle_card(ref, card, outcome)
    shown = harness.card(ref)
    assert shown.buttons == []
    assert shown.text.startswith("APPROVED by telegram:111")


async def test_a_settle_repeated_is_one_edit_and_a_look_alike_edit_by_someone_else_is_not_the_bots(
    harness: MatrixHarness,
) -> None:
    adapter = await harness.start()
    card = make_card({"path": "/tmp/x"})
    ref = await adapter.post_card(card)
    outcome = outcome_of(card)
    # Someone relates an "edit" to the bot's card saying what its settle will say; clients show only the sender's
    # own edits, so it must not pass for the bot's (and spare the settle).
    laid = render_card(card, outcome=outcome)
    forged = edit_content(laid.written, laid.view, ref.message_id)
    await asyncio.to_thread(harness.people[harness.member].send, ref.chat, forged)
    await adapter.settle_card(ref, card, outcome)
    await adapter.settle_card(ref, card, outcome)  # repeated (a restart, a lost answer): nothing new on the room
    edits = await asyncio.to_thread(harness.people[harness.admin].request, "GET",
        f"/_matrix/client/v1/rooms/{quote(ref.chat)}/relations/{quote(ref.message_id)}/m.replace")  # fmt: skip
    senders = sorted(e["sender"] for e in edits["chunk"])
    assert senders == sorted([harness.bot.user_id, harness.member])
    assert harness.card(ref).buttons == []


# --------------------------------------------------------------------------- cards at their budget


def test_an_edit_carries_the_card_once_so_it_fits_where_the_post_fits() -> None:
    card = make_card({"script": "echo one line of a long script\n" * 6_000}, value_limit=500_000)
    for outcome in (None, outcome_of(card)):
        laid = render_card(card, outcome=outcome)
        edit = edit_content(laid.written, laid.view, "$card")
        assert edit["m.new_content"] == laid.written.content()
        assert len(json.dumps(laid.written.content(), ensure_ascii=False).encode()) <= CARD_BUDGET
        # the fallback a client without edits shows: one line pointing at the card, never the card again
        assert len(json.dumps(edit, ensure_ascii=False).encode()) <= CARD_BUDGET + 1_000
        assert "\n" not in edit["body"]
        assert edit["body"].endswith(EDIT_POINTER)
    assert edit["body"].startswith("* APPROVED by telegram:111")


async def test_a_card_laid_out_at_its_budget_is_updated_and_settled(harness: MatrixHarness) -> None:
    """The post is sized to fit one event; its edits must fit too (the homeserver refuses an event over 64 KiB
    with M_TOO_LARGE, which no retry mends: the bus would give the settle up while the card shows Approve)."""
    adapter = await harness.start()
    card = make_card({"script": "echo one line of a long script\n" * 6_000}, value_limit=500_000)
    ref = await adapter.post_card(card)
    posted = await asyncio.to_thread(harness.people[harness.admin].event, ref.chat, ref.message_id)
    size = len(json.dumps(posted["content"], ensure_ascii=False).encode())
    assert CARD_BUDGET - 2_000 < size <= CARD_BUDGET  # the card is at its budget: the test means something
    offered = harness.card(ref).buttons  # cut to fit, so Deny alone (approved where the whole call is shown)
    assert offered
    await adapter.update_card(ref, card)  # a policy's progress: the card as it is now, reactions kept
    assert harness.card(ref).buttons == offered
    await adapter.settle_card(ref, card, outcome_of(card))
    shown = harness.card(ref)
    assert shown.text.startswith("APPROVED")
    assert shown.buttons == []
