"""The singleton ingress apart from the adapter: a replica that is not the leader sends without it.

Each platform's real adapter on its real library against its wire-level fake: started with
``ingress=False`` it posts, settles and sends while the fake sees no ``getUpdates``, no gateway
session and no Socket Mode connection; ``start_ingress`` then delivers messages and presses;
``stop_ingress`` closes the connection and the adapter still edits cards; starting again works.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any

import discord
import pytest

from kazma.adapters.contract import CardRef, Handlers, Inbound, SingletonIngress, singleton_ingress
from kazma.adapters.discord import DiscordAdapter
from kazma.adapters.kit import PlatformBase
from kazma.adapters.pacing import ChatRateLimiter
from kazma.adapters.slack import SlackAdapter
from kazma.adapters.slack.render import APPROVE_ACTION
from kazma.adapters.telegram import TelegramAdapter
from kazma.adapters.terminal import TerminalAdapter
from kazma.adapters.web import WebAdapter
from kazma.approvals.model import Decision
from kazma.config.models import DiscordConfig, SlackConfig, SlackHttpConfig, TelegramConfig, TelegramWebhookConfig
from tests.contract.harness import free_port
from tests.fakes.discord import ALICE_ID, HOME_CHANNEL_ID, FakeDiscord
from tests.fakes.slack import FakeSlack
from tests.fakes.telegram import FakeCall, FakeTelegram
from tests.ingress_support import WAIT, Replica, approved, make_card

# PTB itself reads RetryAfter.retry_after while building the exception; that warning is PTB's own.
pytestmark = pytest.mark.filterwarnings("ignore:.*retry_after.*:telegram.warnings.PTBDeprecationWarning")

GROUP = -1001234567890


class Rig(ABC):
    """One platform's fake and adapter, spoken to as a person and read back as the platform holds it."""

    platform: str
    home: str
    admin: str

    @abstractmethod
    async def open(self) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    def adapter(self) -> PlatformBase: ...

    @abstractmethod
    def ingress_connections(self) -> int:
        """How many times an adapter opened the platform's singleton ingress (polls, sessions, sockets)."""

    @abstractmethod
    async def closed(self, adapter: PlatformBase) -> list[str]:
        """Check that nothing receives for the adapter now; the texts sent meanwhile that it gets once reopened."""

    @abstractmethod
    async def say(self, text: str) -> None: ...

    @abstractmethod
    async def press(self, ref: CardRef, data: str) -> None: ...

    @abstractmethod
    def buttons(self, ref: CardRef) -> list[Any]: ...

    @abstractmethod
    def texts(self) -> list[str]:
        """Every text message in the home chat, as the platform keeps it."""


class TelegramRig(Rig):
    platform, home, admin = "telegram", "-1001234567890", "111"

    async def open(self) -> None:
        self.fake = FakeTelegram()
        await self.fake.start()

    async def close(self) -> None:
        await self.fake.stop()

    def adapter(self) -> PlatformBase:
        config = TelegramConfig(
            token=self.fake.token,
            api_base_url=self.fake.base_url,
            chats=[int(self.home)],
            home_chat=int(self.home),
            admins=[int(self.admin)],
        )
        return TelegramAdapter(config, poll_timeout=1.0, request_timeout=5.0, limiter=ChatRateLimiter(min_interval=0))

    def ingress_connections(self) -> int:
        return len(self.fake.calls_to("deleteWebhook"))  # once per start of polling (PTB's bootstrap)

    async def closed(self, adapter: PlatformBase) -> list[str]:
        polls = len(self.fake.calls_to("getUpdates"))
        self.fake.push_message(int(self.home), int(self.admin), "sent while nobody polled")
        await adapter.send_text(self.home, "a round trip to the Bot API")
        assert len(self.fake.calls_to("getUpdates")) == polls
        assert self.fake.pending_updates == 1  # Telegram keeps it for whoever polls next
        return ["sent while nobody polled"]

    async def say(self, text: str) -> None:
        self.fake.push_message(int(self.home), int(self.admin), text)

    async def press(self, ref: CardRef, data: str) -> None:
        query = self.fake.push_callback(int(ref.chat), ref.message_id, int(self.admin), data)
        await self.fake.wait_for_answer(query, timeout=WAIT)

    def buttons(self, ref: CardRef) -> list[Any]:
        return self.fake.message(int(ref.chat), ref.message_id).buttons

    def texts(self) -> list[str]:
        return [m.text for m in self.fake.messages(int(self.home))]


class DiscordRig(Rig):
    platform, home, admin = "discord", str(HOME_CHANNEL_ID), str(ALICE_ID)

    async def open(self) -> None:
        self.saved = (discord.http.Route.BASE, discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY)
        self.fake = FakeDiscord()
        await self.fake.start()

    async def close(self) -> None:
        await self.fake.stop()
        discord.http.Route.BASE, discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY = self.saved

    def adapter(self) -> PlatformBase:
        config = DiscordConfig(
            token=self.fake.token,
            api_base_url=self.fake.api_base,
            gateway_url=self.fake.gateway_url,
            channels=[HOME_CHANNEL_ID],
            home_channel=HOME_CHANNEL_ID,
            admins=[ALICE_ID],
        )
        return DiscordAdapter(config, guild_ready_timeout=0.05, request_timeout=5.0)

    def ingress_connections(self) -> int:
        return len(self.fake.identifies)

    async def closed(self, adapter: PlatformBase) -> list[str]:
        await self.fake.wait_until(lambda: not self.fake.identified, timeout=WAIT)
        return []

    async def say(self, text: str) -> None:
        await self.fake.user_message(HOME_CHANNEL_ID, text, author=self.fake.alice)

    async def press(self, ref: CardRef, data: str) -> None:
        await self.fake.press_button(int(ref.message_id), data, user=self.fake.alice)

    def buttons(self, ref: CardRef) -> list[Any]:
        return list(self.fake.messages[int(ref.message_id)].get("components") or [])

    def texts(self) -> list[str]:
        return [str(m.get("content") or "") for m in self.fake.channel_messages(HOME_CHANNEL_ID)]


class SlackRig(Rig):
    platform, home, admin = "slack", "CHOME0001", "UADMIN001"

    async def open(self) -> None:
        self.fake = FakeSlack()
        await self.fake.start()

    async def close(self) -> None:
        await self.fake.stop()

    def adapter(self) -> PlatformBase:
        config = SlackConfig(
            bot_token=self.fake.bot_token,
            app_token=self.fake.app_token,  # Socket Mode
            api_base_url=self.fake.api_url,
            channels=[self.home],
            home_channel=self.home,
            admins=[self.admin],
        )
        return SlackAdapter(config, limiter=ChatRateLimiter(min_interval=0), request_timeout=5)

    def ingress_connections(self) -> int:
        return len(self.fake.calls_to("apps.connections.open"))

    async def closed(self, adapter: PlatformBase) -> list[str]:
        await self.fake.wait_for(lambda: not self.fake.socket_connected, timeout=WAIT)
        return []

    async def say(self, text: str) -> None:
        event = self.fake.message_event(channel=self.home, user=self.admin, text=text)
        await self.fake.socket_send("events_api", self.fake.event_envelope(event))

    async def press(self, ref: CardRef, data: str) -> None:
        payload = self.fake.block_action_payload(
            action_id=APPROVE_ACTION, value=data, user=self.admin, channel=ref.chat, message_ts=ref.message_id
        )
        await self.fake.socket_send("interactive", payload)

    def buttons(self, ref: CardRef) -> list[Any]:
        block = self.fake.message(ref.chat, ref.message_id).block("kazma_actions")
        return [] if block is None else list(block["elements"])

    def texts(self) -> list[str]:
        return [m.text for m in self.fake.channel(self.home)]


def started(adapter: PlatformBase) -> bool:
    return adapter.started


def receiving(adapter: PlatformBase) -> bool:
    """``ingress_running`` read afresh (a call, so the type checker does not carry one reading over an await)."""
    return adapter.ingress_running


RIGS: dict[str, type[Rig]] = {r.platform: r for r in (TelegramRig, DiscordRig, SlackRig)}


@pytest.fixture(params=sorted(RIGS))
async def rig(request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    made = RIGS[request.param]()
    await made.open()
    try:
        yield made
    finally:
        await made.close()


async def test_a_follower_sends_without_the_ingress_and_takes_it_when_it_leads(rig: Rig) -> None:
    replica = Replica(rig.platform)
    adapter = rig.adapter()
    assert isinstance(adapter, SingletonIngress)
    assert singleton_ingress(adapter) is adapter
    await adapter.start(replica.handlers(), ingress=False)
    try:
        assert adapter.started
        assert not receiving(adapter)
        # A follower: cards posted and settled, text sent, and the platform never saw it take the ingress.
        card = make_card(f"{rig.platform}:{rig.home}")
        ref = await adapter.post_card(card)
        assert rig.buttons(ref)
        await adapter.send_text(rig.home, "posted by a follower", agent="builder")
        await adapter.settle_card(ref, card, approved(card, f"{rig.platform}:{rig.admin}"))
        assert rig.buttons(ref) == []
        assert any("posted by a follower" in text for text in rig.texts())
        assert rig.ingress_connections() == 0

        # It becomes the leader: messages and presses arrive.
        await adapter.start_ingress()
        await adapter.start_ingress()  # already open: nothing more is opened
        assert receiving(adapter)
        assert rig.ingress_connections() == 1
        await rig.say("hello leader")
        await replica.wait_until(lambda: "hello leader" in replica.texts())
        second = make_card(f"{rig.platform}:{rig.home}")
        second_ref = await adapter.post_card(second)
        await rig.press(second_ref, second.button_data(Decision.APPROVE))
        await replica.wait_until(lambda: replica.presses)
        assert [p.data for p in replica.presses] == [second.button_data(Decision.APPROVE)]

        # It loses the lease: the ingress closes, sending and editing go on.
        await adapter.stop_ingress()
        await adapter.stop_ingress()  # already closed: a no-op
        assert adapter.started
        assert not receiving(adapter)
        later = await rig.closed(adapter)
        await adapter.settle_card(second_ref, second, approved(second, f"{rig.platform}:{rig.admin}"))
        assert rig.buttons(second_ref) == []
        await adapter.send_text(rig.home, "still sending without the ingress")
        assert any("still sending without the ingress" in text for text in rig.texts())

        # And leads again.
        await adapter.start_ingress()
        assert receiving(adapter)
        assert rig.ingress_connections() == 2
        await rig.say("leading again")
        expected = ["hello leader", *later, "leading again"]
        await replica.wait_until(lambda: len(replica.texts()) >= len(expected))
        await adapter.quiesce()
        assert sorted(replica.texts()) == sorted(expected)  # each once
    finally:
        await adapter.stop()
    assert not started(adapter)
    assert not receiving(adapter)


async def test_start_ingress_on_an_adapter_that_is_not_started_is_refused(rig: Rig) -> None:
    adapter = rig.adapter()
    with pytest.raises(Exception, match="not started"):
        await adapter.start_ingress()
    assert not receiving(adapter)
    await adapter.stop_ingress()  # nothing to close: a no-op
    assert rig.ingress_connections() == 0


async def test_stop_closes_an_open_ingress(rig: Rig) -> None:
    replica = Replica(rig.platform)
    adapter = rig.adapter()
    await adapter.start(replica.handlers())  # the default: the ingress opens with the adapter, as before
    assert receiving(adapter)
    assert rig.ingress_connections() == 1
    await adapter.stop()
    assert not receiving(adapter)
    if rig.platform != "telegram":  # Telegram's poller is gone with the adapter; nothing to ask the fake
        await rig.closed(adapter)


async def test_a_discord_follower_posts_as_the_agent_through_the_channel_webhook() -> None:
    rig = DiscordRig()
    await rig.open()
    adapter = rig.adapter()
    try:
        await adapter.start(Replica("discord").handlers(), ingress=False)
        await adapter.send_text(rig.home, "found it", agent="researcher")
        message = next(m for m in rig.fake.channel_messages(HOME_CHANNEL_ID) if m.get("content") == "found it")
        # No gateway cache: the channel and its webhook came over REST, so the agent keeps its name.
        assert message["author"]["username"] == "researcher"
        assert message.get("webhook_id")
        assert rig.ingress_connections() == 0
    finally:
        await adapter.stop()
        await rig.close()


async def test_http_ingress_is_not_singleton_and_runs_on_every_replica() -> None:
    fake = FakeSlack()
    await fake.start()
    config = SlackConfig(
        bot_token=fake.bot_token,
        signing_secret=fake.signing_secret,
        api_base_url=fake.api_url,
        http=SlackHttpConfig(host="127.0.0.1", port=free_port(), path="/slack/events"),
        channels=["CHOME0001"],
        home_channel="CHOME0001",
        admins=["UADMIN001"],
    )
    adapter = SlackAdapter(config, limiter=ChatRateLimiter(min_interval=0), request_timeout=5)
    replica = Replica("slack")
    try:
        assert not adapter.has_singleton_ingress
        assert singleton_ingress(adapter) is None
        await adapter.start(replica.handlers(), ingress=False)  # a follower serves HTTP events all the same
        assert receiving(adapter)
        assert adapter.events_url is not None
        await adapter.stop_ingress()  # nothing singleton to close
        assert receiving(adapter)
        event = fake.message_event(channel="CHOME0001", user="UADMIN001", text="over HTTP")
        assert (await fake.post_event(adapter.events_url, event)).status == 200
        await replica.wait_until(lambda: replica.texts() == ["over HTTP"])
    finally:
        await adapter.stop()
        await fake.stop()

    webhook = TelegramConfig(
        token="1:x",
        mode="webhook",
        webhook=TelegramWebhookConfig(url="https://kazma.example/telegram", secret_token="s3cret-token"),
    )
    assert singleton_ingress(TelegramAdapter(webhook)) is None
    assert singleton_ingress(TelegramAdapter(TelegramConfig(token="1:x"))) is not None
    assert singleton_ingress(WebAdapter()) is None
    assert singleton_ingress(TerminalAdapter(interactive=False)) is None


def confirming(call: FakeCall) -> bool:
    """PTB's last poll on the way out: no long poll, only the offset that confirms what it took."""
    return call.status == 200 and float(call.params.get("timeout") or 0) == 0


@pytest.mark.parametrize("grace", [5.0, 0.2])
async def test_stop_ingress_lets_what_was_taken_finish_and_never_cancels_it(grace: float) -> None:
    """A Telegram update taken before the poller stopped is confirmed to Telegram, so it is this replica's to
    finish: stop_ingress waits for it (up to the grace) and, past the grace, leaves it running."""
    rig = TelegramRig()
    await rig.open()
    entered, release = asyncio.Event(), asyncio.Event()
    finished: list[str] = []

    async def slow(inbound: Inbound) -> None:
        entered.set()
        await release.wait()
        finished.append(inbound.text)

    adapter = TelegramAdapter(
        TelegramConfig(token=rig.fake.token, api_base_url=rig.fake.base_url, chats=[GROUP], home_chat=GROUP),
        poll_timeout=1.0,
        request_timeout=5.0,
        stop_grace=grace,
    )
    await adapter.start(Handlers(on_inbound=slow, on_press=Replica("a").on_press))
    try:
        rig.fake.push_message(GROUP, 111, "taken before the stop")
        await asyncio.wait_for(entered.wait(), WAIT)
        stopping = asyncio.create_task(adapter.stop_ingress())
        if grace > 1:
            # The poller is closed and its last poll confirmed the update, yet stop_ingress waits for the work.
            await rig.fake.wait_until(lambda: any(confirming(c) for c in rig.fake.calls_to("getUpdates")))
            assert rig.fake.pending_updates == 0
            assert not receiving(adapter)
            assert not stopping.done()
            release.set()
            await asyncio.wait_for(stopping, WAIT)
        else:
            await asyncio.wait_for(stopping, WAIT)  # the grace ran out: it returns with the work still going
            assert finished == []
            release.set()
            await asyncio.wait_for(adapter.quiesce(), WAIT)
        assert finished == ["taken before the stop"]
        assert rig.fake.pending_updates == 0
    finally:
        release.set()
        await adapter.stop()
        await rig.close()
