"""A wire-level fake of Discord: REST under ``/api/v10`` and the gateway websocket, on 127.0.0.1.

It speaks what discord.py 2.7 actually sends and parses (see
``/work/shared/PLATFORM_NOTES.md``): zlib-stream gateway frames from one
compressor per connection, ``Content-Type`` exactly ``application/json``,
optional fields absent rather than null, and Discord's real error codes for
the limits the adapter must respect. Tests drive it by injecting gateway
events (messages, button presses, slash commands), scripting faults per
route, and reading back every REST call and the current state of every
message.
"""

from __future__ import annotations

import asyncio
import email.parser
import email.policy
import hashlib
import itertools
import json
import math
import re
import secrets
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, TypeVar

from aiohttp import WSMsgType, web
from aiohttp.typedefs import Handler

from tests.fakes.discord_oauth import DiscordSignIn

T = TypeVar("T")
Json = dict[str, Any]

API_PREFIX = "/api/v10"
FAKE_TOKEN = "fake-discord-token"

GUILD_ID = 1_100_000_000_000_000_001
HOME_CHANNEL_ID = 1_100_000_000_000_000_101
OTHER_CHANNEL_ID = 1_100_000_000_000_000_102
UNSERVED_CHANNEL_ID = 1_100_000_000_000_000_103
BOT_ID = 1_100_000_000_000_000_201
APP_ID = BOT_ID  # Discord gives a bot's application the bot user's id
ALICE_ID = 1_100_000_000_000_000_301
BOB_ID = 1_100_000_000_000_000_302
HELPER_BOT_ID = 1_100_000_000_000_000_401
BOT_ROLE_ID = 1_100_000_000_000_000_501
# How long Discord holds a nonce for ``enforce_nonce``: "the past few minutes" in its documentation.
NONCE_SECONDS = 300.0

# Permission bits (https://discord.com/developers/docs/topics/permissions).
VIEW_CHANNEL = 1 << 10
SEND_MESSAGES = 1 << 11
EMBED_LINKS = 1 << 14
READ_MESSAGE_HISTORY = 1 << 16
ATTACH_FILES = 1 << 15
MANAGE_WEBHOOKS = 1 << 29
USE_APPLICATION_COMMANDS = 1 << 31
BASE_PERMISSIONS = VIEW_CHANNEL | SEND_MESSAGES | EMBED_LINKS | READ_MESSAGE_HISTORY | USE_APPLICATION_COMMANDS

MESSAGE_CONTENT_INTENT = 1 << 15  # the gateway intent bit identify asks for
DIRECT_MESSAGES_INTENT = 1 << 12  # without it, no MESSAGE_CREATE from DM channels reaches the bot
DM_CHANNEL_BASE = 1_100_000_000_000_000_900  # + the user's index: one DM channel per user
GATEWAY_MESSAGE_CONTENT_LIMITED = 1 << 19  # application flag: the intent is on (an app in under 100 servers)
EPHEMERAL = 1 << 6
LOADING = 1 << 7

# "401": Discord refusing an interaction's or a webhook's own token (in the route's path), not the bot's.
# "401-proxy": a proxy between Kazma and Discord asking for its own sign-in (an HTML page, not Discord's JSON).
# "500-landed": Discord did the request (a message made) yet answered 500 (its front failed after its back end).
FaultKind = Literal["500", "500-landed", "503", "429", "429-global", "429-no-via", "401", "401-proxy", "hang"]

SYNC_FLUSH_SUFFIX = b"\x00\x00\xff\xff"


def _now() -> str:
    return datetime.now(UTC).isoformat()


@dataclass(frozen=True)
class FakeUser:
    id: int
    username: str
    bot: bool = False
    global_name: str | None = None

    def payload(self) -> Json:
        data: Json = {
            "id": str(self.id),
            "username": self.username,
            "discriminator": "0",
            "global_name": self.global_name,
            "avatar": None,
            "public_flags": 0,
        }
        if self.bot:
            data["bot"] = True
        return data


@dataclass
class RecordedCall:
    """One REST request as the fake saw it; ``status`` is filled in when it is answered."""

    method: str
    path: str  # below /api/v10
    query: dict[str, str]
    body: Any
    status: int | None = None
    at: float = field(default_factory=time.monotonic)  # when the request arrived (the pacing's clock)

    @property
    def json(self) -> Json:
        return self.body if isinstance(self.body, dict) else {}


@dataclass
class FakeInteraction:
    id: int
    token: str
    type: int  # 2 application command, 3 component
    channel_id: int
    user: FakeUser
    custom_id: str | None = None
    message_id: int | None = None
    callback_type: int | None = None  # set when acknowledged
    original_message_id: int | None = None
    followup_ids: list[int] = field(default_factory=list)
    modal: Json | None = None  # the modal it was answered with (callback type 9)
    created: float = field(default_factory=time.monotonic)


@dataclass
class _Fault:
    method: str
    pattern: re.Pattern[str]
    kind: FaultKind
    remaining: int
    retry_after: float
    after: Callable[[], None] | None = None  # run once the fault answered (e.g. the token reset meanwhile)


@dataclass
class _Session:
    """A gateway session, as Discord keeps it across connections: every dispatch numbered and kept, so a client
    that RESUMEs with the last ``seq`` it saw is sent the ones after it. Ended by a close with 1000/1001 from
    the client, or by the fake (``invalidate_sessions``): a RESUME then gets op 9 (not resumable)."""

    id: str
    intents: int  # what identify asked for
    seq: int = 0
    events: list[Json] = field(default_factory=list)  # every dispatch sent or kept, in order
    connection: _Gateway | None = None  # None: dropped, its dispatches kept for a RESUME
    resumable: bool = True
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # sequence numbers leave in order

    async def dispatch(self, event: str, data: Json) -> None:
        async with self.lock:
            self.seq += 1
            payload = {"op": 0, "t": event, "s": self.seq, "d": data}
            self.events.append(payload)
            connection = self.connection
            if connection is not None and not connection.ws.closed:
                await connection.send(payload)

    async def attach(self, connection: _Gateway, after: int) -> list[int]:
        """``connection`` RESUMEd this session having seen ``after``: the dispatches it missed, then RESUMED.
        The sequence numbers replayed."""
        async with self.lock:
            self.connection = connection
            connection.session = self
            missed = [e for e in self.events if int(e["s"]) > after]
            for payload in missed:
                await connection.send(payload)
            self.seq += 1
            resumed = {"op": 0, "t": "RESUMED", "s": self.seq, "d": {}}
            self.events.append(resumed)
            await connection.send(resumed)
            return [int(e["s"]) for e in missed]


class _Gateway:
    """One gateway connection: a single zlib compressor for its whole life, as Discord does."""

    def __init__(self, ws: web.WebSocketResponse, *, compress: bool) -> None:
        self.ws = ws
        self.compressor = zlib.compressobj() if compress else None
        self.lock = asyncio.Lock()
        self.session: _Session | None = None
        self.dropped = False  # closed by the fake (drop_gateway): its session stays resumable
        self.frames: list[bytes] = []

    @property
    def session_id(self) -> str | None:
        return self.session.id if self.session is not None else None

    @property
    def intents(self) -> int:
        return self.session.intents if self.session is not None else 0

    @property
    def live(self) -> bool:
        return self.session is not None and self.session.connection is self and not self.ws.closed

    async def send(self, payload: Json) -> None:
        async with self.lock:
            await self._send(payload)

    async def _send(self, payload: Json) -> None:
        data = json.dumps(payload).encode()
        if self.compressor is None:
            await self.ws.send_str(data.decode())
            return
        # Frames must leave in the order they were compressed: the client has one shared inflater.
        frame = self.compressor.compress(data) + self.compressor.flush(zlib.Z_SYNC_FLUSH)
        self.frames.append(frame)
        await self.ws.send_bytes(frame)


def _field_error(code: str, message: str) -> Json:
    return {"_errors": [{"code": code, "message": message}]}


def _max_length(limit: int) -> Json:
    return _field_error("BASE_TYPE_MAX_LENGTH", f"Must be {limit} or fewer in length.")


class FakeDiscord:
    """Start with ``await fake.start()``; point discord.py at ``api_base`` and ``gateway_url``."""

    def __init__(
        self,
        *,
        token: str = FAKE_TOKEN,
        manage_webhooks: bool = True,
        echo: bool = True,
        heartbeat_interval_ms: int = 41_250,
        message_content_intent: bool = True,
    ) -> None:
        self.token = token
        # the Bot page's "Message Content Intent" toggle, as the application's flags report it
        self.message_content_intent = message_content_intent
        self.manage_webhooks = manage_webhooks
        self.echo = echo  # real Discord sends the bot its own messages over the gateway too
        self.latency = 0.0  # seconds added before every REST answer (benchmarks)
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.bot = FakeUser(BOT_ID, "kazma", bot=True)
        self.alice = FakeUser(ALICE_ID, "alice", global_name="Alice")
        self.bob = FakeUser(BOB_ID, "bob")
        self.helper_bot = FakeUser(HELPER_BOT_ID, "helper", bot=True)
        self.users = {u.id: u for u in (self.bot, self.alice, self.bob, self.helper_bot)}
        self.sign_in = DiscordSignIn()  # OAuth2 for people signing in to an app (Kazma's console)
        self.channels: dict[int, str] = {
            HOME_CHANNEL_ID: "kazma-home",
            OTHER_CHANNEL_ID: "kazma-other",
            UNSERVED_CHANNEL_ID: "random",
        }
        self.dm_channels: dict[int, int] = {}  # DM channel id -> the person at the other end
        # Permission overwrites per channel, as Discord lists them: [{"id", "type" (0 role, 1 member), "allow",
        # "deny"}] with the bits as strings. The bot's role grants BASE_PERMISSIONS and Attach Files.
        self.overwrites: dict[int, list[Json]] = {}
        self.bot_in_guild = True  # False: the bot was never invited (or was removed): 403 Missing Access
        self.attachments: dict[int, bytes] = {}  # attachment id -> content (served under /attachments/)
        # attachment id -> the status the CDN answers instead, with an HTML page (a proxy's or the CDN's own)
        self.attachment_refusals: dict[int, int] = {}
        self.typing: list[tuple[int, float]] = []  # (channel id, time.monotonic()) per typing trigger
        self.calls: list[RecordedCall] = []
        self.messages: dict[int, Json] = {}
        # (channel, author, nonce) -> (message id, when): a post with ``enforce_nonce`` and a nonce seen from the
        # same author within NONCE_SECONDS returns that message instead of making another (Discord's rule)
        self._nonces: dict[tuple[int, int, str], tuple[int, float]] = {}
        self.nonce_replays = 0  # posts answered with an earlier message because of their nonce
        self.history_readable = True  # False: the bot lacks Read Message History (its list of messages is 403)
        self.history_reads = 0  # lists of a channel's messages answered
        self.webhooks: dict[int, Json] = {}
        self.commands: list[Json] = []
        self.interactions: dict[str, FakeInteraction] = {}
        self.identifies: list[Json] = []
        self.heartbeats = 0
        # Seconds an interaction may be answered in (Discord: 3); None: not enforced (slow machines, most tests).
        self.interaction_window: float | None = None
        self._faults: list[_Fault] = []
        self._gateways: list[_Gateway] = []
        self._sessions: dict[str, _Session] = {}
        self.resumes: list[Json] = []  # every RESUME: its session, seq, and what the fake did ("resumed"/"invalid")
        self.gateway_open = asyncio.Event()  # cleared: new gateway connections wait (a reconnect held off)
        self.gateway_open.set()
        self._ids = itertools.count(1_200_000_000_000_000_000)
        self._changed = asyncio.Condition()
        self._release = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._port = 0

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        app = web.Application(middlewares=[self._middleware])
        api = API_PREFIX
        app.router.add_get("/", self._gateway)
        app.router.add_get(f"{api}/users/@me", self._get_me)
        app.router.add_post(f"{api}/users/@me/channels", self._open_dm)
        app.router.add_get("/oauth2/authorize", self.sign_in.authorize)
        app.router.add_post(f"{api}/oauth2/token", self.sign_in.token)
        app.router.add_get(f"{api}/oauth2/applications/@me", self._get_application)
        app.router.add_get(f"{api}/gateway", self._get_gateway)
        app.router.add_get(f"{api}/gateway/bot", self._get_gateway_bot)
        app.router.add_put(f"{api}/applications/{{app}}/commands", self._put_commands)
        app.router.add_get(f"{api}/applications/{{app}}/commands", self._get_commands)
        app.router.add_get(f"{api}/channels/{{channel}}", self._get_channel)
        app.router.add_get(f"{api}/guilds/{{guild}}/roles", self._get_roles)
        app.router.add_get(f"{api}/guilds/{{guild}}/members/{{user}}", self._get_member)
        app.router.add_post(f"{api}/channels/{{channel}}/messages", self._post_message)
        app.router.add_post(f"{api}/channels/{{channel}}/typing", self._post_typing)
        app.router.add_get("/attachments/{channel}/{id}/{name}", self._get_attachment)
        app.router.add_get(f"{api}/channels/{{channel}}/messages", self._list_messages)
        app.router.add_get(f"{api}/channels/{{channel}}/messages/{{message}}", self._get_message)
        app.router.add_patch(f"{api}/channels/{{channel}}/messages/{{message}}", self._patch_message)
        app.router.add_delete(f"{api}/channels/{{channel}}/messages/{{message}}", self._delete_message)
        app.router.add_get(f"{api}/channels/{{channel}}/webhooks", self._get_webhooks)
        app.router.add_post(f"{api}/channels/{{channel}}/webhooks", self._post_webhook)
        app.router.add_post(f"{api}/interactions/{{id}}/{{token}}/callback", self._interaction_callback)
        app.router.add_post(f"{api}/webhooks/{{id}}/{{token}}", self._execute_webhook)
        app.router.add_get(f"{api}/webhooks/{{id}}/{{token}}/messages/{{message}}", self._get_webhook_message)
        app.router.add_patch(f"{api}/webhooks/{{id}}/{{token}}/messages/{{message}}", self._patch_webhook_message)
        # A short shutdown grace and handler cancellation: a "hang" must never hold up teardown.
        self._runner = web.AppRunner(app, shutdown_timeout=0.5, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        address = self._runner.addresses[0]
        self._port = int(address[1])

    async def stop(self) -> None:
        self._release.set()
        self.gateway_open.set()
        for gateway in list(self._gateways):
            await gateway.ws.close(code=1001)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def api_base(self) -> str:
        return f"http://127.0.0.1:{self._port}{API_PREFIX}"

    @property
    def gateway_url(self) -> str:
        return f"ws://127.0.0.1:{self._port}/"

    # ------------------------------------------------------------------ test helpers

    def inject_fault(
        self,
        method: str,
        path: str,
        kind: FaultKind,
        *,
        times: int = 1,
        retry_after: float = 0.02,
        after: Callable[[], None] | None = None,
    ) -> None:
        """Answer the next ``times`` requests matching ``method`` and ``path`` (a regex on the path below
        /api/v10, matched whole) with ``kind``: a 500 or 503, a 429 (with or without Discord's ``Via``
        header), or no answer until the fake stops. ``after`` runs once each such answer is made, before the
        client can send anything again (a change between a request and its retry, with no race)."""
        self._faults.append(_Fault(method.upper(), re.compile(path), kind, times, retry_after, after))

    def clear_faults(self) -> None:
        """No more scripted faults: every request is answered as usual again."""
        self._faults.clear()

    def calls_to(self, method: str, path: str) -> list[RecordedCall]:
        pattern = re.compile(path)
        return [c for c in self.calls if c.method == method.upper() and pattern.fullmatch(c.path)]

    def message_calls(self) -> list[RecordedCall]:
        """Every request that creates or edits message content."""
        patterns = (
            ("POST", r"/channels/\d+/messages"),
            ("PATCH", r"/channels/\d+/messages/\d+"),
            ("POST", r"/webhooks/\d+/[^/]+"),
            ("PATCH", r"/webhooks/\d+/[^/]+/messages/[^/]+"),
        )
        found = [c for method, path in patterns for c in self.calls_to(method, path)]
        found += [
            c
            for c in self.calls_to("POST", r"/interactions/\d+/[^/]+/callback")
            if c.json.get("type") in (4, 7) and "data" in c.json
        ]
        return found

    def channel_messages(self, channel_id: int) -> list[Json]:
        return [m for m in self.messages.values() if int(m["channel_id"]) == channel_id]

    async def wait_until(self, predicate: Callable[[], T], *, timeout: float = 5.0) -> T:
        """Wait until ``predicate()`` is truthy (re-checked on every change the fake sees) and return it."""
        async with asyncio.timeout(timeout), self._changed:
            while True:
                value = predicate()
                if value:
                    return value
                await self._changed.wait()

    async def wait_for_call(
        self,
        method: str,
        path: str,
        *,
        where: Callable[[RecordedCall], bool] | None = None,
        answered: bool = True,
        timeout: float = 5.0,
    ) -> RecordedCall:
        def find() -> RecordedCall | None:
            for call in self.calls_to(method, path):
                if (where is None or where(call)) and (not answered or call.status is not None):
                    return call
            return None

        found = await self.wait_until(find, timeout=timeout)
        assert found is not None
        return found

    async def notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # ------------------------------------------------------------------ gateway injection

    async def dispatch(self, event: str, data: Json) -> None:
        """Send a DISPATCH to every identified gateway session."""
        sessions = self._live_sessions()
        if not sessions:
            raise RuntimeError(f"no identified gateway session to receive {event}")
        for session in sessions:
            await session.dispatch(event, data)

    def _live_sessions(self) -> list[_Session]:
        """Sessions Discord sends events to: connected, or dropped and still resumable (kept for a RESUME)."""
        return [s for s in self._sessions.values() if s.resumable]

    async def drop_gateway(self, *, code: int = 1001) -> int:
        """Discord closes every gateway connection (``code`` 1001 "going away", or 4000 "unknown error"): the
        sessions stay resumable and keep what is dispatched until a client RESUMEs. How many were dropped."""
        dropped = [g for g in self._gateways if g.live]
        for gateway in dropped:
            gateway.dropped = True
            assert gateway.session is not None
            gateway.session.connection = None
        for gateway in dropped:
            await gateway.ws.close(code=code, message=b"dropped by the fake")
        await self.notify()
        return len(dropped)

    def dispatched(self, event: str) -> list[Json]:
        """The data of every ``event`` dispatched to a session, in order (a dropped session's kept ones too)."""
        return [e["d"] for session in self._sessions.values() for e in session.events if e["t"] == event]

    def invalidate_sessions(self) -> None:
        """Discord forgets every session (it expired, or Discord lost it): a RESUME is answered op 9, and what
        was kept for a dropped session is never sent."""
        for session in self._sessions.values():
            session.resumable = False

    async def user_message(
        self,
        channel_id: int,
        content: str,
        *,
        author: FakeUser | None = None,
        mentions: Sequence[FakeUser] = (),
        mention_roles: Sequence[int] = (),
        mention_everyone: bool = False,
    ) -> Json:
        """A member (human or another bot) posts ``content``: stored and dispatched as MESSAGE_CREATE."""
        author = author or self.alice
        message = self._new_message(
            channel_id,
            author.payload(),
            {"content": content},
            mentions=[{**u.payload(), "member": self._member(u, with_user=False)} for u in mentions],
            mention_roles=[str(r) for r in mention_roles],
            mention_everyone=mention_everyone,
        )
        await self.dispatch("MESSAGE_CREATE", self._gateway_message(message, member=self._member(author)))
        await self.notify()
        return message

    def dm_channel(self, user: FakeUser) -> int:
        """The DM channel between the bot and ``user`` (made on first use, as opening a DM does)."""
        for channel_id, recipient in self.dm_channels.items():
            if recipient == user.id:
                return channel_id
        channel_id = DM_CHANNEL_BASE + len(self.dm_channels)
        self.dm_channels[channel_id] = user.id
        return channel_id

    def attachment(self, channel_id: int, name: str, content: bytes, *, declared_size: int | None = None) -> Json:
        """A file a person attaches: the attachment object as MESSAGE_CREATE carries it."""
        attachment_id = self._snowflake()
        self.attachments[attachment_id] = content
        url = f"http://127.0.0.1:{self._port}/attachments/{channel_id}/{attachment_id}/{name}"
        return {
            "id": str(attachment_id),
            "filename": name,
            "size": len(content) if declared_size is None else declared_size,
            "url": url,
            "proxy_url": url,
            "content_type": "application/octet-stream",
        }

    async def direct_message(self, user: FakeUser, content: str, *, attachments: Sequence[Json] = ()) -> Json:
        """``user`` writes to the bot in their DM: MESSAGE_CREATE without guild_id or member, sent only to
        sessions that identified with the DIRECT_MESSAGES intent (as Discord does)."""
        channel_id = self.dm_channel(user)
        message = self._new_message(channel_id, user.payload(), {"content": content})
        message["attachments"] = list(attachments)
        for session in self._live_sessions():
            if session.intents & DIRECT_MESSAGES_INTENT:
                await session.dispatch("MESSAGE_CREATE", message)
        await self.notify()
        return message

    async def user_message_with_files(self, channel_id: int, content: str, attachments: Sequence[Json],
                                      *, author: FakeUser | None = None) -> Json:  # fmt: skip
        """A member posts ``content`` with ``attachments`` in a guild channel."""
        author = author or self.alice
        message = self._new_message(channel_id, author.payload(), {"content": content})
        message["attachments"] = list(attachments)
        await self.dispatch("MESSAGE_CREATE", self._gateway_message(message, member=self._member(author)))
        await self.notify()
        return message

    def files_in(self, channel_id: int) -> list[tuple[Json, bytes]]:
        """Files the bot posted into ``channel_id`` (attachment, content)."""
        return [
            (a, self.attachments[int(a["id"])])
            for m in self.channel_messages(channel_id)
            if m["author"]["id"] == str(BOT_ID)
            for a in m.get("attachments", [])
        ]

    async def press_button(self, message_id: int, custom_id: str, *, user: FakeUser | None = None) -> FakeInteraction:
        """``user`` presses the button ``custom_id`` on a message that really shows it."""
        user = user or self.alice
        message = self.messages.get(message_id)
        if message is None:
            raise LookupError(f"no message {message_id}")
        shown = [c.get("custom_id") for row in message.get("components", []) for c in row.get("components", [])]
        if custom_id not in shown:
            raise LookupError(f"message {message_id} shows no button {custom_id!r} (it shows {shown})")
        interaction = self._new_interaction(3, int(message["channel_id"]), user)
        interaction.custom_id = custom_id
        interaction.message_id = message_id
        payload = self._interaction_payload(interaction)
        payload["data"] = {"custom_id": custom_id, "component_type": 2}
        payload["message"] = message
        await self.dispatch("INTERACTION_CREATE", payload)
        await self.notify()
        return interaction

    async def submit_modal(
        self, shown: FakeInteraction, values: Mapping[str, str], *, user: FakeUser | None = None
    ) -> FakeInteraction:
        """``user`` submits the modal the bot answered ``shown`` with, typing ``values`` (input custom_id -> text)."""
        modal = shown.modal
        if modal is None:
            raise LookupError(f"interaction {shown.id} was not answered with a modal")
        user = user or shown.user
        interaction = self._new_interaction(5, shown.channel_id, user)
        interaction.custom_id = str(modal["custom_id"])
        interaction.message_id = shown.message_id
        payload = self._interaction_payload(interaction)
        rows = [
            {"type": 1, "components": [{"type": 4, "custom_id": key, "value": text}]} for key, text in values.items()
        ]
        payload["data"] = {"custom_id": modal["custom_id"], "components": rows}
        if shown.message_id is not None and shown.message_id in self.messages:
            payload["message"] = self.messages[shown.message_id]
        await self.dispatch("INTERACTION_CREATE", payload)
        await self.notify()
        return interaction

    async def slash_command(
        self,
        channel_id: int,
        *,
        user: FakeUser | None = None,
        name: str = "swarm",
        options: Mapping[str, str] | None = None,
    ) -> FakeInteraction:
        """``user`` runs ``/name`` with string options; the command must have been registered."""
        user = user or self.alice
        command = next((c for c in self.commands if c["name"] == name), None)
        if command is None:
            raise LookupError(f"no application command {name!r} registered (have {[c['name'] for c in self.commands]})")
        interaction = self._new_interaction(2, channel_id, user)
        payload = self._interaction_payload(interaction)
        data: Json = {"id": command["id"], "name": name, "type": 1}
        if options:
            data["options"] = [{"name": k, "type": 3, "value": v} for k, v in options.items()]
        payload["data"] = data
        await self.dispatch("INTERACTION_CREATE", payload)
        await self.notify()
        return interaction

    # ------------------------------------------------------------------ payload builders

    def _snowflake(self) -> int:
        return next(self._ids)

    def _member(self, user: FakeUser, *, with_user: bool = True) -> Json:
        roles = [str(BOT_ROLE_ID)] if user.id == BOT_ID else []
        member: Json = {"roles": roles, "joined_at": _now(), "deaf": False, "mute": False, "flags": 0}
        if with_user:
            member["user"] = user.payload()
        return member

    def _role_permissions(self) -> tuple[int, int]:
        bot = BASE_PERMISSIONS | ATTACH_FILES | (MANAGE_WEBHOOKS if self.manage_webhooks else 0)
        return BASE_PERMISSIONS, bot

    def _channel_payload(self, channel_id: int) -> Json:
        return {
            "id": str(channel_id),
            "type": 0,
            "guild_id": str(GUILD_ID),
            "name": self.channels[channel_id],
            "position": list(self.channels).index(channel_id),
            "permission_overwrites": self.overwrites.get(channel_id, []),
            "nsfw": False,
            "rate_limit_per_user": 0,
            "flags": 0,
        }

    def _guild_payload(self) -> Json:
        everyone, bot = self._role_permissions()

        def role(role_id: int, name: str, permissions: int, position: int) -> Json:
            return {
                "id": str(role_id),
                "name": name,
                "color": 0,
                "colors": {"primary_color": 0, "secondary_color": None, "tertiary_color": None},
                "hoist": False,
                "position": position,
                "permissions": str(permissions),
                "managed": False,
                "mentionable": False,
                "flags": 0,
            }

        members = [self._member(u) for u in self.users.values()]
        return {
            "id": str(GUILD_ID),
            "name": "Kazma test guild",
            "icon": None,
            "owner_id": str(ALICE_ID),
            "afk_timeout": 300,
            "verification_level": 0,
            "default_message_notifications": 1,
            "explicit_content_filter": 0,
            "roles": [role(GUILD_ID, "@everyone", everyone, 0), role(BOT_ROLE_ID, "kazma", bot, 1)],
            "emojis": [],
            "stickers": [],
            "features": [],
            "mfa_level": 0,
            "system_channel_flags": 0,
            "premium_tier": 0,
            "preferred_locale": "en-US",
            "nsfw_level": 0,
            "premium_progress_bar_enabled": False,
            "joined_at": _now(),
            "large": False,
            "unavailable": False,
            "member_count": len(members),
            "voice_states": [],
            "members": members,
            "channels": [self._channel_payload(c) for c in self.channels],
            "threads": [],
            "presences": [],
            "stage_instances": [],
            "guild_scheduled_events": [],
            "soundboard_sounds": [],
        }

    def _new_message(
        self,
        channel_id: int,
        author: Json,
        body: Json,
        *,
        webhook_id: int | None = None,
        message_type: int = 0,
        mentions: list[Json] | None = None,
        mention_roles: list[str] | None = None,
        mention_everyone: bool = False,
    ) -> Json:
        message: Json = {
            "id": str(self._snowflake()),
            "channel_id": str(channel_id),
            "author": author,
            "content": body.get("content") or "",
            "timestamp": _now(),
            "edited_timestamp": None,
            "tts": False,
            "mention_everyone": mention_everyone,
            "mentions": mentions or [],
            "mention_roles": mention_roles or [],
            "attachments": [],
            "embeds": [{**e, "type": "rich"} for e in body.get("embeds") or []],
            "components": body.get("components") or [],
            "pinned": False,
            "type": message_type,
            "flags": int(body.get("flags") or 0),
        }
        if webhook_id is not None:
            message["webhook_id"] = str(webhook_id)
        if author.get("id") == str(BOT_ID) or webhook_id == APP_ID:
            message["application_id"] = str(APP_ID)
        self.messages[int(message["id"])] = message
        return message

    def _gateway_message(self, message: Json, *, member: Json | None = None) -> Json:
        if int(message["channel_id"]) in self.dm_channels:
            return dict(message)  # a DM belongs to no guild: no guild_id, no member
        data = {**message, "guild_id": str(GUILD_ID)}
        if member is not None:
            data["member"] = {k: v for k, v in member.items() if k != "user"}
        return data

    async def _echo(self, message: Json, event: str = "MESSAGE_CREATE") -> None:
        if not self.echo or int(message.get("flags", 0)) & EPHEMERAL:
            return
        member = None if "webhook_id" in message else self._member(self.bot)
        for session in self._live_sessions():
            await session.dispatch(event, self._gateway_message(message, member=member))

    def _new_interaction(self, kind: int, channel_id: int, user: FakeUser) -> FakeInteraction:
        interaction = FakeInteraction(
            id=self._snowflake(),
            token=f"itoken-{secrets.token_hex(16)}",
            type=kind,
            channel_id=channel_id,
            user=user,
        )
        self.interactions[interaction.token] = interaction
        return interaction

    def _interaction_payload(self, interaction: FakeInteraction) -> Json:
        if interaction.channel_id in self.dm_channels:
            return self._dm_interaction_payload(interaction)
        everyone, bot = self._role_permissions()
        member = self._member(interaction.user)
        member["permissions"] = str(everyone)
        member["pending"] = False
        return {
            "id": str(interaction.id),
            "application_id": str(APP_ID),
            "type": interaction.type,
            "guild_id": str(GUILD_ID),
            "guild": {"id": str(GUILD_ID), "locale": "en-US", "features": []},
            "channel_id": str(interaction.channel_id),
            "channel": self._channel_payload(interaction.channel_id),
            "member": member,
            "token": interaction.token,
            "version": 1,
            "app_permissions": str(bot),
            "locale": "en-US",
            "guild_locale": "en-US",
            "entitlements": [],
            "authorizing_integration_owners": {"0": str(GUILD_ID)},
            "context": 0,
            "attachment_size_limit": 10 * 1024 * 1024,
        }

    def _dm_interaction_payload(self, interaction: FakeInteraction) -> Json:
        """An interaction in the bot's DM: no guild and no member, the presser as ``user`` (as Discord sends it)."""
        recipient = self.users.get(self.dm_channels[interaction.channel_id]) or interaction.user
        return {
            "id": str(interaction.id),
            "application_id": str(APP_ID),
            "type": interaction.type,
            "channel_id": str(interaction.channel_id),
            "channel": {"id": str(interaction.channel_id), "type": 1, "recipients": [recipient.payload()]},
            "user": interaction.user.payload(),
            "token": interaction.token,
            "version": 1,
            "app_permissions": "0",
            "locale": "en-US",
            "entitlements": [],
            "authorizing_integration_owners": {"0": str(GUILD_ID)},
            "context": 1,
            "attachment_size_limit": 10 * 1024 * 1024,
        }

    # ------------------------------------------------------------------ HTTP plumbing

    @staticmethod
    def _json(data: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
        # Exactly "application/json": discord.py does not parse "application/json; charset=utf-8".
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        return web.Response(body=json.dumps(data).encode(), status=status, headers=all_headers)

    @classmethod
    def _error(cls, status: int, code: int, message: str, errors: Json | None = None) -> web.Response:
        body: Json = {"message": message, "code": code}
        if errors is not None:
            body["errors"] = errors
        return cls._json(body, status)

    @classmethod
    def _not_found(cls, code: int, what: str) -> web.Response:
        return cls._error(404, code, f"Unknown {what}")

    def _take_fault(self, method: str, path: str) -> _Fault | None:
        for fault in self._faults:
            if fault.remaining > 0 and fault.method == method and fault.pattern.fullmatch(path):
                fault.remaining -= 1
                return fault
        return None

    async def _fault_response(self, fault: _Fault) -> web.Response:
        if fault.kind == "hang":
            await self._release.wait()
            return self._error(503, 0, "released at shutdown")
        if fault.kind in ("429", "429-global", "429-no-via"):
            # Discord's headers on a route's 429: whole seconds in Retry-After, the exact wait in the body and
            # X-RateLimit-Reset-After. A global one says so instead of naming a bucket. Cloudflare's block (no
            # Via) carries Retry-After only.
            headers = {"Retry-After": str(max(1, math.ceil(fault.retry_after)))}
            if fault.kind == "429":
                headers.update({
                    "Via": "1.1 google",
                    "X-RateLimit-Limit": "5",
                    "X-RateLimit-Remaining": "0",
                    "X-RateLimit-Reset": f"{time.time() + fault.retry_after:.3f}",
                    "X-RateLimit-Reset-After": f"{fault.retry_after:.3f}",
                    "X-RateLimit-Bucket": hashlib.sha256(fault.pattern.pattern.encode()).hexdigest()[:32],
                    "X-RateLimit-Scope": "user",
                })  # fmt: skip
            elif fault.kind == "429-global":
                headers.update({"Via": "1.1 google", "X-RateLimit-Global": "true", "X-RateLimit-Scope": "global"})
            body = {
                "message": "You are being rate limited.",
                "retry_after": fault.retry_after,
                "global": fault.kind == "429-global",
            }
            return self._json(body, 429, headers)
        if fault.kind == "401":
            return self._error(401, 50027, "Invalid Webhook Token")
        if fault.kind == "401-proxy":
            return web.Response(status=401, text="<html><body>Sign in</body></html>", content_type="text/html")
        return self._error(int(fault.kind), 0, "Internal Server Error" if fault.kind == "500" else "Unavailable")

    def _authorised(self, request: web.Request, path: str) -> bool:
        # Interaction and webhook-token routes carry their credentials in the path.
        if path.startswith(("/interactions/", "/webhooks/")):
            return True
        if path == "/oauth2/token":  # the app's own id and secret (checked there)
            return True
        authorization = request.headers.get("Authorization", "")
        if path == "/users/@me" and self.sign_in.user_of(authorization) is not None:
            return True  # a person's OAuth2 access token asking who it is
        return authorization == f"Bot {self.token}"

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.path.startswith(API_PREFIX):
            return await handler(request)
        if self.latency:
            await asyncio.sleep(self.latency)
        path = request.path[len(API_PREFIX) :]
        raw = await request.read()
        body: Any = None
        if raw and request.content_type == "application/json":
            body = json.loads(raw)
        call = RecordedCall(request.method, path, dict(request.query), body)
        self.calls.append(call)
        await self.notify()
        fault = self._take_fault(request.method, path)
        try:
            if fault is not None and fault.kind == "500-landed":
                await handler(request)  # done, and kept: only the answer fails
                response: web.StreamResponse = self._error(500, 0, "Internal Server Error")
            elif fault is not None:
                response = await self._fault_response(fault)
            elif not self._authorised(request, path):
                response = self._error(401, 0, "401: Unauthorized")
            else:
                try:
                    response = await handler(request)
                except web.HTTPNotFound:
                    response = self._error(404, 0, "404: Not Found")
                except web.HTTPMethodNotAllowed:
                    response = self._error(405, 0, "405: Method Not Allowed")
            call.status = response.status
            if fault is not None and fault.after is not None:
                fault.after()
            return response
        finally:
            await self.notify()

    @staticmethod
    async def _body(request: web.Request) -> Json:
        raw = await request.read()
        if not raw:
            return {}
        data = json.loads(raw)
        return data if isinstance(data, dict) else {"_": data}

    # ------------------------------------------------------------------ limits

    @staticmethod
    def _form_errors(payload: Json) -> Json:
        """Discord's 50035 checks for message content, embeds and components."""
        errors: Json = {}
        content = payload.get("content")
        if isinstance(content, str) and len(content) > 2000:
            errors["content"] = _max_length(2000)
        embeds = payload.get("embeds") or []
        embed_errors: Json = {}
        if len(embeds) > 10:
            embed_errors["_errors"] = _max_length(10)["_errors"]
        total = 0
        for index, embed in enumerate(embeds):
            this: Json = {}
            title = embed.get("title") or ""
            description = embed.get("description") or ""
            fields = embed.get("fields") or []
            footer = (embed.get("footer") or {}).get("text") or ""
            author = (embed.get("author") or {}).get("name") or ""
            if len(title) > 256:
                this["title"] = _max_length(256)
            if len(description) > 4096:
                this["description"] = _max_length(4096)
            if len(footer) > 2048:
                this["footer"] = {"text": _max_length(2048)}
            if len(author) > 256:
                this["author"] = {"name": _max_length(256)}
            if len(fields) > 25:
                this["fields"] = _max_length(25)
            field_errors: Json = {}
            for position, item in enumerate(fields):
                name, value = item.get("name") or "", item.get("value") or ""
                problems: Json = {}
                if not name.strip():
                    problems["name"] = _field_error("BASE_TYPE_REQUIRED", "This field is required")
                elif len(name) > 256:
                    problems["name"] = _max_length(256)
                if not value.strip():
                    problems["value"] = _field_error("BASE_TYPE_REQUIRED", "This field is required")
                elif len(value) > 1024:
                    problems["value"] = _max_length(1024)
                if problems:
                    field_errors[str(position)] = problems
                total += len(name) + len(value)
            if field_errors and "fields" not in this:
                this["fields"] = field_errors
            total += len(title) + len(description) + len(footer) + len(author)
            if this:
                embed_errors[str(index)] = this
        if total > 6000:
            embed_errors["_errors"] = [
                {"code": "MAX_EMBED_SIZE_EXCEEDED", "message": "Embed size exceeds maximum size of 6000"}
            ]
        if embed_errors:
            errors["embeds"] = embed_errors
        rows = payload.get("components") or []
        component_errors: Json = {}
        if len(rows) > 5:
            component_errors["_errors"] = _max_length(5)["_errors"]
        seen: set[str] = set()
        for row_index, row in enumerate(rows):
            items = row.get("components") or []
            row_errors: Json = {}
            if len(items) > 5:
                row_errors["components"] = _max_length(5)
            for item_index, item in enumerate(items):
                custom_id = item.get("custom_id")
                problems = {}
                if item.get("type") == 2 and item.get("style") != 5:
                    if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= 100:
                        problems["custom_id"] = _max_length(100)
                    elif custom_id in seen:
                        problems["custom_id"] = _field_error(
                            "COMPONENT_CUSTOM_ID_DUPLICATED", "Component custom id cannot be duplicated"
                        )
                    else:
                        seen.add(custom_id)
                if len(item.get("label") or "") > 80:
                    problems["label"] = _max_length(80)
                if problems:
                    row_errors.setdefault("components", {})[str(item_index)] = problems
            if row_errors:
                component_errors[str(row_index)] = row_errors
        if component_errors:
            errors["components"] = component_errors
        return errors

    @classmethod
    def _check_message(cls, payload: Json) -> web.Response | None:
        errors = cls._form_errors(payload)
        if errors:
            return cls._error(400, 50035, "Invalid Form Body", errors)
        if not (payload.get("content") or "").strip() and not payload.get("embeds") and not payload.get("components"):
            return cls._error(400, 50006, "Cannot send an empty message")
        return None

    # ------------------------------------------------------------------ REST: identity and commands

    async def _get_me(self, request: web.Request) -> web.Response:
        person = self.sign_in.user_of(request.headers.get("Authorization", ""))
        if person is not None:
            return self._json(person)
        return self._json({**self.bot.payload(), "verified": True, "mfa_enabled": False, "flags": 0})

    async def _get_application(self, request: web.Request) -> web.Response:
        return self._json(
            {
                "id": str(APP_ID),
                "name": "Kazma",
                "icon": None,
                "description": "",
                "summary": "",
                "bot_public": False,
                "bot_require_code_grant": False,
                "verify_key": "0" * 64,
                "owner": self.alice.payload(),
                "flags": GATEWAY_MESSAGE_CONTENT_LIMITED if self.message_content_intent else 0,
                "bot": self.bot.payload(),
            }
        )

    async def _get_gateway(self, request: web.Request) -> web.Response:
        return self._json({"url": self.gateway_url})

    async def _get_gateway_bot(self, request: web.Request) -> web.Response:
        limit = {"total": 1000, "remaining": 999, "reset_after": 0, "max_concurrency": 1}
        return self._json({"url": self.gateway_url, "shards": 1, "session_start_limit": limit})

    async def _put_commands(self, request: web.Request) -> web.Response:
        if request.match_info["app"] != str(APP_ID):
            return self._not_found(10002, "Application")
        payload = json.loads(await request.read() or b"[]")
        if not isinstance(payload, list):
            return self._error(400, 50035, "Invalid Form Body", {"_errors": [{"code": "LIST", "message": "list"}]})
        commands = []
        for item in payload:
            name = item.get("name", "")
            if not re.fullmatch(r"[-_\w]{1,32}", name) or name != name.lower():
                return self._error(400, 50035, "Invalid Form Body", {"name": _field_error("INVALID", "bad name")})
            commands.append(
                {
                    **{k: v for k, v in item.items() if v is not None},
                    "id": str(self._snowflake()),
                    "application_id": str(APP_ID),
                    "version": str(self._snowflake()),
                    "type": item.get("type", 1),
                }
            )
        self.commands = commands
        return self._json(commands)

    async def _get_commands(self, request: web.Request) -> web.Response:
        return self._json(self.commands)

    # ------------------------------------------------------------------ REST: channel messages

    def _channel_or_404(self, request: web.Request) -> int | web.Response:
        try:
            channel_id = int(request.match_info["channel"])
        except ValueError:
            return self._not_found(10003, "Channel")
        known = channel_id in self.channels or channel_id in self.dm_channels
        return channel_id if known else self._not_found(10003, "Channel")

    def _guild_or_error(self, request: web.Request) -> web.Response | None:
        if request.match_info["guild"] != str(GUILD_ID):
            return self._not_found(10004, "Guild")
        if not self.bot_in_guild:
            return self._error(403, 50001, "Missing Access")
        return None

    async def _get_roles(self, request: web.Request) -> web.Response:
        refused = self._guild_or_error(request)
        if refused is not None:
            return refused
        return self._json(self._guild_payload()["roles"])

    async def _get_member(self, request: web.Request) -> web.Response:
        refused = self._guild_or_error(request)
        if refused is not None:
            return refused
        user = self.users.get(int(request.match_info["user"]))
        if user is None:
            return self._not_found(10007, "Member")
        return self._json(self._member(user))

    async def _open_dm(self, request: web.Request) -> web.Response:
        """``POST /users/@me/channels {recipient_id}``: the DM channel with that user (the same one again)."""
        payload = await self._body(request)
        try:
            user_id = int(payload.get("recipient_id", ""))
        except (TypeError, ValueError):
            return self._error(400, 50035, "Invalid Form Body", {"recipient_id": "not a snowflake"})
        user = self.users.get(user_id) or FakeUser(user_id, f"user{user_id}")
        channel = self.dm_channel(user)
        return self._json({"id": str(channel), "type": 1, "last_message_id": None, "recipients": [user.payload()]})

    async def _get_channel(self, request: web.Request) -> web.Response:
        channel = self._channel_or_404(request)
        if isinstance(channel, web.Response):
            return channel
        if not self.bot_in_guild and channel not in self.dm_channels:
            return self._error(403, 50001, "Missing Access")
        if channel in self.dm_channels:
            recipient = self.users.get(self.dm_channels[channel]) or FakeUser(self.dm_channels[channel], "someone")
            return self._json({"id": str(channel), "type": 1, "recipients": [recipient.payload()]})
        return self._json(self._channel_payload(channel))

    async def _post_message(self, request: web.Request) -> web.Response:
        channel = self._channel_or_404(request)
        if isinstance(channel, web.Response):
            return channel
        files: list[tuple[str, bytes]] = []
        if request.content_type == "multipart/form-data":
            payload, files = await self._multipart(request)
        else:
            payload = await self._body(request)
        problem = self._form_errors(payload)
        if problem:
            return self._error(400, 50035, "Invalid Form Body", problem)
        if not files:
            problem_response = self._check_message(payload)
            if problem_response is not None:
                return problem_response
        nonce = payload.get("nonce")
        if nonce is not None:
            if not isinstance(nonce, int | str) or len(str(nonce)) > 25:
                return self._error(400, 50035, "Invalid Form Body", {"nonce": "at most 25 characters"})
            key = (channel, BOT_ID, str(nonce))
            seen = self._nonces.get(key)
            if payload.get("enforce_nonce") and seen is not None and time.monotonic() - seen[1] < NONCE_SECONDS:
                earlier = self.messages.get(seen[0])
                if earlier is not None:
                    self.nonce_replays += 1
                    return self._json(earlier)
        message = self._new_message(channel, self.bot.payload(), payload)
        if nonce is not None:
            self._nonces[(channel, BOT_ID, str(nonce))] = (int(message["id"]), time.monotonic())
            message["nonce"] = str(nonce)
        for name, content in files:
            attachment = self.attachment(channel, name, content)
            message["attachments"].append(attachment)
        await self._echo(message)
        return self._json(message)

    @staticmethod
    async def _multipart(request: web.Request) -> tuple[Json, list[tuple[str, bytes]]]:
        """discord.py's file upload: a ``payload_json`` part and ``files[n]`` parts (each with a filename)."""
        raw = await request.read()
        head = f"Content-Type: {request.headers['Content-Type']}\r\n\r\n".encode()
        parsed = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + raw)
        payload: Json = {}
        files: list[tuple[str, bytes]] = []
        for part in parsed.iter_parts():
            name = part.get_param("name", header="content-disposition")
            decoded = part.get_payload(decode=True)
            content = decoded if isinstance(decoded, bytes) else b""
            if name == "payload_json":
                payload = json.loads(content)
            elif isinstance(name, str) and name.startswith("files["):
                files.append((str(part.get_filename() or "file"), content))
        return payload, files

    async def _post_typing(self, request: web.Request) -> web.Response:
        channel = self._channel_or_404(request)
        if isinstance(channel, web.Response):
            return channel
        self.typing.append((channel, time.monotonic()))
        return web.Response(status=204)

    async def _get_attachment(self, request: web.Request) -> web.Response:
        refusal = self.attachment_refusals.get(int(request.match_info["id"]))
        if refusal is not None:
            return web.Response(status=refusal, text="<html><body>Unauthorized</body></html>", content_type="text/html")
        content = self.attachments.get(int(request.match_info["id"]))
        if content is None:
            return web.Response(status=404)
        return web.Response(body=content, content_type="application/octet-stream")

    def _message_or_404(self, request: web.Request) -> Json | web.Response:
        channel = self._channel_or_404(request)
        if isinstance(channel, web.Response):
            return channel
        try:
            message = self.messages.get(int(request.match_info["message"]))
        except ValueError:
            message = None
        if message is None or int(message["channel_id"]) != channel:
            return self._not_found(10008, "Message")
        return message

    async def _list_messages(self, request: web.Request) -> web.Response:
        """``GET /channels/{id}/messages``: the latest ``limit`` (1-100, 50 by default) messages, newest first, or
        those older than ``before``; 403 without Read Message History (``history_readable`` False here)."""
        channel = self._channel_or_404(request)
        if isinstance(channel, web.Response):
            return channel
        if not self.history_readable:
            return self._error(403, 50013, "Missing Permissions")
        try:
            limit = int(request.query.get("limit", "50"))
            before = int(request.query["before"]) if "before" in request.query else None
        except ValueError:
            return self._error(400, 50035, "Invalid Form Body", {"limit": "an integer"})
        if not 1 <= limit <= 100:
            return self._error(400, 50035, "Invalid Form Body", {"limit": "between 1 and 100"})
        ids = sorted((i for i, m in self.messages.items() if int(m["channel_id"]) == channel), reverse=True)
        if before is not None:
            ids = [i for i in ids if i < before]
        self.history_reads += 1
        return self._json([self.messages[i] for i in ids[:limit]])

    async def _get_message(self, request: web.Request) -> web.Response:
        message = self._message_or_404(request)
        return message if isinstance(message, web.Response) else self._json(message)

    def _apply_edit(self, message: Json, payload: Json) -> web.Response | None:
        merged = {
            "content": payload.get("content", message["content"]),
            "embeds": payload.get("embeds", message["embeds"]),
            "components": payload.get("components", message["components"]),
        }
        problem = self._check_message(merged)
        if problem is not None:
            return problem
        message["content"] = merged["content"] or ""
        message["embeds"] = [{**e, "type": "rich"} for e in merged["embeds"] or []]
        message["components"] = merged["components"] or []
        if "flags" in payload and payload["flags"] is not None:
            message["flags"] = int(payload["flags"]) & ~LOADING
        else:
            message["flags"] = int(message.get("flags", 0)) & ~LOADING
        message["edited_timestamp"] = _now()
        return None

    async def _patch_message(self, request: web.Request) -> web.Response:
        message = self._message_or_404(request)
        if isinstance(message, web.Response):
            return message
        if message["author"]["id"] != str(BOT_ID) or "webhook_id" in message:
            return self._error(403, 50005, "Cannot edit a message authored by another user")
        problem = self._apply_edit(message, await self._body(request))
        if problem is not None:
            return problem
        await self._echo(message, "MESSAGE_UPDATE")
        return self._json(message)

    async def _delete_message(self, request: web.Request) -> web.Response:
        message = self._message_or_404(request)
        if isinstance(message, web.Response):
            return message
        del self.messages[int(message["id"])]
        return web.Response(status=204)

    # ------------------------------------------------------------------ REST: channel webhooks

    def _webhook_payload(self, hook: Json) -> Json:
        return {**hook, "user": self.bot.payload()}

    async def _get_webhooks(self, request: web.Request) -> web.Response:
        channel = self._channel_or_404(request)
        if isinstance(channel, web.Response):
            return channel
        if not self.manage_webhooks:
            return self._error(403, 50013, "Missing Permissions")
        return self._json([self._webhook_payload(h) for h in self.webhooks.values() if h["channel_id"] == str(channel)])

    @staticmethod
    def _bad_webhook_name(name: object) -> bool:
        if not isinstance(name, str) or not 1 <= len(name) <= 80:
            return True
        lowered = name.lower()
        return "discord" in lowered or "clyde" in lowered

    async def _post_webhook(self, request: web.Request) -> web.Response:
        channel = self._channel_or_404(request)
        if isinstance(channel, web.Response):
            return channel
        if not self.manage_webhooks:
            return self._error(403, 50013, "Missing Permissions")
        payload = await self._body(request)
        if self._bad_webhook_name(payload.get("name")):
            return self._error(400, 50035, "Invalid Form Body", {"name": _field_error("BASE_TYPE_BAD_NAME", "bad")})
        hook = {
            "id": str(self._snowflake()),
            "type": 1,
            "guild_id": str(GUILD_ID),
            "channel_id": str(channel),
            "name": payload["name"],
            "avatar": None,
            "token": f"wtoken-{secrets.token_hex(16)}",
            "application_id": str(APP_ID),
        }
        self.webhooks[int(hook["id"])] = hook
        return self._json(self._webhook_payload(hook))

    # ------------------------------------------------------------------ REST: interactions

    async def _interaction_callback(self, request: web.Request) -> web.Response:
        interaction = self.interactions.get(request.match_info["token"])
        if interaction is None or str(interaction.id) != request.match_info["id"]:
            return self._not_found(10062, "interaction")
        if interaction.callback_type is not None:
            return self._error(400, 40060, "Interaction has already been acknowledged.")
        window = self.interaction_window
        if window is not None and time.monotonic() - interaction.created > window:
            return self._not_found(10062, "interaction")  # too late: the token is gone
        payload = await self._body(request)
        kind = payload.get("type")
        data = payload.get("data") or {}
        message: Json | None = None
        if kind == 4:
            problem = self._check_message(data)
            if problem is not None:
                return problem
            message = self._interaction_message(interaction, data)
            interaction.original_message_id = int(message["id"])
        elif kind == 5:
            message = self._interaction_message(
                interaction, {"content": "", "flags": (int(data.get("flags") or 0) & EPHEMERAL) | LOADING}
            )
            interaction.original_message_id = int(message["id"])
        elif kind == 7:
            if interaction.message_id is None or interaction.message_id not in self.messages:
                return self._error(400, 50035, "Invalid Form Body", {"type": _field_error("INVALID", "no message")})
            message = self.messages[interaction.message_id]
            problem = self._apply_edit(message, data)
            if problem is not None:
                return problem
        elif kind == 9:
            if interaction.type not in (2, 3) or not data.get("custom_id") or not data.get("components"):
                return self._error(400, 50035, "Invalid Form Body", {"data": _field_error("INVALID", "modal")})
            interaction.modal = data
        elif kind not in (1, 6):
            return self._error(400, 50035, "Invalid Form Body", {"type": _field_error("INVALID", f"type {kind}")})
        interaction.callback_type = kind
        if message is not None and kind in (4, 5):
            await self._echo(message)
        if "with_response" not in request.query:
            return web.Response(status=204)
        summary: Json = {"id": str(interaction.id), "type": interaction.type}
        resource: Json = {"type": kind}
        if message is not None:
            summary["response_message_id"] = message["id"]
            summary["response_message_loading"] = kind == 5
            summary["response_message_ephemeral"] = bool(int(message["flags"]) & EPHEMERAL)
            resource["message"] = message
        return self._json({"interaction": summary, "resource": resource})

    def _interaction_message(self, interaction: FakeInteraction, body: Json) -> Json:
        return self._new_message(
            interaction.channel_id,
            self.bot.payload(),
            body,
            webhook_id=APP_ID,
            message_type=20 if interaction.type == 2 else 0,
        )

    # ------------------------------------------------------------------ REST: webhook execution

    async def _execute_webhook(self, request: web.Request) -> web.Response:
        hook_id, token = request.match_info["id"], request.match_info["token"]
        payload = await self._body(request)
        interaction = self.interactions.get(token)
        if hook_id == str(APP_ID) and interaction is not None:
            if interaction.callback_type is None:
                return self._not_found(10015, "Webhook")
            problem = self._check_message(payload)
            if problem is not None:
                return problem
            original = self.messages.get(interaction.original_message_id or 0)
            if interaction.callback_type == 5 and original is not None and int(original["flags"]) & LOADING:
                # The first followup after a "thinking" defer replaces the loading message.
                problem = self._apply_edit(original, payload)
                if problem is not None:
                    return problem
                message = original
                await self._echo(message, "MESSAGE_UPDATE")
            else:
                message = self._interaction_message(interaction, payload)
                await self._echo(message)
            interaction.followup_ids.append(int(message["id"]))
        else:
            hook = self.webhooks.get(int(hook_id)) if hook_id.isdigit() else None
            if hook is None or hook["token"] != token:
                return self._not_found(10015, "Webhook")
            problem = self._check_message(payload)
            if problem is not None:
                return problem
            username = payload.get("username") or hook["name"]
            if self._bad_webhook_name(username):
                errors = {"username": _field_error("USERNAME_INVALID", "Username cannot contain 'discord'")}
                return self._error(400, 50035, "Invalid Form Body", errors)
            channel = int(request.query.get("thread_id") or hook["channel_id"])
            author = {"id": hook["id"], "username": username, "discriminator": "0000", "avatar": None, "bot": True}
            message = self._new_message(channel, author, payload, webhook_id=int(hook["id"]))
            await self._echo(message)
        if request.query.get("wait") in ("true", "True", "1"):
            return self._json(message)
        return web.Response(status=204)

    def _webhook_message_or_404(self, request: web.Request) -> Json | web.Response:
        interaction = self.interactions.get(request.match_info["token"])
        if interaction is None or request.match_info["id"] != str(APP_ID):
            return self._not_found(10015, "Webhook")
        wanted = request.match_info["message"]
        message_id = interaction.original_message_id if wanted == "@original" else int(wanted)
        message = self.messages.get(message_id or 0)
        return message if message is not None else self._not_found(10008, "Message")

    async def _get_webhook_message(self, request: web.Request) -> web.Response:
        message = self._webhook_message_or_404(request)
        return message if isinstance(message, web.Response) else self._json(message)

    async def _patch_webhook_message(self, request: web.Request) -> web.Response:
        message = self._webhook_message_or_404(request)
        if isinstance(message, web.Response):
            return message
        problem = self._apply_edit(message, await self._body(request))
        if problem is not None:
            return problem
        await self._echo(message, "MESSAGE_UPDATE")
        return self._json(message)

    # ------------------------------------------------------------------ gateway

    async def _gateway(self, request: web.Request) -> web.WebSocketResponse:
        await self.gateway_open.wait()
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        compress = request.query.get("compress")
        if compress not in (None, "zlib-stream"):
            await ws.close(code=4000, message=b"unsupported compression")
            return ws
        gateway = _Gateway(ws, compress=compress == "zlib-stream")
        self._gateways.append(gateway)
        try:
            await gateway.send({"op": 10, "d": {"heartbeat_interval": self.heartbeat_interval_ms}})
            async for msg in ws:
                if msg.type != WSMsgType.TEXT:
                    continue
                await self._on_gateway_message(gateway, json.loads(msg.data))
        finally:
            self._gateways.remove(gateway)
            session = gateway.session
            if session is not None and session.connection is gateway:
                session.connection = None
                # A client closing with 1000 or 1001 ends its session (Discord: the bot goes offline); any other
                # end (a dropped connection, a client killed) leaves it resumable for a while.
                if not gateway.dropped and ws.close_code in (1000, 1001):
                    session.resumable = False
            await self.notify()
        return ws

    async def _on_gateway_message(self, gateway: _Gateway, message: Json) -> None:
        op = message.get("op")
        data = message.get("d")
        if op == 1:
            self.heartbeats += 1
            await gateway.send({"op": 11})
        elif op == 2:
            if not isinstance(data, dict) or data.get("token") != self.token:
                self.identifies.append({"rejected": data})
                await gateway.ws.close(code=4004, message=b"Authentication failed.")
                return
            if int(data.get("intents") or 0) & MESSAGE_CONTENT_INTENT and not self.message_content_intent:
                self.identifies.append({"rejected": data})
                await gateway.ws.close(code=4014, message=b"Disallowed intent(s).")
                return
            self.identifies.append(data)
            session = _Session(secrets.token_hex(16), intents=int(data.get("intents") or 0))
            session.connection = gateway
            gateway.session = session
            self._sessions[session.id] = session
            await session.dispatch("READY", self._ready_payload(session, data))
            await session.dispatch("GUILD_CREATE", self._guild_payload())
        elif op == 6:
            await self._resume(gateway, data)
        await self.notify()

    async def _resume(self, gateway: _Gateway, data: Any) -> None:
        """RESUME (op 6): the missed dispatches after ``seq``, then RESUMED; op 9 ``false`` when the session is
        unknown, ended or expired (the client must identify again, and what was missed is lost)."""
        if not isinstance(data, dict) or data.get("token") != self.token:
            self.resumes.append({"rejected": data})
            await gateway.ws.close(code=4004, message=b"Authentication failed.")
            return
        session = self._sessions.get(str(data.get("session_id")))
        seq = data.get("seq")
        record: Json = {"session_id": data.get("session_id"), "seq": seq}
        self.resumes.append(record)
        if session is None or not session.resumable or not isinstance(seq, int) or seq > session.seq:
            record["outcome"] = "invalid"
            await gateway.send({"op": 9, "d": False})
            return
        previous = session.connection
        if previous is not None and previous is not gateway:
            previous.dropped = True  # the session moves to this connection; the old one is done
            await previous.ws.close(code=4000, message=b"session resumed elsewhere")
        record["outcome"] = "resumed"
        record["replayed"] = await session.attach(gateway, seq)

    def _ready_payload(self, session: _Session, identify: Json) -> Json:
        ready: Json = {
            "v": 10,
            "user": {**self.bot.payload(), "verified": True, "mfa_enabled": False, "flags": 0},
            "guilds": [{"id": str(GUILD_ID), "unavailable": True}],
            "session_id": session.id,
            "session_type": "normal",
            "resume_gateway_url": self.gateway_url,
            "application": {"id": str(APP_ID), "flags": 0},
            "private_channels": [],
            "relationships": [],
            "presences": [],
            "guild_join_requests": [],
            "geo_ordered_rtc_regions": [],
            "user_settings": {},
        }
        if "shard" in identify:
            ready["shard"] = identify["shard"]
        return ready

    def gateway_sessions(self) -> tuple[int, int]:
        """(connected, resumable): sessions with a live connection, and sessions Discord still sends to."""
        live = self._live_sessions()
        return sum(1 for s in live if s.connection is not None and s.connection.live), len(live)

    @property
    def identified(self) -> bool:
        return any(g.live for g in self._gateways)

    @property
    def gateway_frames(self) -> list[bytes]:
        return [frame for g in self._gateways for frame in g.frames]
