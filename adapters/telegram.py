"""The Telegram adapter on python-telegram-bot.

PTB's ``Application`` and ``Updater`` run inside our own event loop (no
``run_polling``), so start and stop are ordinary awaits the composition root
controls. Updates are processed one at a time by PTB, which keeps each chat's
messages in order; our update callbacks therefore only hand work off (a per-chat
inbox for messages, a task per button press) and never run the engine inline.

Everything the card shows comes from tools and models, so every piece of it is
escaped for Telegram's HTML parse mode and the whole message is measured the way
Telegram measures it (UTF-16 units of the visible text) before it is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import html
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final, TypeVar

import structlog
from telegram import (
    BotCommand,
    CallbackQuery,
    Chat,
    InlineKeyboardButton,
    InlineKeyboardMarkup,
    LinkPreviewOptions,
    Message,
    Update,
)
from telegram.constants import ChatType, MessageEntityType, ParseMode
from telegram.error import (
    BadRequest,
    ChatMigrated,
    Conflict,
    Forbidden,
    InvalidToken,
    NetworkError,
    RetryAfter,
    TelegramError,
    TimedOut,
)
from telegram.ext import Application, ApplicationBuilder, CallbackQueryHandler, ContextTypes, MessageHandler, filters
from telegram.request import HTTPXRequest

from kazma.adapters.contract import CardRef, Handlers, Inbound, PlatformError
from kazma.adapters.ratelimit import ChatRateLimiter
from kazma.adapters.text import (
    APPROVE_LABEL,
    DENY_LABEL,
    agent_prefix,
    cut_marker,
    deadline_text,
    outcome_line,
    overflow_notice,
)
from kazma.approvals.card import ApprovalCard, CardArgument
from kazma.approvals.model import Decision, Outcome, PressResult, PressVerdict
from kazma.config.metrics import count_failure
from kazma.config.models import TelegramConfig

PLATFORM: Final = "telegram"
TEXT_LIMIT: Final = 4096  # UTF-16 units of visible text, as Telegram counts after parsing
CARD_BUDGET: Final = 4000  # below TEXT_LIMIT so a rounding difference on Telegram's side cannot reject a card
CALLBACK_DATA_LIMIT: Final = 64  # bytes
ANSWER_LIMIT: Final = 200  # characters of an answerCallbackQuery text
MAX_ENTITIES: Final = 100  # Telegram silently drops formatting past the 100th entity of a message
MIN_EXCERPT: Final = 24  # shortest head + tail a shrunk value keeps
INLINE_VALUE_MAX: Final = 60  # longer values (or any with a newline) go in a <pre> block
PRESS_PENDING_TEXT: Final = "Recorded, updating…"
SWARM_COMMAND: Final = "swarm"

_log = structlog.get_logger(__name__)
_T = TypeVar("_T")
_NO_PREVIEW: Final = LinkPreviewOptions(is_disabled=True)

AnyApplication = Application[Any, Any, Any, Any, Any, Any]


def utf16_len(text: str) -> int:
    """Length as Telegram counts it: UTF-16 code units."""
    return len(text.encode("utf-16-le")) // 2


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# --------------------------------------------------------------------------- card rendering


class CardTooLarge(ValueError):
    """Not even every argument name fits in one Telegram message."""


@dataclass(frozen=True)
class RenderedCard:
    html: str
    visible_length: int  # UTF-16 units after Telegram parses the HTML
    with_values: int  # arguments shown with (a possibly shrunk excerpt of) their value
    names_only: int  # arguments listed by name only, under the overflow notice
    entities: int  # formatting entities Telegram will create


class _Html:
    """HTML for Telegram, built from escaped pieces, counting the visible text as it goes."""

    def __init__(self) -> None:
        self._parts: list[str] = []
        self.visible = 0
        self.entities = 0

    def text(self, value: str) -> None:
        self._parts.append(html.escape(value))
        self.visible += utf16_len(value)

    def tag(self, tag: str, value: str) -> None:
        self._parts.append(f"<{tag}>{html.escape(value)}</{tag}>")
        self.visible += utf16_len(value)
        self.entities += 1

    @property
    def markup(self) -> str:
        return "".join(self._parts)


def _excerpt(arg: CardArgument, limit: int | None) -> CardArgument:
    """``arg`` with at most ``limit`` characters of value, keeping both ends and the true length."""
    if limit is None or len(arg.head) + len(arg.tail) <= limit:
        return arg
    if not arg.cut:
        value = arg.head
        tail_len = max(limit // 3, 1)
        head_len = limit - tail_len
        return CardArgument(arg.name, value[:head_len], value[-tail_len:], True, arg.original_length)
    tail_len = min(len(arg.tail), max(limit // 3, 1))
    head_len = min(len(arg.head), limit - tail_len)
    tail_len = min(len(arg.tail), limit - head_len)
    tail = arg.tail[len(arg.tail) - tail_len :]
    return CardArgument(arg.name, arg.head[:head_len], tail, True, arg.original_length)


def _argument(out: _Html, arg: CardArgument, *, lean: bool) -> None:
    out.text("\n• ")
    if lean:  # plain name: one entity fewer per argument when the entity cap binds
        out.text(arg.name)
    else:
        out.tag("b", arg.name)
    if arg.cut:
        # The tail is shown as prominently as the head: a harmless start must not hide a destructive end.
        out.text(":\n")
        out.tag("pre", arg.head)
        out.text("\n")
        out.tag("i", cut_marker(arg))
        out.text("\n")
        out.tag("pre", arg.tail)
    elif not arg.head:
        out.text(": ")
        out.tag("i", "(empty)")
    elif "\n" in arg.head or len(arg.head) > INLINE_VALUE_MAX:
        out.text(":\n")
        out.tag("pre", arg.head)
    else:
        out.text(": ")
        out.tag("code", arg.head)


def _layout(card: ApprovalCard, outcome: Outcome | None, limit: int | None, shown: int, *, lean: bool) -> _Html:
    out = _Html()
    if outcome is not None:
        out.tag("b", outcome_line(outcome))
        out.text("\n\n")
    out.tag("b", card.title)
    out.text("\nTool: ")
    out.tag("code", card.tool)
    out.text("\nRequested by: ")
    out.tag("code", card.requester)
    out.text("\nFrom: ")
    out.tag("code", card.origin)
    out.text(f"\nDeadline: {deadline_text(card)}\nArguments SHA-256: ")
    out.tag("code", card.args_hash)
    total = len(card.arguments)
    out.text(f"\n\nArguments ({total}):")
    for arg in card.arguments[:shown]:
        _argument(out, _excerpt(arg, limit), lean=lean)
    if shown < total:
        out.text(f"\n\nListed by name only ({total - shown}):")
        for arg in card.arguments[shown:]:
            out.text(f"\n• {arg.name}")  # names have no line breaks (checked when the card is built)
        out.text("\n\n")
        out.tag("i", overflow_notice(card, shown))  # carries the link
    else:
        out.text(f"\n\nFull call: {card.link}")
    return out


def render_card(
    card: ApprovalCard,
    *,
    outcome: Outcome | None = None,
    budget: int = CARD_BUDGET,
    max_entities: int = MAX_ENTITIES,
) -> RenderedCard:
    """The card as Telegram HTML within ``budget`` visible UTF-16 units and ``max_entities`` entities.

    Values shrink evenly (every value gets the same excerpt length, both ends kept,
    the cut marked with the true length) until the card fits. When even the
    shortest excerpts do not fit, as many arguments as fit keep an excerpt and the
    rest are listed by name under the overflow notice; no name is ever dropped.
    Argument names lose their bold before any argument loses its value to the entity cap.
    """
    best: RenderedCard | None = None
    for lean in (False, True):
        try:
            candidate = _fit(card, outcome, budget, max_entities, lean=lean)
        except CardTooLarge:
            continue
        if best is None or candidate.with_values > best.with_values:
            best = candidate
        if best.names_only == 0:
            break
    if best is None:
        raise CardTooLarge(
            f"the names of all {len(card.arguments)} arguments do not fit in one Telegram message; "
            "the call cannot be shown faithfully here"
        )
    return best


def _fit(card: ApprovalCard, outcome: Outcome | None, budget: int, max_entities: int, *, lean: bool) -> RenderedCard:
    total = len(card.arguments)

    def attempt(limit: int | None, shown: int) -> _Html | None:
        out = _layout(card, outcome, limit, shown, lean=lean)
        return out if out.visible <= budget and out.entities <= max_entities else None

    def done(out: _Html, shown: int) -> RenderedCard:
        return RenderedCard(out.markup, out.visible, shown, total - shown, out.entities)

    whole = attempt(None, total)
    if whole is not None:
        return done(whole, total)
    if total == 0 or attempt(MIN_EXCERPT, 0) is None:
        raise CardTooLarge("the card does not fit even with every argument listed by name only")

    shown = total
    if attempt(MIN_EXCERPT, total) is None:
        fits, overflows = 0, total  # attempt(MIN, fits) fits, attempt(MIN, overflows) does not
        while overflows - fits > 1:
            middle = (fits + overflows) // 2
            if attempt(MIN_EXCERPT, middle) is not None:
                fits = middle
            else:
                overflows = middle
        shown = fits

    longest = max(len(a.head) + len(a.tail) for a in card.arguments)
    best = attempt(longest, shown)
    if best is not None:
        return done(best, shown)
    low, high = MIN_EXCERPT, longest  # low fits, high does not
    best = attempt(low, shown)
    assert best is not None
    while high - low > 1:
        middle = (low + high) // 2
        candidate = attempt(middle, shown)
        if candidate is not None:
            low, best = middle, candidate
        else:
            high = middle
    return done(best, shown)


def card_keyboard(card: ApprovalCard) -> InlineKeyboardMarkup:
    return InlineKeyboardMarkup(
        [
            [
                InlineKeyboardButton(APPROVE_LABEL, callback_data=card.button_data(Decision.APPROVE)),
                InlineKeyboardButton(DENY_LABEL, callback_data=card.button_data(Decision.DENY)),
            ]
        ]
    )


def split_text(text: str, limit: int = TEXT_LIMIT) -> list[str]:
    """Cut ``text`` into parts of at most ``limit`` UTF-16 units, preferring line then word breaks.

    Whitespace-only parts are dropped: Telegram trims messages and refuses empty ones.
    """
    if limit < 1:
        raise ValueError("limit must be positive")
    parts: list[str] = []
    rest = text
    while rest:
        if utf16_len(rest) <= limit:
            parts.append(rest)
            break
        units = 0
        end = 0
        for char in rest:
            units += 2 if ord(char) > 0xFFFF else 1
            if units > limit:
                break
            end += 1
        end = max(end, 1)  # a limit narrower than one character still makes progress
        window = rest[:end]
        cut = window.rfind("\n")
        if cut < end // 2:
            cut = max(window.rfind(" "), window.rfind("\t"))
        if cut >= end // 2 and cut > 0:
            parts.append(window[:cut])
            rest = rest[cut + 1 :]
        else:
            parts.append(window)
            rest = rest[end:]
    return [part for part in parts if part.strip()]


# --------------------------------------------------------------------------- errors


def _retry_after_seconds(exc: RetryAfter) -> float:
    # PTB 22 warns on every read of ``retry_after`` until PTB_TIMEDELTA is set; the value is what we need.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        value = exc.retry_after
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def _platform_error(site: str, exc: BaseException, *, token: str = "") -> PlatformError:
    error = _classify(site, exc)
    # PTB puts the token into some messages ("The token `…` was rejected"); it must not reach logs.
    if token and token in str(error):
        redacted = str(error).removeprefix(f"{PLATFORM} {site}: ").replace(token, "<token>")
        error = PlatformError(PLATFORM, site, redacted, retryable=error.retryable, retry_after=error.retry_after)
    return error


def _classify(site: str, exc: BaseException) -> PlatformError:
    if isinstance(exc, PlatformError):
        return exc
    if isinstance(exc, RetryAfter):
        seconds = _retry_after_seconds(exc)
        return PlatformError(PLATFORM, site, f"flood control: {exc}", retryable=True, retry_after=seconds)
    if isinstance(exc, ChatMigrated):
        return PlatformError(
            PLATFORM, site, f"chat migrated to {exc.new_chat_id}: update the configuration", retryable=False
        )
    # BadRequest is a NetworkError subclass in PTB: the request was refused, sending it again changes nothing.
    if isinstance(exc, BadRequest | Forbidden | InvalidToken):
        return PlatformError(PLATFORM, site, f"{type(exc).__name__}: {exc}", retryable=False)
    if isinstance(exc, TimedOut | NetworkError | Conflict):
        return PlatformError(PLATFORM, site, f"{type(exc).__name__}: {exc}", retryable=True)
    if isinstance(exc, TelegramError):
        return PlatformError(PLATFORM, site, f"{type(exc).__name__}: {exc}", retryable=False)
    # PTB raises RuntimeError when its HTTP client is closed under us (a stop racing a send).
    retryable = isinstance(exc, RuntimeError)
    return PlatformError(PLATFORM, site, f"{type(exc).__name__}: {exc}", retryable=retryable)


# --------------------------------------------------------------------------- the adapter


@dataclass
class _Inbox:
    queue: asyncio.Queue[Inbound | None]
    worker: asyncio.Task[None]


class TelegramAdapter:
    """Telegram on python-telegram-bot, long polling by default or a webhook when configured."""

    name = PLATFORM

    def __init__(
        self,
        config: TelegramConfig,
        *,
        limiter: ChatRateLimiter | None = None,
        request_timeout: float = 10.0,
        connect_timeout: float = 5.0,
        poll_timeout: float = 10.0,
        press_timeout: float = 2.0,
        max_attempts: int = 5,
        stop_grace: float = 5.0,
    ) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        self.config = config
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self.poll_timeout = poll_timeout
        self.press_timeout = press_timeout
        self.max_attempts = max_attempts
        self.stop_grace = stop_grace
        # Telegram allows about one message a second in any chat and twenty a minute in a group.
        self._group_limiter = limiter or ChatRateLimiter(min_interval=1.0, per_window=20, window=60.0)
        self._private_limiter = limiter or ChatRateLimiter(min_interval=1.0)
        self._served = frozenset(config.chats)
        self._admins = frozenset(config.admins)
        self._app: AnyApplication | None = None
        self._stopping = False
        self._handlers: Handlers | None = None
        self._bot_username = ""
        self._inboxes: dict[str, _Inbox] = {}
        self._tasks: set[asyncio.Future[Any]] = set()
        self._requests: tuple[HTTPXRequest, ...] = ()

    # ----------------------------------------------------------------- lifecycle

    @property
    def home_chat(self) -> str | None:
        return str(self.config.home_chat) if self.config.home_chat is not None else None

    @property
    def bot_username(self) -> str:
        """The bot's username (lowercase) once started; empty before."""
        return self._bot_username

    def limiter_for(self, chat: int) -> ChatRateLimiter:
        return self._group_limiter if chat < 0 else self._private_limiter

    def _build_application(self) -> AnyApplication:
        # We own the HTTP clients so that a start that fails half-way (PTB then considers itself
        # not initialised and its shutdown does nothing) can still close them.
        self._requests = tuple(
            HTTPXRequest(
                connection_pool_size=size,
                connect_timeout=self.connect_timeout,
                read_timeout=self.request_timeout,  # for getUpdates PTB adds the long-poll timeout on top
                write_timeout=self.request_timeout,
                pool_timeout=self.request_timeout,
            )
            for size in (64, 1)
        )
        general, polling = self._requests
        base = self.config.api_base_url
        return (
            ApplicationBuilder()
            .token(self.config.token)
            .base_url(f"{base}/bot")
            .base_file_url(f"{base}/file/bot")
            .request(general)
            .get_updates_request(polling)
            .build()
        )

    async def _close_requests(self) -> None:
        requests, self._requests = self._requests, ()
        for request in requests:
            with contextlib.suppress(Exception):
                await request.shutdown()

    async def start(self, handlers: Handlers) -> None:
        if self._app is not None:
            raise RuntimeError("the Telegram adapter is already started")
        app = self._build_application()
        app.add_handler(MessageHandler(filters.UpdateType.MESSAGE & (filters.TEXT | filters.CAPTION), self._on_message))
        app.add_handler(CallbackQueryHandler(self._on_callback_query))
        app.add_error_handler(self._on_error)
        self._handlers = handlers
        try:
            await app.initialize()  # getMe: a bad token or an unreachable server stops us here
            self._bot_username = (app.bot.username or "").lower()
            self._app = app  # from here a handler reacting to the first update can already reply
            await self._register_commands(app)
            await app.start()
            updater = app.updater
            if updater is None:  # pragma: no cover - ApplicationBuilder always makes one
                raise RuntimeError("python-telegram-bot built no updater")
            allowed = [Update.MESSAGE, Update.CALLBACK_QUERY]
            if self.config.mode == "webhook":
                hook = self.config.webhook
                await updater.start_webhook(
                    listen=hook.listen,
                    port=hook.port,
                    url_path=hook.path,
                    webhook_url=hook.url,
                    secret_token=hook.secret_token,
                    allowed_updates=allowed,
                )
            else:
                await updater.start_polling(
                    timeout=timedelta(seconds=int(self.poll_timeout)),
                    allowed_updates=allowed,
                    error_callback=self._on_poll_error,
                )
        except Exception as exc:
            self._app = None
            await self._abandon(app)
            await self._close_requests()
            self._handlers = None
            error = _platform_error("start", exc, token=self.config.token)
            count_failure("start", PLATFORM)
            _log.error("telegram.start_failed", error=str(error), retryable=error.retryable)
            raise error from exc
        _log.info("telegram.started", mode=self.config.mode, bot=self._bot_username, chats=sorted(self._served))

    async def _register_commands(self, app: AnyApplication) -> None:
        # Only a convenience (the command menu): a failure here must not keep the bus down.
        try:
            await app.bot.set_my_commands([BotCommand(SWARM_COMMAND, "Drive the agent swarm")])
        except TelegramError as exc:
            _log.warning("telegram.commands_not_set", error=str(exc))

    @staticmethod
    async def _abandon(app: AnyApplication) -> None:
        """Undo a partial start without masking the error that caused it."""
        with contextlib.suppress(Exception):
            if app.updater is not None and app.updater.running:
                await app.updater.stop()
        with contextlib.suppress(Exception):
            if app.running:
                await app.stop()
        with contextlib.suppress(Exception):
            await app.shutdown()

    async def stop(self) -> None:
        app = self._app
        if app is None or self._stopping:
            return
        self._stopping = True
        try:
            with contextlib.suppress(RuntimeError):
                if app.updater is not None and app.updater.running:
                    await app.updater.stop()
            with contextlib.suppress(RuntimeError):
                if app.running:
                    await app.stop()  # no update callback runs after this
            # The bot stays usable while queued work finishes: a handler may still reply.
            await self._drain()
            with contextlib.suppress(Exception):
                await app.shutdown()
            await self._close_requests()
        finally:
            self._app = None
            self._handlers = None
            self._stopping = False
        _log.info("telegram.stopped")

    async def _drain(self) -> None:
        """Let queued messages and running presses finish within the grace period, then cancel the rest."""
        inboxes, self._inboxes = list(self._inboxes.values()), {}
        for inbox in inboxes:
            inbox.queue.put_nowait(None)
        pending: set[asyncio.Future[Any]] = {inbox.worker for inbox in inboxes} | set(self._tasks)
        if not pending:
            return
        _done, late = await asyncio.wait(pending, timeout=self.stop_grace)
        for task in late:
            task.cancel()
        if late:
            _log.warning("telegram.stop_cancelled_work", tasks=len(late))
            await asyncio.wait(late)

    def _bot_app(self, site: str) -> AnyApplication:
        if self._app is None:
            count_failure(site, PLATFORM)
            raise PlatformError(PLATFORM, site, "the adapter is not started", retryable=True)
        return self._app

    # ----------------------------------------------------------------- inbound

    def _serves(self, chat: Chat) -> bool:
        if self._served:
            return chat.id in self._served
        return chat.type in (ChatType.GROUP, ChatType.SUPERGROUP)

    def normalise(self, message: Message) -> Inbound | None:
        """The neutral form of ``message``, or None when it is not for us."""
        chat = message.chat
        if not self._serves(chat):
            _log.debug("telegram.ignored_chat", chat=chat.id, chat_type=chat.type)
            return None
        text = message.text if message.text is not None else (message.caption or "")
        entities = message.parse_entities() if message.text is not None else message.parse_caption_entities()
        mentions: list[str] = []
        command: str | None = None
        body = text
        for entity, value in sorted(entities.items(), key=lambda item: item[0].offset):
            if entity.type == MessageEntityType.MENTION:
                name = value.removeprefix("@").lower()
                if name and name not in mentions:
                    mentions.append(name)
            elif entity.type == MessageEntityType.BOT_COMMAND and entity.offset == 0:
                word, _, target = value.removeprefix("/").partition("@")
                if word.lower() != SWARM_COMMAND:
                    continue
                if target and target.lower() != self._bot_username:
                    _log.debug("telegram.command_for_other_bot", chat=chat.id, target=target)
                    return None
                command = SWARM_COMMAND
                body = text[len(value) :].strip()
        user = message.from_user
        if user is not None:
            author = f"{PLATFORM}:{user.id}"
            author_name = user.full_name or (user.username or str(user.id))
            from_bot = user.is_bot
            is_admin = user.id in self._admins
        else:  # posted as a channel or anonymously: nobody we can authorise
            sender = message.sender_chat
            author = f"{PLATFORM}:{sender.id if sender else 'unknown'}"
            author_name = (sender.title or "") if sender else ""
            from_bot = False
            is_admin = False
        thread = str(message.message_thread_id) if message.is_topic_message and message.message_thread_id else None
        return Inbound(
            platform=PLATFORM,
            chat=str(chat.id),
            message_id=str(message.message_id),
            author=author,
            author_name=author_name,
            text=body,
            thread=thread,
            mentions=tuple(mentions),
            from_bot=from_bot,
            command=command,
            is_admin=is_admin,
        )

    async def _on_message(self, update: Update, _context: ContextTypes.DEFAULT_TYPE) -> None:
        message = update.message
        if message is None:
            return
        inbound = self.normalise(message)
        if inbound is None:
            return
        inbox = self._inboxes.get(inbound.chat)
        if inbox is None:
            queue: asyncio.Queue[Inbound | None] = asyncio.Queue()
            worker = asyncio.create_task(self._deliver(queue), name=f"telegram-inbox-{inbound.chat}")
            inbox = self._inboxes[inbound.chat] = _Inbox(queue, worker)
        inbox.queue.put_nowait(inbound)

    async def _deliver(self, queue: asyncio.Queue[Inbound | None]) -> None:
        """One worker per chat: a slow turn in one chat never holds up another, and order holds within a chat."""
        while (inbound := await queue.get()) is not None:
            handlers = self._handlers
            if handlers is None:
                continue
            try:
                await handlers.on_inbound(inbound)
            except Exception:
                count_failure("inbound", PLATFORM)
                _log.exception("telegram.inbound_failed", chat=inbound.chat, message_id=inbound.message_id)

    # ----------------------------------------------------------------- presses

    async def _on_callback_query(self, update: Update, _context: ContextTypes.DEFAULT_TYPE) -> None:
        query = update.callback_query
        if query is None:
            return
        self._track(asyncio.create_task(self._handle_press(query), name=f"telegram-press-{query.id}"))

    def _track(self, task: asyncio.Future[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle_press(self, query: CallbackQuery) -> None:
        actor = f"{PLATFORM}:{query.from_user.id}"
        data = query.data or ""
        handlers = self._handlers
        _log.info("telegram.press", actor=actor, data=_clip(data, 80), query=query.id)
        if not data or handlers is None:
            await self._answer(query, "This button is not active.", alert=True)
            return
        press: asyncio.Future[PressResult] = asyncio.ensure_future(handlers.on_press(data, actor, PLATFORM))
        self._track(press)
        try:
            # Shielded: a slow decision keeps running after we answer; only our wait ends.
            result = await asyncio.wait_for(asyncio.shield(press), timeout=self.press_timeout)
        except TimeoutError:
            press.add_done_callback(functools.partial(self._late_press_done, actor, data))
            _log.info("telegram.press_pending", actor=actor, query=query.id)
            await self._answer(query, PRESS_PENDING_TEXT, alert=False)
        except Exception as exc:
            count_failure("press", PLATFORM)
            _log.exception("telegram.press_failed", actor=actor, data=_clip(data, 80))
            await self._answer(query, f"Could not record your press: {exc or type(exc).__name__}", alert=True)
        else:
            alert = result.verdict in (PressVerdict.LOST, PressVerdict.REFUSED)
            _log.info("telegram.press_result", actor=actor, verdict=result.verdict.value, request=result.request_id)
            await self._answer(query, result.message, alert=alert)

    @staticmethod
    def _late_press_done(actor: str, data: str, press: asyncio.Future[PressResult]) -> None:
        if press.cancelled():
            return
        exc = press.exception()
        if exc is not None:
            count_failure("press", PLATFORM)
            _log.error("telegram.press_failed", actor=actor, data=_clip(data, 80), error=repr(exc))

    async def _answer(self, query: CallbackQuery, text: str, *, alert: bool) -> None:
        """Every query is answered, or the presser's client spins until Telegram gives up."""
        try:
            await query.answer(text=_clip(text, ANSWER_LIMIT), show_alert=alert)
        except Exception as exc:
            count_failure("press", PLATFORM)
            _log.warning("telegram.answer_failed", query=query.id, error=self._redact(f"{type(exc).__name__}: {exc}"))

    async def _on_error(self, update: object, context: ContextTypes.DEFAULT_TYPE) -> None:
        _log.error("telegram.update_failed", error=self._redact(repr(context.error)))

    def _on_poll_error(self, exc: TelegramError) -> None:
        count_failure("poll", PLATFORM)
        _log.warning("telegram.poll_failed", error=self._redact(f"{type(exc).__name__}: {exc}"))

    def _redact(self, text: str) -> str:
        token = self.config.token
        return text.replace(token, "<token>") if token else text

    # ----------------------------------------------------------------- outbound

    async def _call(self, site: str, chat_id: int, operation: Callable[[], Awaitable[_T]]) -> _T:
        """Pace, send, and on 429 hold the chat for ``retry_after`` and try again (bounded)."""
        chat = str(chat_id)
        limiter = self.limiter_for(chat_id)
        last_retry_after: float | None = None
        for attempt in range(1, self.max_attempts + 1):
            await limiter.acquire(chat)
            try:
                return await operation()
            except RetryAfter as exc:
                last_retry_after = _retry_after_seconds(exc)
                limiter.block(chat, last_retry_after)
                _log.warning(
                    "telegram.rate_limited", site=site, chat=chat, retry_after=last_retry_after, attempt=attempt
                )
            except Exception as exc:
                error = _platform_error(site, exc, token=self.config.token)
                self._failed(site, chat, error)
                raise error from exc
        error = PlatformError(
            PLATFORM,
            site,
            f"still rate limited after {self.max_attempts} attempts",
            retryable=True,
            retry_after=last_retry_after,
        )
        self._failed(site, chat, error)
        raise error

    @staticmethod
    def _failed(site: str, chat: str, error: PlatformError) -> None:
        count_failure(site, PLATFORM)
        _log.warning(f"telegram.{site}_failed", chat=chat, error=str(error), retryable=error.retryable)

    def _chat_id(self, site: str, chat: str) -> int:
        try:
            return int(chat)
        except ValueError:
            error = PlatformError(PLATFORM, site, f"not a Telegram chat id: {chat!r}", retryable=False)
            self._failed(site, chat, error)
            raise error from None

    async def send_text(self, chat: str, text: str, *, agent: str | None = None, thread: str | None = None) -> str:
        site = "send"
        app = self._bot_app(site)
        chat_id = self._chat_id(site, chat)
        thread_id = self._chat_id(site, thread) if thread else None
        prefix = agent_prefix(agent)
        # Plain text (no parse mode): nothing in it is markup, so nothing needs escaping or can format.
        parts = split_text(text, TEXT_LIMIT - utf16_len(prefix))
        if not parts:
            error = PlatformError(PLATFORM, site, "nothing to send: the text is empty", retryable=False)
            self._failed(site, chat, error)
            raise error
        first: str | None = None
        for part in parts:
            send = functools.partial(
                app.bot.send_message,
                chat_id=chat_id,
                text=prefix + part,
                message_thread_id=thread_id,
                link_preview_options=_NO_PREVIEW,
            )
            message: Message = await self._call(site, chat_id, send)
            first = first or str(message.message_id)
        assert first is not None
        _log.debug("telegram.sent", chat=chat, message_id=first, parts=len(parts), agent=agent)
        return first

    async def post_card(self, card: ApprovalCard) -> CardRef:
        site = "card_post"
        app = self._bot_app(site)
        home = self.home_chat
        if home is None:
            error = PlatformError(PLATFORM, site, "no home_chat configured for approval cards", retryable=False)
            self._failed(site, "", error)
            raise error
        chat_id = self._chat_id(site, home)
        keyboard = card_keyboard(card)
        for row in keyboard.inline_keyboard:
            for button in row:
                data = button.callback_data if isinstance(button.callback_data, str) else ""
                if not 1 <= len(data.encode("utf-8")) <= CALLBACK_DATA_LIMIT:
                    error = PlatformError(
                        PLATFORM, site, f"button data of {len(data.encode())} bytes does not fit 1-64", retryable=False
                    )
                    self._failed(site, home, error)
                    raise error
        try:
            rendered = render_card(card)
        except CardTooLarge as exc:
            error = PlatformError(PLATFORM, site, str(exc), retryable=False)
            self._failed(site, home, error)
            raise error from exc
        send = functools.partial(
            app.bot.send_message,
            chat_id=chat_id,
            text=rendered.html,
            parse_mode=ParseMode.HTML,
            reply_markup=keyboard,
            link_preview_options=_NO_PREVIEW,
        )
        message: Message = await self._call(site, chat_id, send)
        _log.info(
            "telegram.card_posted",
            request=card.request_id,
            chat=home,
            message_id=message.message_id,
            length=rendered.visible_length,
            names_only=rendered.names_only,
        )
        return CardRef(platform=PLATFORM, chat=home, message_id=str(message.message_id))

    async def settle_card(self, ref: CardRef, card: ApprovalCard, outcome: Outcome) -> None:
        site = "card_settle"
        app = self._bot_app(site)
        if ref.platform != PLATFORM:
            error = PlatformError(PLATFORM, site, f"not a Telegram card: {ref.platform}", retryable=False)
            self._failed(site, ref.chat, error)
            raise error
        chat_id = self._chat_id(site, ref.chat)
        message_id = self._chat_id(site, ref.message_id)
        try:
            rendered = render_card(card, outcome=outcome)
        except CardTooLarge as exc:
            error = PlatformError(PLATFORM, site, str(exc), retryable=False)
            self._failed(site, ref.chat, error)
            raise error from exc

        async def edit() -> bool:
            try:
                # No reply_markup: Telegram drops the inline keyboard, so the buttons cannot be pressed again.
                await app.bot.edit_message_text(
                    text=rendered.html,
                    chat_id=chat_id,
                    message_id=message_id,
                    parse_mode=ParseMode.HTML,
                    link_preview_options=_NO_PREVIEW,
                )
            except BadRequest as exc:
                if "message is not modified" in str(exc).lower():
                    return False  # already shows this outcome: settling is idempotent
                raise
            return True

        changed = await self._call(site, chat_id, edit)
        _log.info(
            "telegram.card_settled",
            request=card.request_id,
            chat=ref.chat,
            message_id=ref.message_id,
            status=outcome.status.value,
            changed=changed,
        )
