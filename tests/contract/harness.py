"""One harness per platform: the real adapter on its real library, against that platform's wire-level fake.

The contract suite speaks only this interface — a person says something in a
chat, a card is read as a person would see it, a button is pressed, a private
notice is read back, the platform is made to answer 429 or 500 — so every case
runs unchanged on Telegram, Slack and Discord. A new platform joins the suite
by adding a harness here.
"""

from __future__ import annotations

import asyncio
import html
import re
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, TypeVar

import discord

from kazma.adapters.contract import CardRef, Handlers, Inbound, Press
from kazma.adapters.discord import DiscordAdapter
from kazma.adapters.discord.render import ZWSP
from kazma.adapters.kit import PlatformBase
from kazma.adapters.matrix import MatrixAdapter
from kazma.adapters.matrix.render import CHOICES_KEY as MATRIX_CHOICES
from kazma.adapters.matrix.render import TEXT_LIMIT as MATRIX_TEXT_LIMIT
from kazma.adapters.matrix.render import json_units
from kazma.adapters.pacing import ChatRateLimiter
from kazma.adapters.slack import SlackAdapter
from kazma.adapters.slack.render import APPROVE_ACTION, DENY_ACTION
from kazma.adapters.telegram import TelegramAdapter
from kazma.adapters.telegram.render import utf16_units
from kazma.approvals.card import ApprovalCard, build_card
from kazma.approvals.hashing import args_hash, canonical_json
from kazma.approvals.model import ApprovalRequest, Outcome, PressResult, PressVerdict, Status
from kazma.config.models import DiscordConfig, MatrixConfig, SlackConfig, SlackHttpConfig, TelegramConfig
from kazma.engine.conversation import QUESTION_PREFIX
from tests.fakes.discord import (
    ALICE_ID,
    BOB_ID,
    EPHEMERAL,
    HOME_CHANNEL_ID,
    OTHER_CHANNEL_ID,
    UNSERVED_CHANNEL_ID,
    FakeDiscord,
    FakeInteraction,
    FakeUser,
)
from tests.fakes.slack import FakeSlack
from tests.fakes.telegram import FakeTelegram, Fault
from tests.matrix_support import FaultProxy, shared_synapse

T = TypeVar("T")
WAIT = 10.0
Site = Literal["send", "card_post"]
FaultKind = Literal["429", "500"]


class Recorder:
    """The handlers the composition root would inject, recording what reaches them."""

    def __init__(self) -> None:
        self.inbound: list[Inbound] = []
        self.presses: list[Press] = []
        self.result: PressResult | Exception = PressResult(PressVerdict.WON, "Approved. Recorded.", request_id="r")
        self.hold: asyncio.Event | None = None  # when set, presses wait for it
        self.finished = 0
        self.deciders: set[str] | None = None  # whose press would count (None: everyone's), for may_decide
        self.outcomes: dict[str, str] = {}  # requests decided already: id -> how a press is told, for decided
        self._changed = asyncio.Condition()

    async def on_inbound(self, inbound: Inbound) -> None:
        self.inbound.append(inbound)
        await self._notify()

    async def on_press(self, press: Press) -> PressResult:
        self.presses.append(press)
        await self._notify()
        try:
            if self.hold is not None:
                await self.hold.wait()
            if isinstance(self.result, Exception):
                raise self.result
            return self.result
        finally:
            self.finished += 1
            await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def may_decide(self, actor: str, platform: str, request_id: str) -> bool:
        return self.deciders is None or actor in self.deciders

    async def decided(self, request_id: str) -> str | None:
        return self.outcomes.get(request_id)

    def handlers(self) -> Handlers:
        return Handlers(
            on_inbound=self.on_inbound, on_press=self.on_press, may_decide=self.may_decide, decided=self.decided
        )

    async def wait_until(self, predicate: Callable[[], T], timeout: float = WAIT) -> T:
        async with asyncio.timeout(timeout), self._changed:
            while not (value := predicate()):
                await self._changed.wait()
            return value


def make_card(
    args: dict[str, Any], *, value_limit: int = 500, tool: str = "shell", requester: str = "agent:builder"
) -> ApprovalCard:
    now = datetime.now(UTC)
    request = ApprovalRequest(
        id="Rq7xK2mP9vL4nB8cT1wZ5aY3",
        tool=tool,
        args=args,
        args_json=canonical_json(args),
        args_hash=args_hash(args),
        requested_by=requester,
        conversation="telegram:-1001",
        created_at=now,
        deadline=now + timedelta(minutes=10),
        status=Status.PENDING,
    )
    return build_card(request, value_limit=value_limit, public_url="http://127.0.0.1:8765")


def outcome_of(card: ApprovalCard, status: Status = Status.APPROVED, by: str = "telegram:111") -> Outcome:
    return Outcome(
        request_id=card.request_id,
        status=status,
        decided_by=by if status.human else None,
        decided_via=by.partition(":")[0] if status.human else None,
        decided_at=datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC),
    )


@dataclass
class WireCard:
    """A posted card as a person sees it."""

    text: str  # every visible piece of text, markup resolved
    buttons: list[str]  # button labels, in order
    data: list[str] = field(default_factory=list)  # button data, in order


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Harness(ABC):
    platform: str
    home: str
    other: str  # a second served chat
    unserved: str
    admin: str  # user ids, as the platform writes them
    member: str
    text_limit: int  # what one message may hold, measured by ``units``
    units: Callable[[str], int] = staticmethod(lambda _char: 1)

    def __init__(self) -> None:
        self.recorder = Recorder()
        self._adapter: PlatformBase | None = None

    @property
    def adapter(self) -> PlatformBase:
        assert self._adapter is not None, "start the harness first"
        return self._adapter

    @abstractmethod
    async def open(self) -> None:
        """Start the fake."""

    @abstractmethod
    async def close(self) -> None:
        """Stop the adapter (if running) and the fake."""

    @abstractmethod
    async def start(self, *, chats: list[Any] | None = None, **options: Any) -> PlatformBase:
        """Start the adapter serving ``chats`` (default: home and other) with the recorder's handlers."""

    @abstractmethod
    async def say(self, chat: str, user: str, text: str) -> None:
        """A person writes ``text`` in ``chat``."""

    @abstractmethod
    async def command(self, chat: str, user: str, name: str, args: str = "") -> None:
        """``user`` runs the platform's ``/name`` command (``swarm``, ``plan``) with ``args`` in ``chat``."""

    @abstractmethod
    def bot_texts(self, chat: str) -> list[str]:
        """What the bot posted in ``chat`` (text messages, not cards), in order, as a person reads it."""

    def sender_names(self, chat: str) -> list[str | None]:
        """For each bot text in ``chat``: the name it was posted under when the platform shows one."""
        return [None for _ in self.bot_texts(chat)]

    @abstractmethod
    def card(self, ref: CardRef) -> WireCard: ...

    @abstractmethod
    async def press(self, ref: CardRef, data: str, user: str) -> None:
        """``user`` presses the button carrying ``data`` on the card at ``ref``."""

    @abstractmethod
    def notices(self, user: str) -> list[str]:
        """Private, prominent notices the presser ``user`` has been shown so far."""

    @abstractmethod
    def fault(self, site: Site, kind: FaultKind, *, times: int = 1, retry_after: int = 1) -> None:
        """The platform answers the next ``times`` calls of ``site`` with ``kind``."""

    @abstractmethod
    def attempts(self, site: Site) -> int:
        """How many calls of ``site`` reached the platform."""

    # -- daily use: direct messages, files, the working sign ------------------------------------------

    @abstractmethod
    async def say_direct(self, user: str, text: str) -> str:
        """``user`` writes ``text`` to the bot in a direct message; the DM's chat id."""

    @abstractmethod
    async def send_files(self, chat: str, user: str, text: str, files: list[tuple[str, bytes, int | None]]) -> None:
        """``user`` sends ``(name, content, declared size or None)`` files with ``text`` into ``chat``."""

    @abstractmethod
    def files_posted(self, chat: str) -> list[tuple[str, bytes, str]]:
        """Files the bot posted in ``chat``: (name, content, the caption or comment shown with it)."""

    @abstractmethod
    def working_signs(self, chat: str) -> int | None:
        """How many "working" signs the platform was asked to show in ``chat`` (None: it has none)."""

    async def wait_for_notices(self, user: str, count: int) -> list[str]:
        async with asyncio.timeout(WAIT):
            while len(found := self.notices(user)) < count:
                await asyncio.sleep(0.01)  # polled: the fakes keep notices in plain lists
        return found

    async def settled(self) -> None:
        """Every press and delivery the adapter accepted has finished."""
        await self.adapter.quiesce()


# --------------------------------------------------------------------------- Telegram


class TelegramHarness(Harness):
    platform = "telegram"
    home, other, unserved = "-1001234567890", "-1001234567891", "-1009876543210"
    admin, member = "111", "222"
    text_limit = 4096
    units = staticmethod(utf16_units)

    async def open(self) -> None:
        self.fake = FakeTelegram()
        await self.fake.start()
        self.queries: dict[str, list[str]] = {}

    async def close(self) -> None:
        if self._adapter is not None:
            await self._adapter.stop()
        await self.fake.stop()

    async def start(self, *, chats: list[Any] | None = None, **options: Any) -> PlatformBase:
        config = TelegramConfig(
            token=self.fake.token,
            api_base_url=self.fake.base_url,
            chats=[int(self.home), int(self.other)] if chats is None else chats,
            home_chat=int(self.home),
            admins=[int(self.admin)],
        )
        options.setdefault("poll_timeout", 1.0)
        options.setdefault("request_timeout", 5.0)
        options.setdefault("limiter", ChatRateLimiter(min_interval=0.0))
        adapter = TelegramAdapter(config, **options)
        await adapter.start(self.recorder.handlers())
        self._adapter = adapter
        return adapter

    async def say(self, chat: str, user: str, text: str) -> None:
        self.fake.push_message(int(chat), int(user), text)

    async def command(self, chat: str, user: str, name: str, args: str = "") -> None:
        self.fake.push_message(int(chat), int(user), f"/{name} {args}".rstrip())  # Telegram marks the /command

    def bot_texts(self, chat: str) -> list[str]:
        return [m.text for m in self.fake.bot_messages(int(chat)) if not m.buttons and "Arguments (" not in m.text]

    def card(self, ref: CardRef) -> WireCard:
        message = self.fake.message(int(ref.chat), ref.message_id)
        return WireCard(
            message.text, [b["text"] for b in message.buttons], [str(b["callback_data"]) for b in message.buttons]
        )

    async def press(self, ref: CardRef, data: str, user: str) -> None:
        query = self.fake.push_callback(int(ref.chat), ref.message_id, int(user), data)
        self.queries.setdefault(user, []).append(query)
        await self.fake.wait_for_answer(query, timeout=WAIT)  # Telegram needs every press answered

    def notices(self, user: str) -> list[str]:
        answers = [self.fake.callback_answers.get(q) for q in self.queries.get(user, [])]
        return [str(a["text"]) for a in answers if a is not None and a.get("show_alert")]

    async def say_direct(self, user: str, text: str) -> str:
        self.fake.push_message(int(user), int(user), text)  # a private chat's id is the person's id
        return user

    async def send_files(self, chat: str, user: str, text: str, files: list[tuple[str, bytes, int | None]]) -> None:
        # Telegram carries one file per message: an album would be several messages, not one with many files.
        for name, content, declared in files:
            self.fake.push_file(int(chat), int(user), name, content, caption=text, declared_size=declared)

    def files_posted(self, chat: str) -> list[tuple[str, bytes, str]]:
        return [
            (str(m.document["file_name"]), data, m.text) for m, data in self.fake.documents(int(chat)) if m.document
        ]

    def working_signs(self, chat: str) -> int | None:
        return sum(1 for a in self.fake.chat_actions if a["chat_id"] == int(chat) and a["action"] == "typing")

    def fault(self, site: Site, kind: FaultKind, *, times: int = 1, retry_after: int = 1) -> None:
        made = Fault.too_many_requests(retry_after) if kind == "429" else Fault.server_error(500)
        self.fake.script("sendMessage", *[made] * times)

    def attempts(self, site: Site) -> int:
        return len(self.fake.calls_to("sendMessage"))


# --------------------------------------------------------------------------- Slack


def _slack_visible(text: str) -> str:
    """What Slack shows for mrkdwn we wrote: entities resolved, our own <url|label> links as their label."""
    text = re.sub(r"<(https?://[^|>]+)\|([^>]*)>", r"\2", text)
    return text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&").replace("\u200b", "")


class SlackHarness(Harness):
    platform = "slack"
    home, other, unserved = "CHOME0001", "CWORK0002", "CELSE0003"
    admin, member = "UADMIN001", "UPERSON01"
    text_limit = 3900

    @staticmethod
    def units(char: str) -> int:
        return len(char.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;"))

    async def open(self) -> None:
        self.fake = FakeSlack()
        await self.fake.start()

    async def close(self) -> None:
        if self._adapter is not None:
            await self._adapter.stop()
        await self.fake.stop()

    async def start(self, *, chats: list[Any] | None = None, **options: Any) -> PlatformBase:
        config = SlackConfig(
            bot_token=self.fake.bot_token,
            signing_secret=self.fake.signing_secret,
            api_base_url=self.fake.api_url,
            http=SlackHttpConfig(host="127.0.0.1", port=free_port(), path="/slack/events"),
            channels=[self.home, self.other] if chats is None else chats,
            home_channel=self.home,
            admins=[self.admin],
        )
        options.setdefault("limiter", ChatRateLimiter(min_interval=0.0))
        options.setdefault("request_timeout", 5)
        adapter = SlackAdapter(config, **options)
        await adapter.start(self.recorder.handlers())
        self._adapter = adapter
        return adapter

    @property
    def events_url(self) -> str:
        assert isinstance(self._adapter, SlackAdapter)
        url = self._adapter.events_url
        assert url is not None
        return url

    async def say(self, chat: str, user: str, text: str) -> None:
        raw = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        response = await self.fake.post_event(
            self.events_url, self.fake.message_event(channel=chat, user=user, text=raw)
        )
        assert response.status == 200, response.body

    async def command(self, chat: str, user: str, name: str, args: str = "") -> None:
        response = await self.fake.post_command(self.events_url, text=args, channel=chat, user=user, command=f"/{name}")
        assert response.status == 200, response.body

    def bot_texts(self, chat: str) -> list[str]:
        return [_slack_visible(m.text) for m in self.fake.channel(chat) if m.bot_id and not m.blocks]

    def sender_names(self, chat: str) -> list[str | None]:
        return [m.username for m in self.fake.channel(chat) if m.bot_id and not m.blocks]

    def card(self, ref: CardRef) -> WireCard:
        message = self.fake.message(ref.chat, ref.message_id)
        buttons = [e for b in message.blocks if b.get("type") == "actions" for e in b["elements"]]
        shown = [t for t in message.texts()[1:]]  # the blocks, not the notification fallback
        return WireCard(
            _slack_visible("\n".join(shown)),
            [str(b["text"]["text"]) for b in buttons],
            [str(b["value"]) for b in buttons],
        )

    async def press(self, ref: CardRef, data: str, user: str) -> None:
        if data.startswith(f"{QUESTION_PREFIX}:"):  # a question's choice: its own action id, as Slack sends it
            action = f"kazma_choice_{data.rsplit(':', 1)[1]}"
        else:
            action = APPROVE_ACTION if data.endswith(":a") else DENY_ACTION
        response = await self.fake.post_block_action(
            self.events_url, action_id=action, value=data, user=user, channel=ref.chat, message_ts=ref.message_id
        )
        assert response.status == 200, response.body

    def notices(self, user: str) -> list[str]:
        return [_slack_visible(e.text) for e in self.fake.ephemerals if e.user == user]

    async def say_direct(self, user: str, text: str) -> str:
        chat = "D" + user[1:]  # the app's DM with that person (message.im events, channel_type "im")
        event = self.fake.message_event(channel=chat, user=user, text=text)
        event["channel_type"] = "im"
        response = await self.fake.post_event(self.events_url, event)
        assert response.status == 200, response.body
        return chat

    async def send_files(self, chat: str, user: str, text: str, files: list[tuple[str, bytes, int | None]]) -> None:
        shared = [self.fake.add_file(name, content, declared_size=declared) for name, content, declared in files]
        event = self.fake.file_event(channel=chat, user=user, text=text, files=shared)
        response = await self.fake.post_event(self.events_url, event)
        assert response.status == 200, response.body

    def files_posted(self, chat: str) -> list[tuple[str, bytes, str]]:
        return [(str(m.files[0]["name"]), data, _slack_visible(m.text)) for m, data in self.fake.shared_files(chat)]

    def working_signs(self, chat: str) -> int | None:
        return None  # Slack's Web API has no typing indicator for apps

    def fault(self, site: Site, kind: FaultKind, *, times: int = 1, retry_after: int = 1) -> None:
        self.fake.fail("chat.postMessage", kind, times=times, retry_after=retry_after)

    def attempts(self, site: Site) -> int:
        return len(self.fake.calls_to("chat.postMessage"))


# --------------------------------------------------------------------------- Discord


def _discord_visible(value: str) -> str:
    """What a reader sees: markdown escapes resolved, zero-width spaces invisible."""
    parts = value.split("```")
    for index in range(0, len(parts), 2):  # outside code fences: our own bold/italics go, escapes resolve
        parts[index] = re.sub(r"\\(.)", r"\1", re.sub(r"(?<!\\)\*", "", parts[index]))
    return "```".join(parts).replace(ZWSP, "")


class DiscordHarness(Harness):
    platform = "discord"
    home, other, unserved = str(HOME_CHANNEL_ID), str(OTHER_CHANNEL_ID), str(UNSERVED_CHANNEL_ID)
    admin, member = str(ALICE_ID), str(BOB_ID)
    text_limit = 2000

    async def open(self) -> None:
        self.saved = (discord.http.Route.BASE, discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY)
        self.fake = FakeDiscord(manage_webhooks=False)
        await self.fake.start()
        self.interactions: dict[str, list[FakeInteraction]] = {}

    async def close(self) -> None:
        if self._adapter is not None:
            await self._adapter.stop()
        await self.fake.stop()
        discord.http.Route.BASE, discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY = self.saved

    async def start(self, *, chats: list[Any] | None = None, **options: Any) -> PlatformBase:
        config = DiscordConfig(
            token=self.fake.token,
            api_base_url=self.fake.api_base,
            gateway_url=self.fake.gateway_url,
            channels=[int(self.home), int(self.other)] if chats is None else chats,
            home_channel=int(self.home),
            admins=[int(self.admin)],
        )
        options.setdefault("guild_ready_timeout", 0.05)
        options.setdefault("request_timeout", 5.0)
        adapter = DiscordAdapter(config, **options)
        await adapter.start(self.recorder.handlers())
        self._adapter = adapter
        return adapter

    def _user(self, user: str) -> FakeUser:
        return self.fake.users.get(int(user)) or FakeUser(int(user), f"user{user}")

    async def say(self, chat: str, user: str, text: str) -> None:
        await self.fake.user_message(int(chat), text, author=self._user(user))

    async def command(self, chat: str, user: str, name: str, args: str = "") -> None:
        options = {"args": args} if args else None
        await self.fake.slash_command(int(chat), user=self._user(user), name=name, options=options)

    def bot_texts(self, chat: str) -> list[str]:
        return [
            _discord_visible(str(m["content"]))
            for m in self.fake.channel_messages(int(chat))
            if m["author"]["id"] == str(self.fake.bot.id) and not m.get("embeds") and m.get("content")
        ]

    def card(self, ref: CardRef) -> WireCard:
        message = self.fake.messages[int(ref.message_id)]
        parts: list[str] = []
        for embed in message.get("embeds", []):
            parts += [str(embed.get("title", "")), str(embed.get("description", ""))]
            parts += [f"{f.get('name', '')}\n{f.get('value', '')}" for f in embed.get("fields", [])]
        buttons = [c for row in message.get("components", []) for c in row["components"]]
        return WireCard(
            _discord_visible("\n".join(parts)),
            [str(b["label"]) for b in buttons],
            [str(b["custom_id"]) for b in buttons],
        )

    async def press(self, ref: CardRef, data: str, user: str) -> None:
        interaction = await self.fake.press_button(int(ref.message_id), data, user=self._user(user))
        self.interactions.setdefault(user, []).append(interaction)

    def notices(self, user: str) -> list[str]:
        found = []
        for interaction in self.interactions.get(user, []):
            for message_id in interaction.followup_ids:
                message = self.fake.messages[message_id]
                if int(message["flags"]) & EPHEMERAL:
                    found.append(_discord_visible(str(message["content"])))
        return found

    async def say_direct(self, user: str, text: str) -> str:
        message = await self.fake.direct_message(self._user(user), text)
        return str(message["channel_id"])

    async def send_files(self, chat: str, user: str, text: str, files: list[tuple[str, bytes, int | None]]) -> None:
        made = [self.fake.attachment(int(chat), name, content, declared_size=d) for name, content, d in files]
        await self.fake.user_message_with_files(int(chat), text, made, author=self._user(user))

    def files_posted(self, chat: str) -> list[tuple[str, bytes, str]]:
        found = []
        for message in self.fake.channel_messages(int(chat)):
            if message["author"]["id"] != str(self.fake.bot.id):
                continue
            for attachment in message.get("attachments", []):
                content = self.fake.attachments[int(attachment["id"])]
                found.append((str(attachment["filename"]), content, _discord_visible(str(message["content"]))))
        return found

    def working_signs(self, chat: str) -> int | None:
        return sum(1 for channel, _ in self.fake.typing if channel == int(chat))

    def fault(self, site: Site, kind: FaultKind, *, times: int = 1, retry_after: int = 1) -> None:
        self.fake.inject_fault("POST", r"/channels/\d+/messages", kind, times=times, retry_after=retry_after)

    def attempts(self, site: Site) -> int:
        return len(self.fake.calls_to("POST", r"/channels/\d+/messages"))


# --------------------------------------------------------------------------- Matrix


def _matrix_visible(formatted: str) -> str:
    """What a Matrix client shows for our HTML: tags gone, entities resolved (line breaks are in the source)."""
    return html.unescape(re.sub(r"<[^>]+>", "", formatted))


@dataclass
class _MatrixRooms:
    """One set of rooms per test process: made once (a room takes Synapse a second), read per test from a
    position taken when the test opens, so no test sees another's messages."""

    home: str
    other: str
    unserved: str
    direct: dict[str, str]  # person -> their direct room with the bot


_MATRIX_ROOMS: dict[int, _MatrixRooms] = {}


class MatrixHarness(Harness):
    """The real adapter on mautrix against a real Synapse (tests/matrix_support.py), through a proxy that only
    injects the faults a test asks for. People act through the client-server API as any client does."""

    platform = "matrix"
    text_limit = MATRIX_TEXT_LIMIT
    units = staticmethod(json_units)

    async def open(self) -> None:
        self.server = shared_synapse()
        self.bot = self.server.session(self.server.register("kazma"))
        self.people = {p.user_id: p for p in (self.server.register("alice"), self.server.register("bob"))}
        self.admin, self.member = list(self.people)
        rooms = _MATRIX_ROOMS.get(id(self.server))
        if rooms is None:
            rooms = await asyncio.to_thread(self._make_rooms)
            _MATRIX_ROOMS[id(self.server)] = rooms
        self.home, self.other, self.unserved = rooms.home, rooms.other, rooms.unserved
        self.direct = rooms.direct
        # A fresh start for the adapter (no kept sync position) and for what this test reads.
        await asyncio.to_thread(self.bot.set_account_data, "org.kazma.sync", {})
        self.since = await asyncio.to_thread(self._positions)
        self.proxy = FaultProxy(self.server.url)
        await self.proxy.start()

    def _positions(self) -> dict[str, str]:
        """Where each room's timeline is now, as a token reading on from it."""
        where = {room: self.people[self.admin] for room in (self.home, self.other, self.unserved)}
        where.update({room: self.people[user] for user, room in self.direct.items()})
        return {room: reader.now(room) for room, reader in where.items()}

    def _make_rooms(self) -> _MatrixRooms:
        alice, bob = self.people[self.admin], self.people[self.member]
        made = []
        for name in ("home", "other", "unserved"):
            room = alice.create_room(invite=[self.bot.user_id, bob.user_id], name=name)
            self.bot.join(room)
            bob.join(room)
            made.append(room)
        direct = {}
        for person in (alice, bob):
            room = person.create_room(invite=[self.bot.user_id], direct=True)
            self.bot.join(room)
            direct[person.user_id] = room
        # What the bot's account keeps about its direct rooms, as a client accepting those invites writes it.
        self.bot.set_account_data("m.direct", {user: [room] for user, room in direct.items()})
        home, other, unserved = made
        return _MatrixRooms(home, other, unserved, direct)

    async def close(self) -> None:
        if self._adapter is not None:
            await self._adapter.stop()
        await self.proxy.stop()

    async def start(self, *, chats: list[Any] | None = None, **options: Any) -> PlatformBase:
        config = MatrixConfig(
            homeserver=self.proxy.url,
            user_id=self.bot.user_id,
            access_token=self.bot.token,
            rooms=[self.home, self.other] if chats is None else chats,
            home_room=self.home,
            admins=[self.admin],
        )
        options.setdefault("limiter", ChatRateLimiter(min_interval=0.0))
        options.setdefault("poll_timeout", 5.0)
        adapter = MatrixAdapter(config, **options)
        await adapter.start(self.recorder.handlers())
        self._adapter = adapter
        return adapter

    async def say(self, chat: str, user: str, text: str) -> None:
        await asyncio.to_thread(self.people[user].say, chat, text)

    async def command(self, chat: str, user: str, name: str, args: str = "") -> None:
        await self.say(chat, user, f"/{name} {args}".rstrip())  # commands are text on Matrix

    def _bot_events(self, chat: str) -> list[dict[str, Any]]:
        reader = self.people[self.admin] if chat != self.direct.get(self.member) else self.people[self.member]
        events = reader.messages(chat, self.since[chat])
        return [e for e in events if e.get("sender") == self.bot.user_id and e.get("type") == "m.room.message"]

    def bot_texts(self, chat: str) -> list[str]:
        return [
            str(e["content"]["body"])
            for e in self._bot_events(chat)
            if e["content"].get("msgtype") == "m.text"
            and MATRIX_CHOICES not in e["content"]
            and "m.new_content" not in e["content"]
        ]

    def card(self, ref: CardRef) -> WireCard:
        content = self.people[self.admin].shown(ref.chat, ref.message_id)
        choices = content.get(MATRIX_CHOICES, [])
        text = _matrix_visible(str(content.get("formatted_body", content.get("body", ""))))
        return WireCard(text, [str(c["label"]) for c in choices], [str(c["data"]) for c in choices])

    async def press(self, ref: CardRef, data: str, user: str) -> None:
        original = await asyncio.to_thread(self.people[self.admin].event, ref.chat, ref.message_id)
        [key] = [c["key"] for c in original["content"][MATRIX_CHOICES] if c["data"] == data]
        await asyncio.to_thread(self.people[user].react, ref.chat, ref.message_id, key)

    def notices(self, user: str) -> list[str]:
        found = []
        for chat in (self.home, self.other):
            for event in self._bot_events(chat):
                content = event["content"]
                if content.get("msgtype") == "m.notice" and content.get("m.mentions", {}).get("user_ids") == [user]:
                    found.append(str(content["body"]).removeprefix(f"{user}: "))
        return found

    async def say_direct(self, user: str, text: str) -> str:
        room = self.direct[user]
        await self.say(room, user, text)
        return room

    async def send_files(self, chat: str, user: str, text: str, files: list[tuple[str, bytes, int | None]]) -> None:
        person = self.people[user]
        for name, content, declared in files:  # one event per file, as Matrix clients send them
            mxc = await asyncio.to_thread(person.upload, name, content)
            size = len(content) if declared is None else declared
            message = {"msgtype": "m.file", "body": text, "filename": name, "url": mxc, "info": {"size": size}}
            await asyncio.to_thread(person.send, chat, message)

    def files_posted(self, chat: str) -> list[tuple[str, bytes, str]]:
        reader = self.people[self.admin]
        return [
            (str(e["content"]["filename"]), reader.download(str(e["content"]["url"])), str(e["content"]["body"]))
            for e in self._bot_events(chat)
            if e["content"].get("msgtype") == "m.file"
        ]

    def working_signs(self, chat: str) -> int | None:
        return self.proxy.count("PUT", rf"/rooms/{re.escape(chat)}/typing/")

    def fault(self, site: Site, kind: FaultKind, *, times: int = 1, retry_after: int = 1) -> None:
        status = 429 if kind == "429" else 500
        self.proxy.fail("PUT", r"/send/m\.room\.message/", status, times=times, retry_after_ms=retry_after * 1000)

    def attempts(self, site: Site) -> int:
        return self.proxy.count("PUT", r"/send/m\.room\.message/")


HARNESSES: dict[str, type[Harness]] = {
    h.platform: h for h in (TelegramHarness, SlackHarness, DiscordHarness, MatrixHarness)
}
