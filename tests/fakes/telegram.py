"""A wire-level fake of the Telegram Bot API: real HTTP on 127.0.0.1, real limits, real error texts.

python-telegram-bot is pointed at it unchanged (``base_url=f"{fake.base_url}/bot"``).
It keeps what Telegram keeps (pending updates confirmed by ``offset``, each
chat's messages with their current text and keyboard, open callback queries)
and refuses what Telegram refuses (over-long text, bad HTML, oversized button
data, identical edits, late answers), so an adapter bug shows up as the same
400 it would get in production. Every call is recorded for assertions, and
faults (500, 429 with ``retry_after``, a request that never answers) can be
scripted per method.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import itertools
import json
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlencode

import aiohttp
from aiohttp import web

JsonDict = dict[str, Any]

TEXT_LIMIT = 4096
ENTITY_LIMIT = 100  # Telegram keeps the first 100 formatting entities and silently ignores the rest
CALLBACK_DATA_LIMIT = 64
ANSWER_TEXT_LIMIT = 200
CAPTION_LIMIT = 1024
CHAT_ACTIONS = frozenset({"typing", "upload_photo", "record_video", "upload_video", "record_voice", "upload_voice",
                          "upload_document", "choose_sticker", "find_location", "record_video_note",
                          "upload_video_note"})  # fmt: skip
SECRET_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,256}$")

NOT_MODIFIED = (
    "Bad Request: message is not modified: specified new message content and reply markup are exactly "
    "the same as a current content and reply markup of the message"
)
QUERY_TOO_OLD = "Bad Request: query is too old and response timeout expired or query ID is invalid"

# Form values arrive as text; these are text in the API, the rest are JSON (numbers, booleans, objects).
_STRING_FIELDS = frozenset(
    {
        "text",
        "parse_mode",
        "callback_query_id",
        "inline_message_id",
        "url",
        "secret_token",
        "ip_address",
        "caption",
        "language_code",
        "business_connection_id",
        "message_effect_id",
        "description",
        "short_description",
        "name",
    }
)

_TAG_TYPES = {
    "b": "bold",
    "strong": "bold",
    "i": "italic",
    "em": "italic",
    "u": "underline",
    "ins": "underline",
    "s": "strikethrough",
    "strike": "strikethrough",
    "del": "strikethrough",
    "code": "code",
    "pre": "pre",
    "a": "text_link",
    "tg-spoiler": "spoiler",
    "span": "spoiler",
    "blockquote": "blockquote",
}
_NAMED_ENTITIES = {"lt": "<", "gt": ">", "amp": "&", "quot": '"'}
_PLAIN_RUN = re.compile(r"[^<>&]+")
_CHAR_REF = re.compile(r"&(?:#([0-9]{1,7})|#[xX]([0-9a-fA-F]{1,6})|([A-Za-z][A-Za-z0-9]*));")
_START_TAG = re.compile(
    r"<([A-Za-z][A-Za-z0-9-]*)((?:\s+[A-Za-z-]+(?:\s*=\s*(?:\"[^\"]*\"|'[^']*'|[^\s>\"']+))?)*)\s*>"
)
_END_TAG = re.compile(r"</([A-Za-z][A-Za-z0-9-]*)\s*>")
_ATTRIBUTE = re.compile(r"([A-Za-z-]+)(?:\s*=\s*(?:\"([^\"]*)\"|'([^']*)'|([^\s>\"']+)))?")
_COMMAND = re.compile(r"/[A-Za-z0-9_]{1,32}(?:@[A-Za-z0-9_]{3,32})?(?![A-Za-z0-9_@])")
_MENTION = re.compile(r"(?<![A-Za-z0-9_@/])@[A-Za-z0-9_]{3,32}(?![A-Za-z0-9_@])")


def utf16_len(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


class ApiError(Exception):
    """An error answer of the Bot API: ``{"ok": false, "error_code": status, "description": ...}``."""

    def __init__(self, status: int, description: str, parameters: JsonDict | None = None) -> None:
        super().__init__(description)
        self.status = status
        self.description = description
        self.parameters = parameters


class HtmlError(ValueError):
    pass


def _byte_offset(source: str, index: int) -> int:
    return len(source[:index].encode("utf-8"))


def _decode_reference(match: re.Match[str], source: str, index: int) -> str:
    decimal, hexadecimal, name = match.groups()
    if name is not None:
        if name not in _NAMED_ENTITIES:
            raise HtmlError(f'Unsupported HTML entity "&{name};" at byte offset {_byte_offset(source, index)}')
        return _NAMED_ENTITIES[name]
    code = int(decimal) if decimal is not None else int(hexadecimal, 16)
    if code == 0 or code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
        raise HtmlError(f"Invalid character reference at byte offset {_byte_offset(source, index)}")
    return chr(code)


def _attributes(raw: str, source: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for match in _ATTRIBUTE.finditer(raw):
        value = next((group for group in match.groups()[1:] if group is not None), "")
        found[match[1].lower()] = _unescape(value, source)
    return found


def _unescape(value: str, source: str) -> str:
    out: list[str] = []
    index = 0
    while index < len(value):
        if value[index] == "&":
            match = _CHAR_REF.match(value, index)
            if match is None:
                raise HtmlError("Unescaped '&' in an attribute value")
            out.append(_decode_reference(match, source, index))
            index = match.end()
        else:
            out.append(value[index])
            index += 1
    return "".join(out)


def parse_html(source: str) -> tuple[str, list[JsonDict]]:
    """Telegram's HTML parse mode: visible text and entities (offsets in UTF-16 units).

    Stricter than nothing and as strict as Telegram where it matters: only the
    allowed tags, balanced, and every ``&``, ``<`` and ``>`` of text escaped.
    """
    out: list[str] = []
    units = 0
    stack: list[tuple[str, int, dict[str, str]]] = []
    entities: list[JsonDict] = []
    index = 0
    length = len(source)
    while index < length:
        plain = _PLAIN_RUN.match(source, index)
        if plain is not None:
            out.append(plain[0])
            units += utf16_len(plain[0])
            index = plain.end()
            continue
        char = source[index]
        if char == "&":
            match = _CHAR_REF.match(source, index)
            if match is None:
                raise HtmlError(f'Unescaped "&" at byte offset {_byte_offset(source, index)}')
            decoded = _decode_reference(match, source, index)
            out.append(decoded)
            units += utf16_len(decoded)
            index = match.end()
        elif char == ">":
            raise HtmlError(f'Unescaped ">" at byte offset {_byte_offset(source, index)}')
        elif source.startswith("</", index):
            match = _END_TAG.match(source, index)
            if match is None:
                raise HtmlError(f"Unclosed end tag at byte offset {_byte_offset(source, index)}")
            name = match[1].lower()
            if not stack:
                raise HtmlError(f'Unexpected end tag "</{name}>" at byte offset {_byte_offset(source, index)}')
            opened, start, attributes = stack.pop()
            if opened != name:
                raise HtmlError(
                    f'Unmatched end tag at byte offset {_byte_offset(source, index)}, expected "</{opened}>", '
                    f'found "</{name}>"'
                )
            entity = _entity(opened, start, units - start, attributes, inside_pre=any(t == "pre" for t, *_ in stack))
            if entity is not None:
                entities.append(entity)
            index = match.end()
        else:
            match = _START_TAG.match(source, index)
            if match is None:
                raise HtmlError(f"Unclosed start tag at byte offset {_byte_offset(source, index)}")
            name = match[1].lower()
            attributes = _attributes(match[2], source)
            if name not in _TAG_TYPES or (name == "span" and attributes.get("class") != "tg-spoiler"):
                raise HtmlError(f'Unsupported start tag "{name}" at byte offset {_byte_offset(source, index)}')
            stack.append((name, units, attributes))
            index = match.end()
    if stack:
        raise HtmlError(f'Can\'t find end tag corresponding to start tag "{stack[-1][0]}"')
    entities.sort(key=lambda e: (e["offset"], -e["length"]))
    return "".join(out), entities


def _entity(tag: str, offset: int, length: int, attributes: dict[str, str], *, inside_pre: bool) -> JsonDict | None:
    if length <= 0 or (tag == "code" and inside_pre):
        return None
    kind = _TAG_TYPES[tag]
    entity: JsonDict = {"type": kind, "offset": offset, "length": length}
    if tag == "a":
        if not attributes.get("href"):
            return None
        entity["url"] = attributes["href"]
    elif tag == "blockquote" and "expandable" in attributes:
        entity["type"] = "expandable_blockquote"
    return entity


def command_and_mention_entities(text: str) -> list[JsonDict]:
    """What Telegram's servers detect in a user's plain message: a leading /command and @mentions."""
    found: list[JsonDict] = []
    command = _COMMAND.match(text)
    command_end = 0
    if command is not None:
        found.append({"type": "bot_command", "offset": 0, "length": utf16_len(command[0])})
        command_end = command.end()
    for match in _MENTION.finditer(text, command_end):
        found.append({"type": "mention", "offset": utf16_len(text[: match.start()]), "length": utf16_len(match[0])})
    return found


# --------------------------------------------------------------------------- records


@dataclass
class FakeCall:
    seq: int
    method: str
    params: JsonDict
    at: float  # time.monotonic() when the request arrived
    status: int | None = None  # HTTP status answered; None while unanswered
    response: JsonDict | None = None


@dataclass
class FakeMessage:
    chat_id: int
    message_id: int
    text: str  # visible text (after parsing)
    entities: list[JsonDict]
    source: str  # the text as sent (HTML source with a parse mode)
    parse_mode: str | None
    reply_markup: JsonDict | None
    sender: JsonDict
    date: int
    thread_id: int | None = None
    edits: int = 0
    dropped_entities: int = 0  # formatting past Telegram's cap of 100, lost without an error
    reply_to: int | None = None  # the message this one replies to
    document: JsonDict | None = None  # a file sent with the message (Telegram's Document object)
    photo: list[JsonDict] | None = None  # a photo, in the sizes Telegram made of it
    sender_chat: JsonDict | None = None  # sent on behalf of a chat (an anonymous admin, a linked channel)

    @property
    def from_bot(self) -> bool:
        return bool(self.sender.get("is_bot"))

    @property
    def buttons(self) -> list[JsonDict]:
        if not self.reply_markup:
            return []
        return [button for row in self.reply_markup.get("inline_keyboard", []) for button in row]


@dataclass(frozen=True)
class Fault:
    """A scripted failure, consumed by the next call of its method before normal handling."""

    kind: Literal["status", "retry_after", "hang", "answer_held"]
    status: int = 500
    retry_after: int = 1
    description: str = "Internal Server Error"
    release: asyncio.Event | None = None

    @classmethod
    def server_error(cls, status: int = 500, description: str = "Internal Server Error") -> Fault:
        return cls("status", status=status, description=description)

    @classmethod
    def too_many_requests(cls, retry_after: int) -> Fault:
        return cls("retry_after", status=429, retry_after=retry_after)

    @classmethod
    def refused_once(cls, release: asyncio.Event, status: int = 401, description: str = "Unauthorized") -> Fault:
        """Answer ``status`` only once ``release`` is set: a call held, then refused."""
        return cls("status", status=status, description=description, release=release)

    @classmethod
    def hang(cls) -> Fault:
        """Never answer (until the fake stops)."""
        return cls("hang")

    @classmethod
    def answer_held(cls, release: asyncio.Event) -> Fault:
        """Do the call (a post lands in its chat), then answer only once ``release`` is set: a slow answer that a
        client which gives up meanwhile never reads, while what it asked for is done, as on Telegram."""
        return cls("answer_held", release=release)


@dataclass
class _Webhook:
    url: str
    secret_token: str
    task: asyncio.Task[None] | None = None
    deliveries: list[JsonDict] = field(default_factory=list)


# --------------------------------------------------------------------------- the server


class FakeTelegram:
    def __init__(
        self,
        *,
        token: str = "123456:TEST-fake-token",  # noqa: S107 - a fake token for a fake server
        bot_id: int = 123456,
        bot_username: str = "kazma_bot",
        bot_name: str = "Kazma",
        latency: float = 0.0,
    ) -> None:
        self.token = token
        self.bot_id = bot_id
        self.bot_username = bot_username
        self.bot_name = bot_name
        self.latency = latency  # seconds added before every answer
        self.calls: list[FakeCall] = []
        self.callback_answers: dict[str, JsonDict] = {}
        self.commands: list[JsonDict] = []
        self.webhook_deliveries: list[JsonDict] = []
        self._seq = itertools.count(1)
        self._update_ids = itertools.count(1000)
        self._query_ids = itertools.count(5_000_000_000)
        self._updates: list[JsonDict] = []
        self._chats: dict[int, dict[int, FakeMessage]] = {}
        self._next_message_id: dict[int, int] = {}
        self._open_queries: set[str] = set()
        self.files: dict[str, bytes] = {}  # file_id -> content (what users sent and what the bot uploaded)
        self.file_size_limit = 20 * 1024 * 1024  # bots may download files up to 20 MB (getFile refuses more)
        self.chat_actions: list[JsonDict] = []  # sendChatAction calls, in order
        self._file_ids = itertools.count(1)
        self.migrated: dict[int, int] = {}  # a group upgraded to a supergroup: old chat id → new one
        # The bot's membership per chat, as getChatMember answers it for the bot: "member" unless set here.
        # "left"/"kicked": getChat answers "chat not found", as Telegram does for a group the bot is not in.
        self.bot_membership: dict[int, JsonDict] = {}
        self.channels: set[int] = set()  # chat ids that are channels (type "channel"), not groups
        # People who never opened a private chat with the bot (or blocked it): Telegram refuses the bot's posts
        # to them with 403, as it does for every user until they press Start.
        self.not_started: set[int] = set()
        self._faults: dict[str, deque[Fault]] = {}
        self._waiters: list[asyncio.Future[None]] = []
        self._poll_generation = 0
        self._webhook: _Webhook | None = None
        self._stopping = False
        self._stopped = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._port = 0

    def mini_app_init_data(
        self,
        user_id: int,
        *,
        first_name: str = "Alice",
        start_param: str | None = None,
        auth_date: int | None = None,
        bot_token: str | None = None,
    ) -> str:
        """What a Telegram client hands a Mini App it opens for ``user_id`` (``Telegram.WebApp.initData``): the
        fields, and their ``hash`` as Telegram documents it — HMAC-SHA256, keyed by HMAC-SHA256(key="WebAppData",
        msg=<bot token>), over every other field as ``key=value`` lines sorted by key. ``bot_token``: sign as
        another bot would."""
        fields = {
            "query_id": f"AAH{self.bot_id}{user_id}",
            "user": json.dumps(
                {"id": user_id, "first_name": first_name, "language_code": "en", "allows_write_to_pm": True},
                separators=(",", ":"),
            ),
            "auth_date": str(int(time.time()) if auth_date is None else auth_date),
            "chat_instance": "-8541293005236450",
            "chat_type": "sender",
        }
        if start_param is not None:
            fields["start_param"] = start_param
        secret = hmac.new(b"WebAppData", (bot_token or self.token).encode(), hashlib.sha256).digest()
        check = "\n".join(f"{key}={fields[key]}" for key in sorted(fields))
        fields["hash"] = hmac.new(secret, check.encode(), hashlib.sha256).hexdigest()
        return urlencode(fields)

    # ----------------------------------------------------------------- lifecycle

    @property
    def base_url(self) -> str:
        if not self._port:
            raise RuntimeError("the fake is not started")
        return f"http://127.0.0.1:{self._port}"

    async def start(self) -> None:
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_route("*", "/bot{token}/{method}", self._handle)
        app.router.add_get("/file/bot{token}/{path:.+}", self._download)
        # A short shutdown grace and cancelled handlers: an open long poll must not hold teardown.
        runner = web.AppRunner(app, shutdown_timeout=0.5, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self._runner = runner
        address = runner.addresses[0]
        self._port = int(address[1])

    async def stop(self) -> None:
        self._stopping = True
        self._stopped.set()
        self._notify()
        if self._webhook is not None and self._webhook.task is not None:
            self._webhook.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._webhook.task
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ----------------------------------------------------------------- test helpers

    def script(self, method: str, *faults: Fault) -> None:
        """Queue ``faults`` for the next calls of ``method`` (case-insensitive, like the API)."""
        self._faults.setdefault(method.lower(), deque()).extend(faults)

    def unscript(self, method: str) -> None:
        """Drop the faults still queued for ``method``: the platform answers it again."""
        self._faults.pop(method.lower(), None)

    def calls_to(self, method: str) -> list[FakeCall]:
        return [call for call in self.calls if call.method.lower() == method.lower()]

    def messages(self, chat_id: int) -> list[FakeMessage]:
        return list(self._chats.get(chat_id, {}).values())

    def message(self, chat_id: int, message_id: int | str) -> FakeMessage:
        return self._chats[chat_id][int(message_id)]

    def bot_messages(self, chat_id: int) -> list[FakeMessage]:
        return [message for message in self.messages(chat_id) if message.from_bot]

    @property
    def pending_updates(self) -> int:
        return len(self._updates)

    @property
    def webhook_url(self) -> str:
        return self._webhook.url if self._webhook else ""

    async def wait_until(self, predicate: Callable[[], bool], *, timeout: float = 5.0) -> None:
        """Wait until ``predicate()`` holds, re-checking on every change the fake sees."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate():
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise AssertionError(f"condition not met within {timeout} s")
            with contextlib.suppress(TimeoutError):
                await self._changed(remaining)

    async def wait_for_call(
        self, method: str, *, count: int = 1, answered: bool = True, timeout: float = 5.0
    ) -> FakeCall:
        """The ``count``-th call of ``method`` (answered, unless ``answered=False``)."""

        def ready() -> bool:
            calls = self.calls_to(method)
            return len(calls) >= count and (not answered or calls[count - 1].status is not None)

        await self.wait_until(ready, timeout=timeout)
        return self.calls_to(method)[count - 1]

    async def wait_for_answer(self, query_id: str, *, timeout: float = 5.0) -> JsonDict:
        await self.wait_until(lambda: query_id in self.callback_answers, timeout=timeout)
        return self.callback_answers[query_id]

    def push_message(
        self,
        chat_id: int,
        user_id: int,
        text: str,
        *,
        username: str | None = None,
        first_name: str | None = None,
        is_bot: bool = False,
        thread_id: int | None = None,
        entities: list[JsonDict] | None = None,
        reply_to: int | str | None = None,
        on_behalf_of: int | None = None,
    ) -> int:
        """A user's message arrives in ``chat_id`` (a reply to ``reply_to`` when given); returns its message id.
        ``on_behalf_of``: sent on behalf of that chat, as Telegram sends it: ``sender_chat`` is the chat and
        ``from`` a fake user (GroupAnonymousBot for the group's own anonymous admins, "Telegram" for a channel)."""
        user: JsonDict = {"id": user_id, "is_bot": is_bot, "first_name": first_name or f"User {user_id}"}
        if username:
            user["username"] = username
        sender_chat: JsonDict | None = None
        if on_behalf_of is not None:
            sender_chat = self._chat_json(on_behalf_of, kind=None if on_behalf_of == chat_id else "channel")
            user = (
                {"id": 1087968824, "is_bot": True, "first_name": "Group", "username": "GroupAnonymousBot"}
                if on_behalf_of == chat_id
                else {"id": 777000, "is_bot": False, "first_name": "Telegram"}
            )
        message = FakeMessage(
            chat_id=chat_id,
            message_id=self._new_message_id(chat_id),
            text=text,
            entities=command_and_mention_entities(text) if entities is None else entities,
            source=text,
            parse_mode=None,
            reply_markup=None,
            sender=user,
            date=int(time.time()),
            thread_id=thread_id,
            reply_to=None if reply_to is None else int(reply_to),
            sender_chat=sender_chat,
        )
        self._store(message)
        self._push_update({"message": self._message_json(message)})
        return message.message_id

    def add_file(self, data: bytes) -> tuple[str, str]:
        """Store ``data`` as Telegram would; (file_id, file_unique_id)."""
        n = next(self._file_ids)
        file_id = f"BQACAgIAAx{n:08d}"
        self.files[file_id] = data
        return file_id, f"AgAD{n:06d}"

    def push_file(
        self,
        chat_id: int,
        user_id: int,
        name: str,
        data: bytes,
        *,
        caption: str = "",
        photo: bool = False,
        declared_size: int | None = None,
        reply_to: int | None = None,
    ) -> int:
        """A user sends a document (or a photo) with an optional caption (a reply to ``reply_to`` when given);
        returns the message id."""
        file_id, unique = self.add_file(data)
        size = len(data) if declared_size is None else declared_size
        user: JsonDict = {"id": user_id, "is_bot": False, "first_name": f"User {user_id}"}
        message = FakeMessage(
            chat_id=chat_id,
            message_id=self._new_message_id(chat_id),
            text=caption,
            entities=command_and_mention_entities(caption),
            source=caption,
            parse_mode=None,
            reply_markup=None,
            sender=user,
            date=int(time.time()),
            reply_to=reply_to,
        )
        if photo:
            message.photo = [
                {"file_id": file_id + "s", "file_unique_id": unique + "s", "width": 90, "height": 60, "file_size": 10},
                {"file_id": file_id, "file_unique_id": unique, "width": 800, "height": 600, "file_size": size},
            ]
            self.files[file_id + "s"] = b"thumb"
        else:
            message.document = {
                "file_id": file_id,
                "file_unique_id": unique,
                "file_name": name,
                "mime_type": "application/octet-stream",
                "file_size": size,
            }
        self._store(message)
        self._push_update({"message": self._message_json(message)})
        return message.message_id

    def documents(self, chat_id: int) -> list[tuple[FakeMessage, bytes]]:
        """Files the bot posted into ``chat_id``, with their content."""
        return [
            (m, self.files[m.document["file_id"]])
            for m in self.messages(chat_id)
            if m.from_bot and m.document is not None
        ]

    def migrate_chat(self, old: int, new: int, *, user_id: int = 111) -> None:
        """The group ``old`` becomes the supergroup ``new`` (as when the bot is made an admin in it).

        As on Telegram: a service message with ``migrate_to_chat_id`` arrives in the old chat and one with
        ``migrate_from_chat_id`` in the new one, and from then on sending to the old id is refused with
        400 "group chat was upgraded to a supergroup chat" carrying ``parameters.migrate_to_chat_id``.
        """
        self.migrated[old] = new
        user: JsonDict = {"id": user_id, "is_bot": False, "first_name": f"User {user_id}"}
        now = int(time.time())
        self._push_update(
            {
                "message": {
                    "message_id": self._new_message_id(old),
                    "date": now,
                    "chat": self._chat_json(old, kind="group"),
                    "from": user,
                    "migrate_to_chat_id": new,
                }
            }
        )
        self._push_update(
            {
                "message": {
                    "message_id": self._new_message_id(new),
                    "date": now,
                    "chat": self._chat_json(new, kind="supergroup"),
                    "from": user,
                    "migrate_from_chat_id": old,
                }
            }
        )

    def push_callback(
        self, chat_id: int, message_id: int | str, user_id: int, data: str, *, username: str | None = None
    ) -> str:
        """A user presses a button carrying ``data`` on message ``message_id``; returns the query id."""
        query_id = str(next(self._query_ids))
        user: JsonDict = {"id": user_id, "is_bot": False, "first_name": f"User {user_id}"}
        if username:
            user["username"] = username
        stored = self._chats.get(chat_id, {}).get(int(message_id))
        if stored is not None:
            # The message as it is now, its buttons included: Telegram does not check that ``data`` is one of
            # them (a modified client sends any data), so neither does the fake.
            message = self._message_json(stored)
        else:  # a message the fake never saw: one that shows the pressed button
            message = {
                "message_id": int(message_id),
                "date": int(time.time()),
                "chat": self._chat_json(chat_id),
                "reply_markup": {"inline_keyboard": [[{"text": "button", "callback_data": data}]]},
            }
        self._open_queries.add(query_id)
        self._push_update(
            {
                "callback_query": {
                    "id": query_id,
                    "from": user,
                    "message": message,
                    "chat_instance": str(-chat_id),
                    "data": data,
                }
            }
        )
        return query_id

    # ----------------------------------------------------------------- internals

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _changed(self, timeout: float | None) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        await asyncio.wait_for(waiter, timeout)

    def _new_message_id(self, chat_id: int) -> int:
        message_id = self._next_message_id.get(chat_id, 1)
        self._next_message_id[chat_id] = message_id + 1
        return message_id

    def _store(self, message: FakeMessage) -> None:
        self._chats.setdefault(message.chat_id, {})[message.message_id] = message
        self._notify()

    def _push_update(self, body: JsonDict) -> None:
        self._updates.append({"update_id": next(self._update_ids), **body})
        self._notify()

    @staticmethod
    def _chat_json(chat_id: int, *, kind: str | None = None) -> JsonDict:
        if chat_id > 0:
            return {"id": chat_id, "type": "private", "first_name": f"User {chat_id}"}
        kind = kind or ("supergroup" if str(chat_id).startswith("-100") else "group")
        return {"id": chat_id, "type": kind, "title": f"Group {chat_id}"}

    def _not_migrated(self, chat_id: int) -> int:
        new = self.migrated.get(chat_id)
        if new is not None:
            raise ApiError(
                400, "Bad Request: group chat was upgraded to a supergroup chat", {"migrate_to_chat_id": new}
            )
        return chat_id

    def _bot_user(self) -> JsonDict:
        return {"id": self.bot_id, "is_bot": True, "first_name": self.bot_name, "username": self.bot_username}

    def _message_json(self, message: FakeMessage) -> JsonDict:
        body: JsonDict = {
            "message_id": message.message_id,
            "date": message.date,
            "chat": self._chat_json(message.chat_id),
            "from": message.sender,
        }
        if message.sender_chat is not None:
            body["sender_chat"] = message.sender_chat
        if message.document is not None or message.photo is not None:
            if message.document is not None:
                body["document"] = message.document
            if message.photo is not None:
                body["photo"] = message.photo
            if message.text:
                body["caption"] = message.text
                if message.entities:
                    body["caption_entities"] = message.entities
        else:
            body["text"] = message.text
            if message.entities:
                body["entities"] = message.entities
        if message.reply_markup and "inline_keyboard" in message.reply_markup:
            # A Message carries only an inline keyboard: Telegram never returns a ForceReply or reply keyboard
            # markup it was sent with.
            body["reply_markup"] = message.reply_markup
        if message.thread_id is not None:
            body["message_thread_id"] = message.thread_id
            body["is_topic_message"] = True
        if message.edits:
            body["edit_date"] = int(time.time())
        if message.reply_to is not None:
            replied = self._chats.get(message.chat_id, {}).get(message.reply_to)
            if replied is not None:
                body["reply_to_message"] = self._message_json(replied)
        return body

    async def _handle(self, request: web.Request) -> web.Response:
        method = request.match_info["method"]
        params = await _read_params(request)
        call = FakeCall(seq=next(self._seq), method=method, params=params, at=time.monotonic())
        self.calls.append(call)
        self._notify()
        try:
            if request.match_info["token"] != self.token:
                raise ApiError(401, "Unauthorized")
            if self.latency:
                await asyncio.sleep(self.latency)
            queue = self._faults.get(method.lower())
            held = queue.popleft() if queue and queue[0].kind == "answer_held" else None
            if queue and held is None:
                await self._apply_fault(queue.popleft())
            handler = self._methods().get(method.lower())
            if handler is None:
                raise ApiError(404, "Not Found")
            result = await handler(params)
            if held is not None and held.release is not None:
                await held.release.wait()
        except ApiError as error:
            body: JsonDict = {"ok": False, "error_code": error.status, "description": error.description}
            if error.parameters:
                body["parameters"] = error.parameters
            return self._answer(call, error.status, body)
        return self._answer(call, 200, {"ok": True, "result": result})

    def _answer(self, call: FakeCall, status: int, body: JsonDict) -> web.Response:
        call.status = status
        call.response = body
        self._notify()
        return web.json_response(body, status=status)

    async def _apply_fault(self, fault: Fault) -> None:
        if fault.kind == "hang":
            await self._stopped.wait()
            raise ApiError(503, "Service Unavailable: the fake stopped")
        if fault.release is not None:
            await fault.release.wait()
        if fault.kind == "retry_after":
            raise ApiError(
                429,
                f"Too Many Requests: retry after {fault.retry_after}",
                {"retry_after": fault.retry_after},
            )
        raise ApiError(fault.status, fault.description)

    def _methods(self) -> dict[str, Callable[[JsonDict], Any]]:
        return {
            "getme": self._get_me,
            "getupdates": self._get_updates,
            "deletewebhook": self._delete_webhook,
            "setwebhook": self._set_webhook,
            "getwebhookinfo": self._get_webhook_info,
            "setmycommands": self._set_my_commands,
            "getmycommands": self._get_my_commands,
            "deletemycommands": self._delete_my_commands,
            "sendmessage": self._send_message,
            "editmessagetext": self._edit_message_text,
            "editmessagereplymarkup": self._edit_message_reply_markup,
            "answercallbackquery": self._answer_callback_query,
            "senddocument": self._send_document,
            "sendchataction": self._send_chat_action,
            "getfile": self._get_file,
            "getchat": self._get_chat,
            "getchatmember": self._get_chat_member,
            "close": self._true,
            "logout": self._true,
        }

    # ----------------------------------------------------------------- methods

    async def _true(self, params: JsonDict) -> bool:
        return True

    def _bot_member(self, chat_id: int) -> JsonDict:
        return {"status": "member", **self.bot_membership.get(chat_id, {})}

    async def _get_chat(self, params: JsonDict) -> JsonDict:
        chat_id = int(params["chat_id"])
        if self._bot_member(chat_id)["status"] in ("left", "kicked"):
            raise ApiError(400, "Bad Request: chat not found")
        kind = "channel" if chat_id in self.channels else ("supergroup" if chat_id < 0 else "private")
        return {"id": chat_id, "type": kind, "title": f"Group {chat_id}"}

    async def _get_chat_member(self, params: JsonDict) -> JsonDict:
        chat_id, user_id = int(params["chat_id"]), int(params["user_id"])
        if user_id != self.bot_id:
            return {"status": "member", "user": {"id": user_id, "is_bot": False, "first_name": "someone"}}
        if self._bot_member(chat_id)["status"] == "kicked":
            raise ApiError(400, "Bad Request: chat not found")
        return {**self._bot_member(chat_id), "user": self._bot_user()}

    async def _get_me(self, params: JsonDict) -> JsonDict:
        return {
            **self._bot_user(),
            "can_join_groups": True,
            "can_read_all_group_messages": False,
            "supports_inline_queries": False,
        }

    async def _get_updates(self, params: JsonDict) -> list[JsonDict]:
        if self._webhook is not None:
            raise ApiError(
                409,
                "Conflict: can't use getUpdates method while webhook is active; use deleteWebhook to delete "
                "the webhook first",
            )
        offset = int(params.get("offset") or 0)
        timeout = float(params.get("timeout") or 0)
        limit = max(1, min(int(params.get("limit") or 100), 100))
        if offset:
            self._updates = [update for update in self._updates if update["update_id"] >= offset]
        # As on Telegram, a newer poll ends an older one with 409: one bot, one poller.
        self._poll_generation += 1
        generation = self._poll_generation
        self._notify()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if generation != self._poll_generation:
                raise ApiError(
                    409,
                    "Conflict: terminated by other getUpdates request; make sure that only one bot instance is running",
                )
            if self._updates or self._stopping:
                return self._updates[:limit]
            remaining = deadline - loop.time()
            if remaining <= 0:
                return []
            with contextlib.suppress(TimeoutError):
                await self._changed(remaining)

    async def _delete_webhook(self, params: JsonDict) -> bool:
        if params.get("drop_pending_updates"):
            self._updates.clear()
        await self._drop_webhook()
        return True

    async def _drop_webhook(self) -> None:
        webhook, self._webhook = self._webhook, None
        if webhook is not None and webhook.task is not None:
            webhook.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await webhook.task
        self._notify()

    async def _set_webhook(self, params: JsonDict) -> bool:
        url = str(params.get("url") or "")
        secret = str(params.get("secret_token") or "")
        if secret and not SECRET_TOKEN.match(secret):
            raise ApiError(400, "Bad Request: secret token contains unallowed characters")
        await self._drop_webhook()
        if params.get("drop_pending_updates"):
            self._updates.clear()
        if not url:
            return True
        if not url.startswith(("http://", "https://")):
            raise ApiError(400, "Bad Request: bad webhook: An HTTPS URL must be provided for webhook")
        webhook = _Webhook(url=url, secret_token=secret)
        webhook.task = asyncio.create_task(self._deliver_webhook(webhook), name="fake-telegram-webhook")
        self._webhook = webhook
        return True

    async def _get_webhook_info(self, params: JsonDict) -> JsonDict:
        return {
            "url": self.webhook_url,
            "has_custom_certificate": False,
            "pending_update_count": len(self._updates),
        }

    async def _deliver_webhook(self, webhook: _Webhook) -> None:
        """POST pending updates in order, as Telegram does, retrying one that is refused."""
        headers = {"X-Telegram-Bot-Api-Secret-Token": webhook.secret_token} if webhook.secret_token else {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while not self._stopping:
                if not self._updates:
                    with contextlib.suppress(TimeoutError):
                        await self._changed(None)
                    continue
                update = self._updates[0]
                try:
                    async with session.post(webhook.url, json=update, headers=headers) as response:
                        delivered = response.status < 300
                except (aiohttp.ClientError, TimeoutError):
                    delivered = False
                if delivered:
                    if self._updates and self._updates[0] is update:
                        self._updates.pop(0)
                    self.webhook_deliveries.append(update)
                    self._notify()
                else:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stopped.wait(), 0.2)

    async def _set_my_commands(self, params: JsonDict) -> bool:
        commands = params.get("commands")
        if not isinstance(commands, list) or len(commands) > 100:
            raise ApiError(400, "Bad Request: can't parse commands JSON object")
        for command in commands:
            name = command.get("command", "") if isinstance(command, dict) else ""
            description = command.get("description", "") if isinstance(command, dict) else ""
            if not re.fullmatch(r"[a-z0-9_]{1,32}", name) or not 1 <= len(description) <= 256:
                raise ApiError(400, "Bad Request: BOT_COMMAND_INVALID")
        self.commands = commands
        return True

    async def _get_my_commands(self, params: JsonDict) -> list[JsonDict]:
        return self.commands

    async def _delete_my_commands(self, params: JsonDict) -> bool:
        self.commands = []
        return True

    async def _send_message(self, params: JsonDict) -> JsonDict:
        chat_id = self._not_migrated(_chat_id(params))
        if chat_id in self.not_started:
            raise ApiError(403, "Forbidden: bot can't initiate conversation with a user")
        text, entities, dropped = _message_text(params)
        markup = _reply_markup(params.get("reply_markup"), chat_id)
        thread = params.get("message_thread_id")
        message = FakeMessage(
            chat_id=chat_id,
            message_id=self._new_message_id(chat_id),
            text=text,
            entities=entities,
            source=str(params.get("text")),
            parse_mode=params.get("parse_mode") or None,
            reply_markup=markup,
            sender=self._bot_user(),
            date=int(time.time()),
            thread_id=int(thread) if thread else None,
            dropped_entities=dropped,
        )
        self._store(message)
        return self._message_json(message)

    async def _send_document(self, params: JsonDict) -> JsonDict:
        chat_id = self._not_migrated(_chat_id(params))
        upload = params.get("document")
        if not isinstance(upload, dict) or "content" not in upload:
            raise ApiError(400, "Bad Request: there is no document in the request")
        data: bytes = upload["content"]
        if not data:
            raise ApiError(400, "Bad Request: file must be non-empty")
        caption = str(params.get("caption") or "")
        if utf16_len(caption) > CAPTION_LIMIT:
            raise ApiError(400, "Bad Request: message caption is too long")
        file_id, unique = self.add_file(data)
        thread = params.get("message_thread_id")
        message = FakeMessage(
            chat_id=chat_id,
            message_id=self._new_message_id(chat_id),
            text=caption,
            entities=[],
            source=caption,
            parse_mode=params.get("parse_mode") or None,
            reply_markup=None,
            sender=self._bot_user(),
            date=int(time.time()),
            thread_id=int(thread) if thread else None,
            document={
                "file_id": file_id,
                "file_unique_id": unique,
                "file_name": upload.get("filename") or "document",
                "file_size": len(data),
            },
        )
        self._store(message)
        return self._message_json(message)

    async def _send_chat_action(self, params: JsonDict) -> bool:
        chat_id = self._not_migrated(_chat_id(params))
        action = str(params.get("action") or "")
        if action not in CHAT_ACTIONS:
            raise ApiError(400, "Bad Request: wrong parameter action in request")
        self.chat_actions.append({"chat_id": chat_id, "action": action, "at": time.monotonic(),
                                  "message_thread_id": params.get("message_thread_id")})  # fmt: skip
        self._notify()
        return True

    async def _get_file(self, params: JsonDict) -> JsonDict:
        file_id = str(params.get("file_id") or "")
        data = self.files.get(file_id)
        if data is None:
            raise ApiError(400, "Bad Request: invalid file_id")
        if len(data) > self.file_size_limit:
            raise ApiError(400, "Bad Request: file is too big")
        return {"file_id": file_id, "file_unique_id": "u" + file_id[-8:], "file_size": len(data),
                "file_path": f"documents/file_{file_id}"}  # fmt: skip

    async def _download(self, request: web.Request) -> web.StreamResponse:
        if request.match_info["token"] != self.token:
            return web.Response(status=401)
        path = request.match_info["path"]
        data = self.files.get(path.removeprefix("documents/file_"))
        if data is None:
            return web.Response(status=404)
        return web.Response(body=data, content_type="application/octet-stream")

    def _editable(self, params: JsonDict) -> FakeMessage:
        if params.get("inline_message_id"):
            raise ApiError(400, "Bad Request: MESSAGE_ID_INVALID")
        chat_id = self._not_migrated(_chat_id(params))
        try:
            message_id = int(params.get("message_id") or 0)
        except (TypeError, ValueError):
            raise ApiError(400, "Bad Request: message identifier is not specified") from None
        message = self._chats.get(chat_id, {}).get(message_id)
        if message is None:
            raise ApiError(400, "Bad Request: message to edit not found")
        if not message.from_bot:
            raise ApiError(400, "Bad Request: message can't be edited")
        return message

    async def _edit_message_text(self, params: JsonDict) -> JsonDict:
        message = self._editable(params)
        text, entities, dropped = _message_text(params)
        # Telegram drops an inline keyboard that an edit does not send again.
        markup = _reply_markup(params.get("reply_markup"), message.chat_id)
        if (text, entities, markup) == (message.text, message.entities, message.reply_markup):
            raise ApiError(400, NOT_MODIFIED)
        message.text, message.entities, message.reply_markup = text, entities, markup
        message.source = str(params.get("text"))
        message.parse_mode = params.get("parse_mode") or None
        message.dropped_entities = dropped
        message.edits += 1
        self._notify()
        return self._message_json(message)

    async def _edit_message_reply_markup(self, params: JsonDict) -> JsonDict:
        message = self._editable(params)
        markup = _reply_markup(params.get("reply_markup"), message.chat_id)
        if markup == message.reply_markup:
            raise ApiError(400, NOT_MODIFIED)
        message.reply_markup = markup
        message.edits += 1
        self._notify()
        return self._message_json(message)

    async def _answer_callback_query(self, params: JsonDict) -> bool:
        query_id = str(params.get("callback_query_id") or "")
        if query_id not in self._open_queries:
            raise ApiError(400, QUERY_TOO_OLD)
        text = params.get("text")
        if text is not None and len(str(text)) > ANSWER_TEXT_LIMIT:
            raise ApiError(400, "Bad Request: MESSAGE_TOO_LONG")
        self._open_queries.discard(query_id)
        self.callback_answers[query_id] = {
            "text": text,
            "show_alert": bool(params.get("show_alert", False)),
            "url": params.get("url"),
            "cache_time": params.get("cache_time"),
        }
        self._notify()
        return True


# --------------------------------------------------------------------------- request parsing and checks


def _convert(name: str, value: str) -> Any:
    if name in _STRING_FIELDS:
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


async def _read_params(request: web.Request) -> JsonDict:
    """PTB posts forms whose values are JSON text (``reply_markup`` is a string); others post JSON."""
    params: JsonDict = {key: _convert(key, value) for key, value in request.query.items()}
    if request.content_type == "application/json":
        raw = await request.read()
        if raw:
            body = json.loads(raw)
            if isinstance(body, dict):
                params.update(body)
    elif request.content_type in ("application/x-www-form-urlencoded", "multipart/form-data"):
        form = await request.post()
        for key, value in form.items():
            if isinstance(value, str):
                params[key] = _convert(key, value)
            elif isinstance(value, web.FileField):  # an uploaded file: its name and its bytes
                params[key] = {"filename": value.filename, "content": value.file.read()}
            else:
                params[key] = {"filename": None, "content": bytes(value)}
    return params


def _chat_id(params: JsonDict) -> int:
    value = params.get("chat_id")
    if isinstance(value, bool) or not isinstance(value, int | str) or value == "":
        raise ApiError(400, "Bad Request: chat_id is empty")
    try:
        return int(value)
    except ValueError:
        raise ApiError(400, "Bad Request: chat not found") from None


def _message_text(params: JsonDict) -> tuple[str, list[JsonDict], int]:
    """Visible text, the entities Telegram keeps, and how many it silently dropped."""
    raw = params.get("text")
    source = "" if raw is None else str(raw)
    mode = str(params.get("parse_mode") or "")
    if mode.lower() == "html":
        try:
            text, entities = parse_html(source)
        except HtmlError as exc:
            raise ApiError(400, f"Bad Request: can't parse entities: {exc}") from None
    elif mode:
        raise ApiError(400, f"Bad Request: unsupported parse_mode {mode!r} in the fake")
    else:
        text = source
        given = params.get("entities")
        entities = given if isinstance(given, list) else []
    if not text.strip():
        raise ApiError(400, "Bad Request: message text is empty")
    if utf16_len(text) > TEXT_LIMIT:
        raise ApiError(400, "Bad Request: message is too long")
    return text, entities[:ENTITY_LIMIT], max(0, len(entities) - ENTITY_LIMIT)


def _reply_markup(raw: Any, chat_id: int) -> JsonDict | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ApiError(400, "Bad Request: can't parse reply keyboard markup JSON object")
    if "inline_keyboard" not in raw:
        return raw
    rows = raw["inline_keyboard"]
    if not isinstance(rows, list) or not all(isinstance(row, list) for row in rows):
        raise ApiError(400, "Bad Request: can't parse inline keyboard markup JSON object")
    for row in rows:
        for button in row:
            if not isinstance(button, dict) or not str(button.get("text") or ""):
                raise ApiError(400, "Bad Request: can't parse inline keyboard button: Text must be non-empty")
            if "callback_data" in button:
                size = len(str(button["callback_data"]).encode("utf-8"))
                if not 1 <= size <= CALLBACK_DATA_LIMIT:
                    raise ApiError(400, "Bad Request: BUTTON_DATA_INVALID")
            elif "web_app" in button:
                # An inline Web App button opens a Mini App in a private chat with the bot only, over HTTPS.
                if chat_id <= 0:
                    raise ApiError(400, "Bad Request: BUTTON_TYPE_INVALID")
                url = str((button.get("web_app") or {}).get("url") or "")
                if not url.startswith("https://"):
                    raise ApiError(
                        400,
                        f"Bad Request: inline keyboard button Web App URL '{url}' is invalid: Only HTTPS links are "
                        "allowed",
                    )
            elif not any(key in button for key in ("url", "login_url", "switch_inline_query", "web_app", "pay")):
                raise ApiError(
                    400,
                    "Bad Request: can't parse inline keyboard button: Text buttons are unallowed in the "
                    "inline keyboard",
                )
    if not any(rows):
        return None  # an empty keyboard is no keyboard
    return raw
