"""The Telegram adapter on python-telegram-bot: transport and lifecycle only.

PTB's ``Application`` and ``Updater`` run inside our own event loop (no
``run_polling``), so start and stop are ordinary awaits the bus controls.
Pacing is PTB's own hook: a :class:`BaseRateLimiter` that hands every send and
edit to the shared :class:`~kazma.adapters.pacing.Pacing`, so per-chat limits
and Telegram's ``retry_after`` hold for every call the bot makes. What a card
looks like is ``render.py``; what a failure means is ``errors.py``; the
inbound door and the press policy are the kit's.

Long polling is the singleton ingress (one ``getUpdates`` per bot: a second
ends the first with 409): a replica that is not the leader initializes the bot
for sending and never polls. Stopping the poller lets PTB confirm what it
fetched (one last ``getUpdates`` with the next offset) and lets the
application hand every fetched update to the kit before it returns; an update
fetched but never confirmed (a replica killed) comes again to the next leader,
where its claim (the bot id and the update id) keeps it from being handled
twice. A webhook is HTTP ingress, served by every replica.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import Future
from datetime import timedelta
from typing import Any, Final, Unpack

import httpx
import structlog
from telegram import (
    BotCommand,
    CallbackQuery,
    ForceReply,
    InlineKeyboardButton,
    InlineKeyboardMarkup,
    LinkPreviewOptions,
    Message,
    MessageEntity,
    ReplyParameters,
    Update,
)
from telegram.constants import ChatAction, ParseMode
from telegram.error import ChatMigrated, TelegramError
from telegram.ext import (
    Application,
    ApplicationBuilder,
    CallbackQueryHandler,
    ContextTypes,
    MessageHandler,
    TypeHandler,
    Updater,
    filters,
)

from kazma.adapters.card_layout import LaidOut, agent_prefix
from kazma.adapters.chat_commands import CHAT_COMMANDS
from kazma.adapters.chat_text import Columns
from kazma.adapters.contract import CardRef, Inbound, PlatformError, Press
from kazma.adapters.deny_reason import PROMPT_NO_WORDS, reason_request, reply_prompt
from kazma.adapters.kit import InboundStreak, KitOptions, PlatformBase, Posted
from kazma.adapters.pacing import ChatRateLimiter, Pacing
from kazma.adapters.press_policy import PRESS_NOT_ON_MESSAGE
from kazma.adapters.telegram.errors import PLATFORM, classify, not_modified
from kazma.adapters.telegram.hooks import InboxRequest, KazmaPacing, QueryReply, clip, streamed_edit
from kazma.adapters.telegram.inbound import normalise
from kazma.adapters.telegram.reasons import Prompt, prompt_of, who_entity
from kazma.adapters.telegram.render import (
    CALLBACK_DATA_LIMIT,
    TEXT_LIMIT,
    button_data_fits,
    mini_app_button,
    render_card,
    utf16_len,
    utf16_units,
    with_button,
)
from kazma.adapters.telegram.transport import AiohttpRequest
from kazma.approvals.card import ApprovalCard
from kazma.approvals.model import Outcome
from kazma.config import failpoints
from kazma.config.metrics import count_failure
from kazma.config.models import TelegramConfig

_NO_PREVIEW: Final = LinkPreviewOptions(is_disabled=True)
CAPTION_LIMIT: Final = 1024  # a document's caption, in UTF-16 units after parsing
# The Bot API's getFile hands a bot files up to 20 MB; files.max_bytes may allow more ("File is too big").
BOT_DOWNLOAD_MAX_BYTES: Final = 20 * 1024 * 1024
_ALLOWED_UPDATES: Final = [Update.MESSAGE, Update.CALLBACK_QUERY]
# Of a group's 20 sends a minute, those a streamed reply's edits leave to cards and new messages: a long reply
# grows more slowly in a busy minute instead of making the next approval card wait for the minute to pass.
DRAFTS_LEAVE: Final = 5

log = structlog.get_logger("kazma.adapters.telegram")

AnyApplication = Application[Any, Any, Any, Any, Any, Any]


class _ChatReply:
    """The answer to a reason given by reply: Telegram has no private answer to a message, so it replies to it
    (a winner's answer is the card's edit)."""

    def __init__(self, adapter: TelegramAdapter, chat: str, message_id: int) -> None:
        self.adapter = adapter
        self.chat = chat
        self.message_id = message_id

    async def acknowledge(self, text: str) -> None:
        return None

    async def notify(self, text: str) -> None:
        app = self.adapter._bot_app("press_reply")
        # Paced, and a 429 waited out, by PTB's rate-limit hook like every send: not a second time around it.
        await self.adapter._send(
            "press_reply",
            self.chat,
            lambda chat_id: app.bot.send_message(
                chat_id=chat_id, text=clip(text, 4000),
                reply_parameters=ReplyParameters(message_id=self.message_id, allow_sending_without_reply=True),
            ),
        )  # fmt: skip


class TelegramAdapter(PlatformBase):
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
        max_attempts: int = 5,
        **options: Unpack[KitOptions],
    ) -> None:
        # Telegram allows about one message a second in any chat and twenty a minute in a group.
        chosen = limiter or ChatRateLimiter(
            min_interval=1.0,
            per_window=20,
            window=60.0,
            windowed=lambda chat: chat.startswith("-"),
            drafts_leave=DRAFTS_LEAVE,
        )
        super().__init__(config, pacing=Pacing(chosen, max_attempts=max_attempts), **options)
        self.files = dataclasses.replace(self.files, platform_max_bytes=BOT_DOWNLOAD_MAX_BYTES, platform="Telegram")
        self.config: TelegramConfig = config
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self.poll_timeout = poll_timeout
        self.reason_clock: Callable[[], float] = time.time  # against a prompt's date, which is wall-clock time
        self._app: AnyApplication | None = None
        self._bot_username = ""
        self._bot_id = ""
        self._requests: tuple[AiohttpRequest, ...] = ()
        self._tls: ssl.SSLContext | None = None  # one for both HTTP clients, taken at the first start
        # Loading every root certificate takes ~20-30 ms, nearly all of it in OpenSSL with the GIL released: made
        # on a thread from here, it is ready by the time the platforms connect (the other platforms' libraries
        # import meanwhile) instead of holding the event loop while all three platforms start.
        self._tls_made = _tls_soon()
        self._poll_streak = InboundStreak("getUpdates (long polling)")  # its failures in a row, for /healthz
        # Why PTB's poller ended by itself (a refused token), while the ingress is not open again; None otherwise
        self._poll_ended: str | None = None

    @property
    def bot_username(self) -> str:
        """The bot's username (lowercase) once started; empty before."""
        return self._bot_username

    def classify(self, site: str, exc: BaseException) -> PlatformError:
        return classify(site, exc, token=self.config.token)

    @property
    def has_singleton_ingress(self) -> bool:
        return self.config.mode != "webhook"

    @property
    def ingress_trouble(self) -> str | None:
        if not self.has_singleton_ingress:
            return None
        if self.ingress_running:
            return self._poll_streak.trouble
        return self._poll_ended  # why it is not open: the bus adds that it is opened again with backoff

    def _polled(self, failure: str | None, ended: bool) -> None:
        if failure is None:
            self._poll_streak.succeeded()
        elif ended:
            self._poller_ended(failure)
        else:
            self._poll_streak.failed(failure)

    def _poller_ended(self, failure: str) -> None:
        """PTB's poller gives up for good after a 401 or 404 on getUpdates (InvalidToken), without a word to its
        error callback and with its Updater still saying it runs: nothing comes in from Telegram any more. The
        ingress is no longer running, so the ingress check (the leader's, or a process alone on its store) opens
        it again with backoff, and polling resumes once the token is good again (fixed at BotFather, or
        Telegram's 401 a passing fault). Before, the adapter still said it polled and only a restart helped."""
        app = self._app
        if not self._ingress or self._stopping or app is None or app.updater is None or not app.updater.running:
            return  # a stop's last getUpdates (confirming what was fetched), not the poller's
        self._ingress = False
        self._poll_ended = f"getUpdates (long polling) ended, python-telegram-bot does not poll again: {failure}"
        count_failure("ingress_lost", PLATFORM)
        log.error("telegram.polling_ended", error=failure)

    # ----------------------------------------------------------------- lifecycle

    def _build_application(self) -> AnyApplication:
        # We own the HTTP clients so that a start that fails half-way (PTB then considers itself
        # not initialised and its shutdown does nothing) can still close them. They share one TLS context, made
        # as httpx makes its own (certifi's roots, or SSL_CERT_FILE/SSL_CERT_DIR): each client made its own, and
        # each one loads every root certificate (about 3 MB and 30 ms of CPU, at every start). They are aiohttp's,
        # not PTB's default httpx (transport.py: a tenth of the CPU per call).
        if self._tls is None:
            self._tls = self._tls_made.result()  # raises what making it raised (a bad SSL_CERT_FILE, say)
        self._requests = tuple(
            kind(
                connection_pool_size=size,
                connect_timeout=self.connect_timeout,
                read_timeout=self.request_timeout,  # for getUpdates PTB adds the long-poll timeout on top
                write_timeout=self.request_timeout,
                pool_timeout=self.request_timeout,
                tls=self._tls,
                api_url=self.config.api_base_url,
            )
            for kind, size in ((AiohttpRequest, 64), (InboxRequest, 1))
        )
        general, polling = self._requests
        if isinstance(polling, InboxRequest):
            polling.keep = self._keep_fetched
            polling.polled = self._polled
        base = self.config.api_base_url
        return (
            ApplicationBuilder()
            .token(self.config.token)
            .base_url(f"{base}/bot")
            .base_file_url(f"{base}/file/bot")
            .request(general)
            .get_updates_request(polling)
            .rate_limiter(KazmaPacing(self.pacing, self._rate_limited))
            .build()
        )

    def _rate_limited(self, chat: str, wait: float, attempt: int) -> None:
        self.rate_limited("request", chat, wait, attempt)  # PTB's hook knows the chat, not the call

    async def _connect(self) -> None:
        app = self._build_application()
        app.add_handler(
            MessageHandler(
                filters.UpdateType.MESSAGE & (filters.TEXT | filters.CAPTION | filters.Document.ALL | filters.PHOTO),
                self._on_message,
            )
        )
        app.add_handler(CallbackQueryHandler(self._on_callback_query))
        app.add_handler(MessageHandler(filters.StatusUpdate.MIGRATE, self._on_migrate))
        # Last of its group: PTB calls it only for an update no handler above took (a sticker, a service message).
        app.add_handler(TypeHandler(Update, self._on_unhandled))
        app.add_error_handler(self._on_error)
        await app.initialize()  # getMe: a bad token or an unreachable server stops us here
        self._bot_username = (app.bot.username or "").lower()
        self._bot_id = str(app.bot.id)
        self._app = app  # from here a handler reacting to the first update can already reply
        await self._register_commands(app)
        if self.config.mode == "webhook":
            hook = self.config.webhook
            await app.start()
            await self._updater(app).start_webhook(
                listen=hook.listen,
                port=hook.port,
                url_path=hook.path,
                webhook_url=hook.url,
                secret_token=hook.secret_token,
                allowed_updates=_ALLOWED_UPDATES,
            )
        log.info("telegram.connected", mode=self.config.mode, bot=self._bot_username, chats=sorted(self.served.chats))

    @staticmethod
    def _updater(app: AnyApplication) -> Updater:
        if app.updater is None:  # pragma: no cover - ApplicationBuilder always makes one
            raise RuntimeError("python-telegram-bot built no updater")
        return app.updater

    async def _open_ingress(self) -> None:
        """Long polling: the application's update processing, what a gone leader kept and never took in,
        then the poller feeding it."""
        app = self._bot_app("ingress_start")
        if not app.running:
            await app.start()
        inbox = None if self._handlers is None else self._handlers.inbox
        if inbox is not None:
            for payload in await inbox.unfinished(PLATFORM):
                update = Update.de_json(json.loads(payload), app.bot)
                if update is not None:
                    log.warning("telegram.update_taken_over", update_id=update.update_id)
                    await app.update_queue.put(update)
        updater = self._updater(app)
        if updater.running:
            # The poller ended by itself (_poller_ended): PTB's stop then raises what ended it and leaves the
            # Updater's stop signal set, so that Updater would never poll again. A new one takes its place; what
            # the old one fetched and never confirmed comes again, and the inbound claims take it in once.
            with contextlib.suppress(TelegramError):
                await updater.stop()
            app.updater = updater = Updater(bot=app.bot, update_queue=app.update_queue)
            await updater.initialize()
        self._poll_streak = InboundStreak("getUpdates (long polling)")
        await updater.start_polling(
            timeout=timedelta(seconds=int(self.poll_timeout)),
            allowed_updates=_ALLOWED_UPDATES,
            error_callback=self._on_poll_error,
        )
        self._poll_ended = None
        log.info("telegram.polling", bot=self._bot_username)

    async def _close_ingress(self) -> None:
        """The poller first (PTB confirms what it fetched), then the application, which hands every update
        still queued to the kit before it stops; the bot keeps sending."""
        app = self._app
        if app is None:
            return
        try:
            if app.updater is not None and app.updater.running:
                await app.updater.stop()
        finally:
            if app.running:
                await app.stop()
        # Everything queued was handed to the kit above: what the poller kept and nothing let through (its
        # last fetch, which PTB drops on the way out) goes back to Telegram for the next leader.
        inbox = None if self._handlers is None else self._handlers.inbox
        if inbox is not None:
            try:
                await inbox.release_unhandled(PLATFORM)
            except Exception as exc:
                count_failure("inbound_inbox", PLATFORM)
                log.warning("telegram.inbox_release_failed", error=str(exc) or type(exc).__name__)
        log.info("telegram.polling_stopped", bot=self._bot_username)

    async def _register_commands(self, app: AnyApplication) -> None:
        # Only a convenience (the command menu): a failure here must not keep the bus down.
        try:
            await app.bot.set_my_commands([BotCommand(c.name, c.summary) for c in CHAT_COMMANDS])
        except TelegramError as exc:
            log.warning("telegram.commands_not_set", error=self._redact(str(exc)))

    async def _stop_receiving(self) -> None:
        app = self._app
        if app is None:
            return
        with contextlib.suppress(Exception):
            if app.updater is not None and app.updater.running:
                await app.updater.stop()
        with contextlib.suppress(Exception):
            if app.running:
                await app.stop()  # no update callback runs after this

    async def _disconnect(self) -> None:
        app, self._app = self._app, None
        if app is not None:
            with contextlib.suppress(Exception):
                await app.shutdown()
        requests, self._requests = self._requests, ()
        for request in requests:
            with contextlib.suppress(Exception):
                await request.shutdown()

    def _bot_app(self, site: str) -> AnyApplication:
        if self._app is None:
            raise self.refuse(site, "the adapter is not started", retryable=True)
        return self._app

    # ----------------------------------------------------------------- inbound

    def normalise(self, message: Message) -> Inbound | None:
        """The neutral form of ``message`` (:func:`~kazma.adapters.telegram.inbound.normalise`)."""
        return normalise(
            message, bot_username=self._bot_username, actor=self.actor, is_admin=self.is_admin, fetcher=self._fetcher
        )

    def _fetcher(self, file_id: str) -> Callable[[], Coroutine[Any, Any, bytes]]:
        async def fetch() -> bytes:
            app = self._bot_app("file_fetch")

            async def download() -> bytes:
                file = await app.bot.get_file(file_id)
                return bytes(await file.download_as_bytearray())

            return await self.call("file_fetch", None, download, paced=False, wait_out_429=False)

        return fetch

    async def _keep_fetched(self, body: bytes) -> None:
        """Keep what one ``getUpdates`` returned in the inbox, keyed as the kit claims them."""
        inbox = None if self._handlers is None else self._handlers.inbox
        if inbox is None or not self._bot_id:
            return
        answer = json.loads(body)
        updates = answer.get("result") if isinstance(answer, dict) and answer.get("ok") else None
        if not isinstance(updates, list) or not updates:
            return
        events = [(f"{self._bot_id}:{u['update_id']}", json.dumps(u)) for u in updates if isinstance(u, dict)]
        await inbox.fetched(PLATFORM, events)
        if failpoints.armed:  # kept in the inbox, not confirmed to Telegram yet (the next getUpdates confirms)
            await failpoints.reached("telegram.inbox", lambda: OSError("the inbox could not be written (failpoint)"))

    def update_key(self, update: Update) -> str:
        """An update's claim key: update ids are counted per bot, so the bot's id comes with them."""
        return f"{self._bot_id}:{update.update_id}"

    async def _on_message(self, update: Update, _context: ContextTypes.DEFAULT_TYPE) -> None:
        message = update.message
        if message is None:
            return
        replied = message.reply_to_message
        prompt = None if replied is None or not self._bot_id else prompt_of(replied, int(self._bot_id))
        if prompt is not None and message.from_user is not None:
            # A reply to a reason prompt is never chat for the agents, whoever sends it and however late.
            self.spawn(self._reason_given(message, prompt, update), name="telegram-reason")
            return
        inbound = self.normalise(message)
        if inbound is None:  # a command for another bot
            self._ignored(update)
            return
        # PTB handles updates one at a time: hand the delivery off so a slow turn never holds the poller.
        self.spawn(
            self.deliver(inbound, key=self.update_key(update)),
            name=f"telegram-inbound-{inbound.chat}-{inbound.message_id}",
        )

    async def _on_unhandled(self, update: Update, _context: ContextTypes.DEFAULT_TYPE) -> None:
        """An update Kazma does nothing with is taken in all the same: left in the inbox as unfinished, every next
        leader took it over (renewing its age, so retention never dropped it) and handed it over again."""
        self._ignored(update)

    def _ignored(self, update: Update) -> None:
        """Finish ``update``'s inbox entry: only a poller keeps one (a webhook's update has nothing to finish)."""
        if self.has_singleton_ingress and self._handlers is not None and self._handlers.inbox is not None:
            self.spawn(self._taken_in(self.update_key(update)), name=f"telegram-ignored-{update.update_id}")

    async def _on_migrate(self, update: Update, _context: ContextTypes.DEFAULT_TYPE) -> None:
        """A group became a supergroup (a new chat id): Telegram says so in the old chat and in the new one."""
        message = update.message
        if message is None:
            return
        if message.migrate_to_chat_id:
            old, new = message.chat.id, message.migrate_to_chat_id
        elif message.migrate_from_chat_id:
            old, new = message.migrate_from_chat_id, message.chat.id
        else:  # pragma: no cover - the filter lets only these two through
            return
        self.spawn(self._moved(update, str(old), str(new)), name=f"telegram-chat-moved-{old}")

    async def _moved(self, update: Update, old: str, new: str) -> None:
        await self.chat_moved(old, new)  # told twice (once in each chat), the second changes nothing
        await self._taken_in(self.update_key(update))

    async def _on_callback_query(self, update: Update, _context: ContextTypes.DEFAULT_TYPE) -> None:
        query = update.callback_query
        if query is None:
            return
        message = query.message
        if not _on_its_message(query):
            # Telegram does not check a query's data against the pressed message: a modified client sends any
            # data on any of the bot's messages (a Deny of an ended request on another request's open card, whose
            # buttons the "card found" path would then take away). Refused here, counted as evidence.
            count_failure("press_unbound", PLATFORM)
            log.warning(
                "telegram.press_unbound",
                actor=self.actor(query.from_user.id),
                chat=message.chat.id if message is not None else None,
                message_id=message.message_id if message is not None else None,
                data=(query.data or "")[:80],
            )
            refused = QueryReply(query).notify
            self.spawn(
                self._once(update, lambda: self._reply(refused, PRESS_NOT_ON_MESSAGE)),
                name=f"telegram-press-{query.id}",
            )
            return
        asked = reason_request(query.data or "")
        if asked is not None and message is not None:
            self.spawn(self._once(update, lambda: self._ask_reason(query, asked)), name=f"telegram-reason-{query.id}")
            return
        press = Press(
            platform=PLATFORM,
            data=query.data or "",
            actor=self.actor(query.from_user.id),
            chat=str(message.chat.id) if message is not None else None,
            message_id=str(message.message_id) if message is not None else None,
            is_admin=self.is_admin(query.from_user.id),
        )
        reply = QueryReply(
            query, late=None if message is None else self._late_notice(query, message.chat.id, message.message_id)
        )
        self.spawn(self.press(press, reply, key=self.update_key(update)), name=f"telegram-press-{query.id}")

    async def _once(self, update: Update, answer: Callable[[], Awaitable[None]]) -> None:
        """``answer`` an update that is no press to decide (a reason prompt, a refusal), on one replica once.

        The poller kept the update in the inbox before confirming it: one never claimed and taken in stays there
        as unfinished, and the next leader (or this replica's next life) hands it over again, so the group saw a
        second prompt or refusal. Taken in only once answered: a replica that dies before that leaves it to the
        next leader, as a press is left.
        """
        key = self.update_key(update)
        if not await self._claim(key):
            return
        await answer()
        await self._taken_in(key)

    def _late_notice(self, query: CallbackQuery, chat: int, card: int) -> Callable[[str], Awaitable[None]]:
        """A notice for the presser after their press was answered already: Telegram answers a query once, so it
        is a reply to the card, naming them."""
        who = f"@{query.from_user.username}" if query.from_user.username else query.from_user.first_name

        async def notice(text: str) -> None:
            await _ChatReply(self, str(chat), card).notify(f"{who}: {text}")

        return notice

    async def _ask_reason(self, query: CallbackQuery, request_id: str) -> None:
        """ "Deny with reason": a prompt replying to the card, bound to the presser for a short window."""
        message = query.message
        assert message is not None
        chat = str(message.chat.id)
        refusal = await self._reason_refusal(self.actor(query.from_user.id), request_id)
        if refusal is not None:
            # The prompt is posted in the group: nobody whose press would not count makes the bot post it, and
            # nobody is asked for the reason of a request that is decided already.
            with contextlib.suppress(PlatformError):
                await self.call("press_reply", chat, lambda: query.answer(text=clip(refusal, 200), show_alert=True),
                                paced=False)  # fmt: skip
            log.info("telegram.reason_refused", actor=self.actor(query.from_user.id), request_id=request_id)
            return
        who = f"@{query.from_user.username}" if query.from_user.username else query.from_user.first_name
        app = self._bot_app("reason_prompt")
        with contextlib.suppress(PlatformError):
            await self.call("press_reply", chat, lambda: query.answer(text="Reply to my message with your reason."),
                            paced=False)  # fmt: skip
        try:
            sent = await self._send(  # paced by PTB's rate-limit hook, as every send is
                "reason_prompt",
                chat,
                lambda chat_id: app.bot.send_message(
                    chat_id=chat_id,
                    text=reply_prompt(request_id, who),
                    entities=[who_entity(who, query.from_user.id, utf16_len(who))],
                    reply_parameters=ReplyParameters(message_id=message.message_id, allow_sending_without_reply=True),
                    reply_markup=ForceReply(selective=True),
                ),
            )
        except PlatformError:
            return  # counted and logged by the kit; the person can press again
        log.info("telegram.reason_asked", actor=self.actor(query.from_user.id), request_id=request_id,
                 prompt=sent.message_id)  # fmt: skip

    async def _reason_given(self, message: Message, prompt: Prompt, update: Update) -> None:
        """A reply to a reason prompt: the presser's words, in time, deny the request through the one press
        policy; anybody else's, or late ones, are refused (and handed to nobody)."""
        user = message.from_user
        assert user is not None
        reply = _ChatReply(self, str(message.chat.id), message.message_id)
        refusal = prompt.refusal(user.id, user.username, self.reason_clock())
        words = (message.text or message.caption or "").strip()
        if refusal is None and not words:
            # A photo or a file alone (a screenshot as the reason) denied with no reason at all: the picture was
            # dropped and everyone was told of a bare denial. The prompt stands for a reply with words.
            refusal = PROMPT_NO_WORDS
        if refusal is not None:

            async def refuse() -> None:
                log.info("telegram.reason_reply_refused", actor=self.actor(user.id), data=prompt.data, why=refusal)
                await self._reply(reply.notify, refusal)

            await self._once(update, refuse)
            return
        press = Press(
            platform=PLATFORM,
            data=prompt.data,
            actor=self.actor(user.id),
            # The card's chat: the prompt replied to the card, which Telegram does not hand with a reply to the
            # prompt; the press is held to a card of its request in this chat.
            chat=str(message.chat.id),
            message_id=None,
            is_admin=self.is_admin(user.id),
            reason=words,
        )
        await self.press(press, reply, key=self.update_key(update))

    async def _on_error(self, update: object, context: ContextTypes.DEFAULT_TYPE) -> None:
        log.error("telegram.update_failed", error=self._redact(repr(context.error)))

    def _on_poll_error(self, exc: TelegramError) -> None:
        self.failed("poll", None, self.classify("poll", exc))

    def _redact(self, text: str) -> str:
        token = self.config.token
        return text.replace(token, "<token>") if token else text

    # ----------------------------------------------------------------- outbound

    def _chat_id(self, site: str, chat: str) -> int:
        try:
            return int(chat)
        except ValueError:
            raise self.refuse(site, f"not a Telegram chat id: {chat!r}", chat=chat) from None

    def _can_send(self, site: str) -> None:
        self._bot_app(site)

    def _text_room(self, agent: str | None) -> tuple[int, Callable[[str], int] | None]:
        # Plain text (no parse mode): nothing in it is markup, so nothing needs escaping or can format.
        return TEXT_LIMIT - utf16_len(agent_prefix(agent)), utf16_units

    def _thread_id(self, site: str, thread: str | None) -> int | None:
        return self._chat_id(site, thread) if thread else None

    async def _post_text(self, chat: str, part: str, *, agent: str | None, thread: str | None) -> Posted:
        app = self._bot_app("send")
        thread_id = self._thread_id("send", thread)
        prefix = agent_prefix(agent)
        text = prefix + part
        # Columns are laid out by an entity (fixed width over the part, the prefix left out): nothing to escape
        pre = MessageEntity(MessageEntity.PRE, offset=utf16_len(prefix), length=utf16_len(part))
        entities = [pre] if isinstance(part, Columns) else None
        message = await self._send(
            "send",
            chat,
            lambda chat_id: app.bot.send_message(
                chat_id=chat_id, text=text, message_thread_id=thread_id, link_preview_options=_NO_PREVIEW,
                entities=entities,
            ),
        )  # fmt: skip
        return Posted(str(message.chat_id), str(message.message_id))

    edits_text = True

    async def _edit_text(self, chat: str, message_id: str, part: str, *, agent: str | None, thread: str | None) -> None:
        app = self._bot_app("stream")
        chat_id = self._chat_id("stream", chat)
        number = self._chat_id("stream", message_id)

        async def edit() -> None:
            token = streamed_edit.set(True)
            try:
                await app.bot.edit_message_text(
                    text=agent_prefix(agent) + part, chat_id=chat_id, message_id=number,
                    link_preview_options=_NO_PREVIEW,
                )  # fmt: skip
            except Exception as exc:
                if not not_modified(exc):  # already shows it
                    raise
            finally:
                streamed_edit.reset(token)

        # paced (and a 429 waited out) by PTB's rate-limit hook, in the chat's turn like a post
        await self.call("stream", chat, edit, paced=False, wait_out_429=False)

    async def _post_choices(
        self, chat: str, body: str, choices: Sequence[tuple[str, str]], *, thread: str | None
    ) -> str:
        site = "send"
        app = self._bot_app(site)
        thread_id = self._thread_id(site, thread)
        if any(not 1 <= len(data.encode()) <= CALLBACK_DATA_LIMIT for _, data in choices):
            raise self.refuse(site, "every choice needs button data of 1 to 64 bytes", chat=chat)
        keyboard = (
            InlineKeyboardMarkup([[InlineKeyboardButton(label[:64], callback_data=data)] for label, data in choices])
            if choices
            else None
        )
        message = await self._send(
            site,
            chat,
            lambda chat_id: app.bot.send_message(
                chat_id=chat_id,
                text=body,
                message_thread_id=thread_id,
                reply_markup=keyboard,
                link_preview_options=_NO_PREVIEW,
            ),
        )
        return str(message.message_id)

    async def _send(self, site: str, chat: str, send: Callable[[int], Coroutine[Any, Any, Message]]) -> Message:
        """One send into ``chat``; when Telegram says the group became a supergroup, follow it and send there.

        Paced and retried by PTB's rate-limit hook, so neither is done again here.
        """
        try:
            return await self.call(site, chat, lambda: send(int(chat)), paced=False, wait_out_429=False)
        except PlatformError as error:
            migrated = error.__cause__
            if not isinstance(migrated, ChatMigrated):
                raise
            new = str(migrated.new_chat_id)
            await self.chat_moved(chat, new)
            return await self.call(site, new, lambda: send(int(new)), paced=False, wait_out_429=False)

    async def _post_file(self, chat: str, name: str, data: bytes, *, caption: str, thread: str | None) -> str:
        site = "send_file"
        app = self._bot_app(site)
        self._chat_id(site, chat)
        thread_id = self._chat_id(site, thread) if thread else None
        message = await self._send(
            site,
            chat,
            lambda chat_id: app.bot.send_document(
                chat_id=chat_id,
                document=data,
                filename=name,
                caption=clip(caption, CAPTION_LIMIT),
                message_thread_id=thread_id,
                disable_content_type_detection=True,
            ),
        )
        return str(message.message_id)

    async def _show_working(self, chat: str, thread: str | None) -> None:
        app = self._bot_app("working")
        chat_id = self._chat_id("working", chat)
        thread_id = self._chat_id("working", thread) if thread else None
        # Paced by PTB's hook like any send; a chat action fades after 5 s or at the next message.
        await app.bot.send_chat_action(chat_id=chat_id, action=ChatAction.TYPING, message_thread_id=thread_id)

    async def direct_chat(self, user: str) -> str:
        """A private chat's id is its user's id; Telegram refuses the post (403) if they never started the bot."""
        return str(self._chat_id("card_post", user))

    def _write_card(self, card: ApprovalCard, outcome: Outcome | None) -> LaidOut[Any]:
        laid = render_card(card, outcome=outcome, approve_partial=self.approve_partial)
        if not button_data_fits(laid.view):
            raise ValueError("button data does not fit Telegram's 1-64 bytes")
        return laid

    async def _post_card(self, chat: str, laid: LaidOut[Any], card: ApprovalCard) -> Posted:
        app = self._bot_app("card_post")
        written = laid.written
        opens = mini_app_button(card, chat, bot_username=self._bot_username, short_name=self.config.mini_app)
        markup = with_button(written.keyboard, opens)
        message = await self._send(
            "card_post",
            chat,
            lambda chat_id: app.bot.send_message(
                chat_id=chat_id,
                text=written.html,
                parse_mode=ParseMode.HTML,
                reply_markup=markup,
                link_preview_options=_NO_PREVIEW,
            ),
        )
        # the card is where it landed, in a chat that moved included
        return Posted(str(message.chat_id), str(message.message_id))

    async def _edit_card(
        self, site: str, ref: CardRef, laid: LaidOut[Any], card: ApprovalCard, *, settled: bool
    ) -> bool:
        app = self._bot_app(site)
        chat_id = self._chat_id(site, ref.chat)
        message_id = self._chat_id(site, ref.message_id)
        written = laid.written
        # Settled: no reply_markup, so Telegram drops the inline keyboard and the buttons cannot be pressed again.
        markup = None
        if not settled:
            opens = mini_app_button(card, ref.chat, bot_username=self._bot_username, short_name=self.config.mini_app)
            markup = with_button(written.keyboard, opens)

        async def edit() -> bool:
            try:
                await app.bot.edit_message_text(
                    text=written.html,
                    chat_id=chat_id,
                    message_id=message_id,
                    parse_mode=ParseMode.HTML,
                    reply_markup=markup,
                    link_preview_options=_NO_PREVIEW,
                )
            except Exception as exc:
                if not_modified(exc):
                    return False  # already shows this: editing is idempotent
                raise
            return True

        return await self.call(site, ref.chat, edit, paced=False, wait_out_429=False)


def _on_its_message(query: CallbackQuery) -> bool:
    """Whether ``query``'s data is a button of the message it says was pressed (the message as Telegram holds it
    now). A message with no buttons left (a card settled as it was pressed: its presser is told what stands), one
    Telegram no longer shows the bot (too old, deleted) or an inline one cannot be checked: its press goes on to be
    judged by where it came from, as every press is (the store never takes another request's card for one of a
    request found late: FoundCard.ANOTHERS)."""
    message = query.message
    if not isinstance(message, Message):
        return True
    markup = message.reply_markup
    rows = markup.inline_keyboard if markup is not None else ()
    if not any(rows):
        return True
    return any(button.callback_data == query.data for row in rows for button in row)


def _tls_soon() -> Future[ssl.SSLContext]:
    """httpx's TLS context (certifi's roots, or SSL_CERT_FILE/SSL_CERT_DIR), made on a thread of its own."""
    made: Future[ssl.SSLContext] = Future()

    def make() -> None:
        try:
            made.set_result(httpx.create_ssl_context())
        except BaseException as exc:  # handed to whoever takes it, as if it had been made there
            made.set_exception(exc)

    threading.Thread(target=make, name="kazma-telegram-tls", daemon=True).start()
    return made
