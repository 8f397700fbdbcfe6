"""Inbound events handled once across replicas, with the claims in one store and the real adapters on the fakes.

Telegram: leadership moves between two replicas of one bot while updates are left unconfirmed (the
old leader's confirmations fail, as when it dies), so Telegram hands them to the new leader again;
every update is still handled exactly once. Slack: an event retried to another replica, the two
events of one post, and one press reaching two replicas are each handled once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import urlencode

import pytest

from kazma.adapters.pacing import ChatRateLimiter
from kazma.adapters.slack import SlackAdapter
from kazma.adapters.slack.render import APPROVE_ACTION
from kazma.adapters.telegram import TelegramAdapter
from kazma.bot.inbound_claims import MIGRATIONS, InboundClaims
from kazma.config.metrics import failure_count
from kazma.config.models import SlackConfig, SlackHttpConfig, TelegramConfig
from kazma.config.store.database import open_database
from tests.contract.harness import free_port
from tests.fakes.slack import FakeSlack
from tests.fakes.telegram import FakeTelegram, Fault
from tests.ingress_support import Replica

# PTB itself reads RetryAfter.retry_after while building the exception; that warning is PTB's own.
pytestmark = pytest.mark.filterwarnings("ignore:.*retry_after.*:telegram.warnings.PTBDeprecationWarning")

GROUP = -1001234567890
ADMIN = 111
CARD_MESSAGE = 9_000  # a card message the fake never saw: it shows the pressed button (message 1 is a person's)
CHANNEL = "CHOME0001"
SLACK_ADMIN = "UADMIN001"


@pytest.fixture
async def replicas(tmp_path: Path) -> AsyncIterator[tuple[Replica, Replica]]:
    """Two replicas' handlers, each claiming through its own connection to one store."""
    path = tmp_path / "kazma.db"
    first = await open_database(path, migrations=MIGRATIONS)
    second = await open_database(path, migrations=MIGRATIONS)
    changed = asyncio.Condition()
    try:
        yield (
            Replica("a", InboundClaims(first, replica="a").claim, changed=changed),
            Replica("b", InboundClaims(second, replica="b").claim, changed=changed),
        )
    finally:
        await first.close()
        await second.close()


def won(replica: Replica) -> list[str]:
    return [key for _, key, claimed in replica.claims if claimed]


def refused(replica: Replica) -> list[str]:
    return [key for _, key, claimed in replica.claims if not claimed]


# --------------------------------------------------------------------------- Telegram


@pytest.fixture
async def telegram() -> AsyncIterator[FakeTelegram]:
    fake = FakeTelegram()
    await fake.start()
    yield fake
    await fake.stop()


def telegram_replica(fake: FakeTelegram) -> TelegramAdapter:
    config = TelegramConfig(
        token=fake.token, api_base_url=fake.base_url, chats=[GROUP], home_chat=GROUP, admins=[ADMIN]
    )
    return TelegramAdapter(config, poll_timeout=1.0, request_timeout=5.0, limiter=ChatRateLimiter(min_interval=0))


@asynccontextmanager
async def two_inboxes(path: Path) -> AsyncIterator[tuple[InboundClaims, InboundClaims, set[str]]]:
    """Replicas a and b keeping their inboxes in one store, and the set of those alive (one dies by leaving it)."""
    first = await open_database(path, migrations=MIGRATIONS)
    second = await open_database(path, migrations=MIGRATIONS)
    alive = {"a", "b"}

    async def live() -> set[str]:
        return set(alive)

    try:
        yield InboundClaims(first, replica="a", live=live), InboundClaims(second, replica="b", live=live), alive
    finally:
        await first.close()
        await second.close()


async def poller_dies(adapter: TelegramAdapter) -> None:
    """Its poller stops on the spot: a dead replica runs none of its own stopping code."""
    app = adapter._app
    assert app is not None
    assert app.updater is not None
    await app.updater.stop()


async def test_telegram_updates_left_unconfirmed_by_a_leader_are_handled_once_after_the_handover(
    telegram: FakeTelegram, replicas: tuple[Replica, Replica]
) -> None:
    fake = telegram
    a, b = replicas
    leader, follower = telegram_replica(fake), telegram_replica(fake)
    await leader.start(a.handlers())
    await follower.start(b.handlers(), ingress=False)
    restarted: TelegramAdapter | None = None
    try:
        fake.push_message(GROUP, ADMIN, "one")
        await a.wait_until(lambda: a.texts() == ["one"])

        # From the leader's next answered poll on, Telegram hears no confirmation from it: the poll after
        # that hangs, and the last confirmation it tries on the way out fails.
        await fake.wait_until(lambda: fake.calls_to("getUpdates")[-1].status is None)
        polls = len(fake.calls_to("getUpdates"))
        fake.script("getUpdates", Fault.hang(), Fault.server_error())
        fake.push_message(GROUP, ADMIN, "two")
        fake.push_message(GROUP, ADMIN, "three")
        fake.push_callback(GROUP, CARD_MESSAGE, ADMIN, "kz1:abc:a")
        await a.wait_until(lambda: a.texts() == ["one", "two", "three"] and len(a.presses) == 1)
        await fake.wait_until(lambda: len(fake.calls_to("getUpdates")) > polls)  # the hanging poll
        fake.push_message(GROUP, ADMIN, "four")  # nobody receives it while that poll hangs

        await leader.stop()  # the leader goes away with four updates unconfirmed
        assert fake.pending_updates == 4

        # The follower takes over: Telegram gives it all four; three were handled already.
        await follower.start_ingress()
        fake.push_message(GROUP, ADMIN, "five")
        await b.wait_until(lambda: b.texts() == ["four", "five"] and len(refused(b)) == 3)
        await fake.wait_until(lambda: fake.pending_updates == 0)  # its own polls confirmed them all
        await follower.quiesce()
        assert b.presses == []
        assert sorted(refused(b)) == sorted(won(a)[1:])  # "two", "three" and the press, as the first leader had them

        # Leadership moves back, gracefully this time: the poller confirms what it took before it stops.
        restarted = telegram_replica(fake)
        await restarted.start(a.handlers(), ingress=False)
        await follower.stop_ingress()
        await restarted.start_ingress()
        fake.push_message(GROUP, ADMIN, "six")
        await a.wait_until(lambda: "six" in a.texts())
        await restarted.quiesce()
        await follower.quiesce()
    finally:
        for adapter in (leader, follower, restarted):
            if adapter is not None:
                await adapter.stop()

    assert a.texts() == ["one", "two", "three", "six"]
    assert b.texts() == ["four", "five"]
    assert [p.data for p in a.presses] == ["kz1:abc:a"]
    handled = won(a) + won(b)
    assert len(handled) == len(set(handled)) == 7  # six messages and a press, each handled by one replica once
    assert refused(a) == []  # nothing came back to the first replica after the graceful hand-back


# --------------------------------------------------------------------------- Slack


@pytest.fixture
async def slack() -> AsyncIterator[FakeSlack]:
    fake = FakeSlack()
    await fake.start()
    yield fake
    await fake.stop()


def slack_replica(fake: FakeSlack) -> SlackAdapter:
    config = SlackConfig(
        bot_token=fake.bot_token,
        signing_secret=fake.signing_secret,
        api_base_url=fake.api_url,
        http=SlackHttpConfig(host="127.0.0.1", port=free_port(), path="/slack/events"),
        channels=[CHANNEL],
        home_channel=CHANNEL,
        admins=[SLACK_ADMIN],
    )
    return SlackAdapter(config, limiter=ChatRateLimiter(min_interval=0), request_timeout=5)


async def test_slack_events_retried_or_doubled_across_replicas_are_handled_once(
    slack: FakeSlack, replicas: tuple[Replica, Replica]
) -> None:
    fake = slack
    a, b = replicas
    first, second = slack_replica(fake), slack_replica(fake)
    # HTTP events are not singleton: both replicas serve them, as behind a load balancer.
    await first.start(a.handlers(), ingress=False)
    await second.start(b.handlers(), ingress=False)
    try:
        assert first.events_url is not None
        assert second.events_url is not None
        replicas_urls = (first.events_url, second.events_url)

        # Slack retries an event (same event_id) whose acknowledgement it missed; the retry lands elsewhere.
        envelope = fake.event_envelope(fake.message_event(channel=CHANNEL, user=SLACK_ADMIN, text="deploy it"))
        for url in replicas_urls:
            assert (await fake.post_signed(url, json.dumps(envelope), "application/json")).status == 200

        # One post mentioning the app comes as two events (message, app_mention), one to each replica.
        post = fake.message_event(channel=CHANNEL, user=SLACK_ADMIN, text="<@UBOT> status")
        mention = {**post, "type": "app_mention"}
        mention.pop("channel_type")
        for url, event in zip(replicas_urls, (post, mention), strict=True):
            assert (await fake.post_event(url, event)).status == 200

        # One press delivered to both replicas (the same interaction payload).
        payload = fake.block_action_payload(
            action_id=APPROVE_ACTION, value="kz1:abc:a", user=SLACK_ADMIN, channel=CHANNEL, message_ts="1.1"
        )
        body = urlencode({"payload": json.dumps(payload)})
        for url in replicas_urls:
            signed = await fake.post_signed(url, body, "application/x-www-form-urlencoded")
            assert signed.status == 200

        # One slash command delivered to both.
        form = urlencode(fake.command_form(text="status", channel=CHANNEL, user=SLACK_ADMIN))
        for url in replicas_urls:
            assert (await fake.post_signed(url, form, "application/x-www-form-urlencoded")).status == 200

        await a.wait_until(lambda: len(a.claims) + len(b.claims) == 8, timeout=10)
        await first.quiesce()
        await second.quiesce()
    finally:
        await first.stop()
        await second.stop()

    texts = sorted(a.texts() + b.texts())
    assert texts == ["<@UBOT> status", "deploy it", "status"]
    assert [p.data for p in a.presses + b.presses] == ["kz1:abc:a"]
    assert len(won(a) + won(b)) == 4
    assert sorted(refused(a) + refused(b)) == sorted(won(a) + won(b))  # each event: one yes, one no


async def test_a_claim_the_store_cannot_record_is_handled_here_rather_than_lost(slack: FakeSlack) -> None:
    async def broken(platform: str, key: str) -> bool:
        raise sqlite3.OperationalError("database is locked")

    replica = Replica("a", broken)
    adapter = slack_replica(slack)
    failures = failure_count("inbound_claim", "slack")
    await adapter.start(replica.handlers())
    try:
        assert adapter.events_url is not None
        event = slack.message_event(channel=CHANNEL, user=SLACK_ADMIN, text="still heard")
        assert (await slack.post_event(adapter.events_url, event)).status == 200
        await replica.wait_until(lambda: replica.texts() == ["still heard"])
    finally:
        await adapter.stop()
    # Slack was told it arrived, so dropping it would lose it: handled, and the failure counted.
    assert failure_count("inbound_claim", "slack") == failures + 1


async def test_telegram_updates_a_leader_confirmed_and_never_took_in_reach_the_next_leader_from_the_inbox(
    telegram: FakeTelegram, tmp_path: Path
) -> None:
    """python-telegram-bot confirms a batch with its next poll, before the updates are handled: a leader that
    dies in between takes them with it unless they were kept first. Here the old leader keeps them, confirms
    them, and never gets to claim them (its claims hang: it is as good as dead); the new leader finds them in
    the store and handles each once."""
    fake = telegram
    async with two_inboxes(tmp_path / "kazma.db") as (kept_a, kept_b, alive):
        dead = asyncio.Event()

        async def never_claims(platform: str, key: str) -> bool:
            await dead.wait()  # it died before it could claim
            return False

        a, b = Replica("a", never_claims), Replica("b", kept_b.claim)
        leader = TelegramAdapter(
            TelegramConfig(
                token=fake.token, api_base_url=fake.base_url, chats=[GROUP], home_chat=GROUP, admins=[ADMIN]
            ),
            poll_timeout=1.0,
            request_timeout=5.0,
            limiter=ChatRateLimiter(min_interval=0),
            stop_grace=0.2,
        )
        follower = telegram_replica(fake)
        await leader.start(dataclasses.replace(a.handlers(), inbox=kept_a, inbound_done=kept_a.done))
        await follower.start(dataclasses.replace(b.handlers(), inbox=kept_b, inbound_done=kept_b.done), ingress=False)
        try:
            fake.push_message(GROUP, ADMIN, "one")
            fake.push_message(GROUP, ADMIN, "two")
            fake.push_callback(GROUP, CARD_MESSAGE, ADMIN, "kz1:abc:a")
            async with asyncio.timeout(10):  # it kept them all in the store...
                while (await kept_b.tables.one("SELECT COUNT(*) FROM inbound_claims WHERE payload IS NOT NULL"))[0] < 3:
                    await asyncio.sleep(0.02)
            await fake.wait_until(lambda: fake.pending_updates == 0)  # ... and Telegram will not give them again
            assert a.inbound == []
            assert a.presses == []

            alive.discard("a")
            await poller_dies(leader)
            await follower.start_ingress()
            fake.push_message(GROUP, ADMIN, "three")
            await b.wait_until(lambda: b.texts() == ["one", "two", "three"] and len(b.presses) == 1)
            await follower.quiesce()
            assert [p.data for p in b.presses] == ["kz1:abc:a"]
            assert sorted(won(b)) == sorted(set(won(b)))  # each once
        finally:
            dead.set()
            await leader.stop()
            await follower.stop()


async def test_telegram_updates_a_leader_answered_without_a_press_are_not_answered_again_by_the_next_leader(
    telegram: FakeTelegram, tmp_path: Path
) -> None:
    """A "Deny with reason" press (answered with a prompt) and somebody else's reply to that prompt (answered
    with a refusal) were handled without a claim: they stayed in the leader's inbox as never taken in, so the
    next leader handed them over again and the group saw a second prompt and a second refusal."""
    fake = telegram
    async with two_inboxes(tmp_path / "kazma.db") as (kept_a, kept_b, alive):
        a, b = Replica("a", kept_a.claim), Replica("b", kept_b.claim)
        leader, follower = telegram_replica(fake), telegram_replica(fake)
        await leader.start(dataclasses.replace(a.handlers(), inbox=kept_a, inbound_done=kept_a.done))
        await follower.start(dataclasses.replace(b.handlers(), inbox=kept_b, inbound_done=kept_b.done), ingress=False)

        def prompts() -> list[int]:
            return [m.message_id for m in fake.bot_messages(GROUP) if "reply to this message" in m.text]

        def refusals() -> int:
            return sum("only the person who pressed" in m.text for m in fake.bot_messages(GROUP))

        try:
            query = fake.push_callback(GROUP, CARD_MESSAGE, ADMIN, f"kz1:{'r' * 24}:n")
            await fake.wait_for_answer(query)
            await fake.wait_until(lambda: len(prompts()) == 1)
            fake.push_message(GROUP, 999, "not mine to give", reply_to=prompts()[0])
            await fake.wait_until(lambda: refusals() == 1)
            await leader.quiesce()
            await fake.wait_until(lambda: fake.pending_updates == 0)  # confirmed: Telegram will not give them again

            alive.discard("a")
            await poller_dies(leader)
            await follower.start_ingress()
            fake.push_message(GROUP, ADMIN, "after")
            await b.wait_until(lambda: b.texts() == ["after"])
            await follower.quiesce()
            assert len(prompts()) == 1
            assert refusals() == 1
            assert a.presses == b.presses == []  # neither was a decision
        finally:
            await leader.stop()
            await follower.stop()


async def test_telegram_updates_no_handler_takes_in_are_not_left_in_the_inbox(
    telegram: FakeTelegram, tmp_path: Path
) -> None:
    """A command for another bot and a message no handler takes (a sticker: no text, no file) were dropped without
    being taken in: they stayed in the inbox as unfinished, every next leader took them over (refreshing their
    age, so the day's retention never dropped them) and handed them to its handlers again, one commit each before
    it started polling."""
    fake = telegram
    db = await open_database(tmp_path / "kazma.db", migrations=MIGRATIONS)
    kept = InboundClaims(db, replica="a")
    a = Replica("a", kept.claim)
    leader = telegram_replica(fake)
    await leader.start(dataclasses.replace(a.handlers(), inbox=kept, inbound_done=kept.done))
    try:
        fake.push_message(GROUP, ADMIN, "/swarm@another_bot status")
        fake.push_message(GROUP, ADMIN, "")  # what a sticker is to the handlers: no text, caption or file
        fake.push_message(GROUP, ADMIN, "hello")
        await a.wait_until(lambda: a.texts() == ["hello"])
        await leader.quiesce()
        left = await kept.tables.all("SELECT event_key FROM inbound_claims WHERE done_at IS NULL")
        assert left == []
    finally:
        await leader.stop()
        await db.close()
